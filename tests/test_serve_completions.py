"""Legacy completions with ``echo`` and ``logprobs`` (issue 31): the prompt's tokens' log-probs, against
independent references (transformers' forward, the library's exact choice scoring)."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")


MODEL = "tiny"


# model_dir, server, client, lib: the shared module-scoped fixtures of tests/serve_fixtures.py (via conftest)


def hf_prompt_logprobs(model_dir, text):
    """The independent reference: transformers' own model over the prompt, log-softmax of each column."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok, hf = AutoTokenizer.from_pretrained(model_dir), AutoModelForCausalLM.from_pretrained(model_dir)
    ids = tok(text)["input_ids"]
    with torch.no_grad():
        lp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
    return ids, [lp[i - 1, ids[i]].item() for i in range(1, len(ids))], lp


@pytest.mark.parametrize("max_tokens", [0, 3])
def test_completions_echo_logprobs_cover_the_prompt(client, model_dir, max_tokens):
    """Issue 31: ``echo`` with ``logprobs`` returns every prompt token's log-prob (the first null) and its
    top alternatives, for max_tokens 0 and more, equal to transformers' forward over the prompt; a
    token-id prompt (what lm-eval sends) gives the same; streaming sends them in the echo chunk."""
    text = "Once upon a time there was a cat"
    ids, ref, lp = hf_prompt_logprobs(model_dir, text)
    r = client.completions.create(model=MODEL, prompt=text, max_tokens=max_tokens, temperature=0, logprobs=3, echo=True)
    got = r.choices[0].logprobs
    assert r.usage.prompt_tokens == len(ids) and len(got.tokens) == len(ids) + max_tokens == r.usage.total_tokens
    assert got.token_logprobs[0] is None and got.top_logprobs[0] is None
    assert got.token_logprobs[1:len(ids)] == pytest.approx(ref, abs=1e-4)
    for i in range(1, len(ids)):
        best = lp[i - 1].topk(3).values.tolist()  # (a dict by token text: two tokens decoding alike share a key)
        values = sorted(got.top_logprobs[i].values(), reverse=True)
        assert values[0] == pytest.approx(best[0], abs=1e-4) and all(min(abs(v - b) for b in best) < 1e-4 for v in values)
    assert r.choices[0].text.startswith(text) and "".join(got.tokens[:len(ids)]) == text
    assert got.text_offset[:len(ids)] == [len("".join(got.tokens[:i])) for i in range(len(ids))]
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=max_tokens, temperature=0, logprobs=3, echo=True)
    assert by_ids.choices[0].logprobs.token_logprobs == pytest.approx(got.token_logprobs, abs=1e-5)
    assert by_ids.choices[0].text == r.choices[0].text
    chunks = list(client.completions.create(model=MODEL, prompt=text, max_tokens=max_tokens, temperature=0, logprobs=3,
                                            echo=True, stream=True))
    first = chunks[0].choices[0]
    assert first.text == text and first.logprobs.token_logprobs == pytest.approx(got.token_logprobs[:len(ids)], abs=1e-5)


def test_completions_echo_scores_equal_exact_choice_scoring(client, lib):
    """lm-eval's loglikelihood over the server (the continuation's echoed log-probs summed) equals the
    library's exact choice scoring of each option, and picks the same option. (lm-eval's computation,
    without lm-eval: tests/test_serve_lmeval.py runs lm-eval itself when it is installed.)"""
    from continuum import generate, samplers
    from continuum.generate import continuous

    context = "Question: is the sky blue?\nAnswer:"
    options = [" yes", " no", " maybe", " blue sky"]
    served = []
    for opt in options:
        r = client.completions.create(model=MODEL, prompt=context + opt, max_tokens=0, temperature=0, logprobs=1, echo=True)
        lp = r.choices[0].logprobs
        served.append(sum(x for x, at in zip(lp.token_logprobs, lp.text_offset) if at >= len(context)))
    scores = [continuous(generate.choice(lib, [opt], samplers.greedy()))(context).weights.item() for opt in options]
    assert served == pytest.approx(scores, abs=1e-4)
    assert generate.choice(lib, options, samplers.greedy())(context) == options[max(range(len(options)), key=served.__getitem__)]
