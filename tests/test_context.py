"""The context limit: generation stops cleanly at the model's maximum positions, each row at its own
limit, with the rows marked (``finish_reasons``, ``truncated``, ``Completion``); only an input that is
itself longer than the context raises ``ContextLengthError``, whose hinted cut works."""

from __future__ import annotations

import pickle
import re

import pytest
import torch

from continuum import Completion, SequenceState, continuous, generate, models, samplers
from continuum.errors import ContextLengthError, IncompleteGenerationError

from conftest import assert_reuse_exact, tiny_gpt2, tiny_llama

CTX = 32
PROMPTS = ["Once upon a time, there was a little girl", "The dog", "Le café est très bon"]


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def small(request, bpe_tokenizer, spm_tokenizer):
    """A tiny model whose context is 32 positions."""
    if request.param == "gpt2":
        hf = tiny_gpt2(len(bpe_tokenizer), n_positions=CTX)
        hf.config.eos_token_id = hf.generation_config.eos_token_id = bpe_tokenizer.eos_token_id
        return models.Transformers(hf, bpe_tokenizer)
    hf = tiny_llama(len(spm_tokenizer), max_positions=CTX, bos=spm_tokenizer.bos_token_id, eos=spm_tokenizer.eos_token_id)
    return models.Transformers(hf, spm_tokenizer)


def hf_row(model, ids: list[int], max_new: int) -> list[int]:
    """HF generate's greedy tokens after ``ids`` (EOS dropped), the independent reference."""
    out = model.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                               max_new_tokens=max_new, do_sample=False, pad_token_id=model.tokenizer.pad_token_id,
                               eos_token_id=sorted(model.tokenizer.eos_token_ids))[0, len(ids):].tolist()
    return [t for t in out if t not in model.tokenizer.eos_token_ids][:max_new]


def real_ids(state: SequenceState) -> list[list[int]]:
    return [ids for ids, _ in state._real_rows()]


def test_generation_stops_at_each_rows_own_limit(small):
    gen = generate.text(small, samplers.greedy())
    s = continuous(gen)(PROMPTS, max_tokens=100)
    prompts = small.tokenizer.encode_prompts(PROMPTS)
    assert len({len(p) for p in prompts}) == 3  # rows of different lengths
    reasons = [r[0] for r in s.finish_reasons]
    assert "context" in reasons and set(reasons) <= {"context", "eos"}
    for p, ids, why, cut in zip(prompts, real_ids(s), reasons, s.truncated[:, 0].tolist()):
        assert ids[:len(p)] == p and ids[len(p):] == hf_row(small, p, CTX - len(p))
        assert cut == (why == "context") and (len(ids) == CTX) == (why == "context")
    assert_reuse_exact(s)
    out = gen(PROMPTS, max_tokens=100)  # the plain generator says the same, on str results
    assert all(isinstance(c, Completion) for c in out)
    assert [c.finish_reason for c in out] == reasons and [c.truncated for c in out] == s.truncated[:, 0].tolist()
    assert out == [t[len(p):] for t, p in zip(s, PROMPTS)]


@pytest.mark.parametrize("sampler", [samplers.multinomial(3), samplers.beam_search(2)], ids=repr)
def test_forks_and_beams_are_capped_per_row(small, sampler):
    s = continuous(generate.text(small, sampler))(PROMPTS, rng=torch.Generator().manual_seed(0))
    assert s.truncated.shape == (3, sampler.samples)
    for ids, why in zip(real_ids(s), sum(s.finish_reasons, [])):
        assert len(ids) <= CTX and (len(ids) == CTX) == (why == "context")
    assert bool(s.truncated.any())
    assert_reuse_exact(s)


def test_max_tokens_and_context_are_told_apart(small):
    gen = continuous(generate.text(small, samplers.greedy()))
    n = len(small.tokenizer.encode_prompts([PROMPTS[1]])[0])
    room = CTX - n
    first = gen(PROMPTS[1], max_tokens=room)
    if first.finish_reasons[0][0] == "eos":
        pytest.skip("this random model ends the row early")
    assert gen(PROMPTS[1], max_tokens=room - 1).finish_reasons == [["length"]]
    assert first.finish_reasons == [["length"]] and not bool(first.truncated.any())  # both limits at once: max_tokens
    over = gen(PROMPTS[1], max_tokens=room + 5)
    assert over.finish_reasons == [["context"]] and bool(over.truncated.all())
    assert list(over) == list(first)
    full = gen(over, max_tokens=3)  # a state at exactly the context: no error, nothing more
    assert list(full) == list(over) and full.finish_reasons == [["context"]]


def test_finish_reasons_eos_stop_pattern(small):
    gen = continuous(generate.text(small, samplers.greedy()))
    s = gen(PROMPTS[1], max_tokens=8)
    new = list(s)[0][len(PROMPTS[1]):]
    stop = new[2:4] if new[2:4].strip() else new[1:4]
    stopped = gen(PROMPTS[1], max_tokens=8, stop_at=stop)
    assert stopped.finish_reasons == [["stop"]]
    ids = real_ids(s)[0]
    n = len(small.tokenizer.encode_prompts([PROMPTS[1]])[0])
    hf = small.model
    old = hf.generation_config.eos_token_id
    try:  # a model whose generation config makes the 3rd generated token an end token
        hf.generation_config.eos_token_id = [small.tokenizer.eos_token_id, ids[n + 2]]
        m2 = models.Transformers(hf, small.tokenizer.hf)
    finally:
        hf.generation_config.eos_token_id = old
    e = continuous(generate.text(m2, samplers.greedy()))(PROMPTS[1], max_tokens=8)
    assert e.finish_reasons == [["eos"]] and real_ids(e)[0] == ids[:n + ids[n:].index(ids[n + 2])]  # EOS dropped
    r = continuous(generate.regex(small, r"[0-9]{2}", samplers.greedy()))(PROMPTS[1], max_tokens=8)
    assert r.finish_reasons == [["pattern"]]
    c = continuous(generate.choice(small, ["yes", "no"], samplers.greedy()))(PROMPTS[1])
    assert c.finish_reasons == [["pattern"]]
    # kept through slicing and adding; stacking concatenates them
    assert (s + " more").finish_reasons == s.finish_reasons and s[..., :5].finish_reasons == s.finish_reasons
    assert SequenceState.stack([s, stopped]).finish_reasons == [["length"], ["stop"]]


def test_completion_is_a_str():
    c = Completion("abc", "context")
    assert c == "abc" and isinstance(c, str) and c.upper() == "ABC" and hash(c) == hash("abc")
    back = pickle.loads(pickle.dumps(c))
    assert back == "abc" and back.finish_reason == "context" and back.truncated
    assert not Completion("x", "length").truncated


def test_input_longer_than_the_context_raises_with_a_working_hint(small):
    gen = generate.text(small, samplers.greedy())
    long = "Once upon a time, there was a little girl named Lily. She loved to play outside in the park. " * 2
    s = SequenceState.from_prompts(small, [long, "The dog"])
    assert int(s.attention_masks.sum(1).max()) > CTX
    with pytest.raises(ContextLengthError, match=r"context is 32.*state\[\.\.\., -\d+:\]") as info:
        continuous(gen)(s, max_tokens=5)
    with pytest.raises(ContextLengthError, match=r"prompt\[-\d+:\]"):
        gen(long, max_tokens=5)
    k = int(re.search(r"state\[\.\.\., -(\d+):\]", str(info.value)).group(1))
    cut = s[..., -k:]  # as hinted: the state is still usable
    assert int(cut.attention_masks.sum(1).max()) <= CTX // 2 + 2
    got = continuous(gen)(cut, max_tokens=5)
    ref = continuous(gen)([t[-k:] for t in s], max_tokens=5)  # a fresh run from the cut text
    assert list(got) == list(ref)
    torch.testing.assert_close(got.weights, ref.weights)


def test_constrained_output_cut_by_the_context_names_it(small):
    regex = generate.regex(small, r"[a-z]{40}", samplers.greedy())
    with pytest.raises(IncompleteGenerationError, match="context length \\(32 tokens\\).*state\\[\\.\\.\\., -N:\\]"):
        regex(PROMPTS[0])
    s = continuous(regex)(PROMPTS[0])
    assert bool(s.truncated.all())
    with pytest.raises(IncompleteGenerationError, match="context length"):
        s.value
    # choice scores every option in full: one that cannot fit is refused before any work
    n = len(small.tokenizer.encode_prompts([PROMPTS[0]])[0])
    options = ["a" * (CTX - n + 4), "b"]
    with pytest.raises(ContextLengthError, match="longest option"):
        generate.choice(small, options, samplers.greedy())(PROMPTS[0])
