"""Reasoning (issue 30): think freely, then answer under the constraint.

A tiny random Llama over a byte-level BPE trained on the fly with ``<think>``/``</think>`` as added
special tokens, prompts rendered by the Qwen3 template fixture. References are independent: an HF
forward for the thought's log-probs, jsonschema / ``re`` for the answers, token ids for the markers.
The issue asks 200 runs per kind: each kind runs 4 prompts x multinomial(50) = 200 seeded rows.
"""

from __future__ import annotations

import re

import jsonschema
import pytest
import torch

from continuum import SequenceState, continuous, generate, models, samplers
from continuum.errors import ReasoningError

from conftest import fixture_path, tiny_llama

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
          "required": ["ok", "n"]}
REGEX = r"[0-9]{2}-[a-c]"
GRAMMAR = 'start: "(" NUM ("+" NUM)? ")"\nNUM: /[0-9]/\n'
GRAMMAR_RE = r"\([0-9](\+[0-9])?\)"
OPTIONS = ["yes", "no", "maybe"]


def qwen3_prompt(model, question: str, **kw) -> str:
    template = fixture_path("chat_templates", "qwen3.jinja").read_text()
    return model.tokenizer.hf.apply_chat_template([{"role": "user", "content": question}], chat_template=template,
                                                  add_generation_prompt=True, tokenize=False, **kw)


def ids_of(model, name: str) -> int:
    return model.tokenizer.hf.convert_tokens_to_ids(name)


def generated(state, r: int) -> tuple[list[int], list[float]]:
    """Row ``r``'s generated tokens and log-probs (the trailing non-NaN run)."""
    ids, lps = state._real_rows()[r]
    k = len(ids)
    while k > 0 and lps[k - 1] == lps[k - 1]:
        k -= 1
    return ids[k:], lps[k:]


def hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model.model(input_ids=torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits.float(), -1)


def valid(kind: str, value) -> bool:
    if kind == "json":
        jsonschema.validate(value, SCHEMA)
        return True
    if kind == "choice":
        return value in OPTIONS
    return re.fullmatch(REGEX if kind == "regex" else GRAMMAR_RE, value) is not None


def make(model, kind: str, sampler, **kw):
    if kind == "json":
        return generate.json(model, SCHEMA, sampler, **kw)
    if kind == "choice":
        return generate.choice(model, OPTIONS, sampler, **kw)
    if kind == "regex":
        return generate.regex(model, REGEX, sampler, **kw)
    return generate.cfg(model, GRAMMAR, sampler, **kw)


def check_thought(model, state, r: int, budget: int | None, check_lps: bool = True) -> list[int]:
    """The markers of row ``r`` are exact (ids), the thought is within budget, its log-probs are the
    unconstrained model's (HF forward); returns the answer's token ids."""
    start, end = ids_of(model, "<think>"), ids_of(model, "</think>")
    ids, lps = generated(state, r)
    assert ids[0] == start and ids.count(start) == 1 and ids.count(end) == 1
    e = ids.index(end)
    thought = ids[2:e]  # after "<think>" and the template's "\n"
    newline = model.tokenizer.hf.encode("\n")[0]  # a cut thought is closed as templates close it: "\n</think>"
    assert budget is None or len(thought) <= budget or (len(thought) == budget + 1 and thought[-1] == newline)
    want = state.reasoning[r] if state.rows > 1 else state.reasoning
    assert model.tokenizer.decode(thought).strip("\n") == want
    if check_lps:
        full = state._real_rows()[r][0]
        off = len(full) - len(ids)
        ref = hf_logprobs(model, full)
        for i in range(2, e + 1):  # every thought token and the end marker: the raw model's log-prob
            assert abs(lps[i] - float(ref[off + i - 1, ids[i]])) < 1e-4
    return ids[e + 1:]


# ------------------------------------------------------------------------------------ every kind, 200 runs
@pytest.mark.parametrize("kind", ["json", "choice", "regex", "cfg"])
def test_two_hundred_thinking_runs_per_kind_answer_validly(think_model, kind):
    model = think_model
    gen = continuous(make(model, kind, samplers.multinomial(50), reasoning=True, thinking_budget=12))
    prompts = [qwen3_prompt(model, q) for q in ("Is it?", "Pick one.", "Count.", "Why not?")]
    state = gen(prompts, max_tokens=48, rng=torch.Generator().manual_seed(7))
    values, thoughts = state.value, state.reasoning
    assert sum(len(v) for v in values) == 200
    flat_state = state
    for b in range(4):
        for i in range(50):
            assert valid(kind, values[b][i]), values[b][i]
            assert isinstance(thoughts[b][i], str)
    for r in range(0, 200, 23):  # the markers and the budget on a spread of rows; log-probs on some
        row = flat_state[r // 50, r % 50, :]
        check_thought(model, row, 0, 12, check_lps=r % 46 == 0)
    reasons = {f for row in state.finish_reasons for f in row}
    assert reasons <= {"thinking_budget", "pattern"}


@pytest.mark.parametrize("kind", ["json", "choice", "regex", "cfg"])
def test_thinking_off_constrains_from_token_zero(think_model, kind):
    model = think_model
    closed = qwen3_prompt(model, "Quick.", enable_thinking=False)  # the template closes the thought
    assert closed.endswith("<think>\n\n</think>\n\n")
    think = continuous(make(model, kind, samplers.multinomial(8), reasoning=True))
    plain = continuous(make(model, kind, samplers.multinomial(8)))
    for gen in (think, plain):
        state = gen(closed, max_tokens=24, rng=torch.Generator().manual_seed(3))
        assert all(valid(kind, v) for v in state.value)
        assert state.reasoning == [""] * 8
        for r in range(8):  # no marker generated: the constraint applied from the first token
            ids, _ = generated(state, r)
            assert ids_of(model, "<think>") not in ids and ids_of(model, "</think>") not in ids
    # the same: a plain prompt with reasoning off never thinks
    state = plain(qwen3_prompt(model, "Quick."), max_tokens=24, rng=torch.Generator().manual_seed(3))
    assert state.reasoning == [""] * 8 and all(valid(kind, v) for v in state.value)


# ------------------------------------------------------------------------------------ budgets
@pytest.mark.parametrize("budget", [0, 1, 16, 256])
def test_budgets_cut_the_thought_with_the_marker_id(think_model, budget):
    model = think_model
    gen = continuous(generate.regex(model, REGEX, samplers.multinomial(4), reasoning=True, thinking_budget=budget))
    state = gen(qwen3_prompt(model, "Go."), max_tokens=budget + 5 + 16, rng=torch.Generator().manual_seed(budget))
    for r in range(4):
        answer = check_thought(model, state[0, r, :], 0, budget, check_lps=r == 0)
        ids, _ = generated(state[0, r, :], 0)
        if ids.index(ids_of(model, "</think>")) - 2 >= budget:  # cut: the answer follows the template's newlines
            assert state.finish_reasons[0][r] == "thinking_budget"
        assert model.tokenizer.decode(answer).lstrip("\n") == state.value[r]
        assert re.fullmatch(REGEX, state.value[r])


def test_a_budget_leaving_no_answer_room_is_refused(think_model):
    gen = generate.regex(think_model, REGEX, reasoning=True, thinking_budget=40)
    with pytest.raises(ReasoningError, match="raise max_tokens to 53"):
        gen("Q", max_tokens=30)
    with pytest.raises(ReasoningError, match="needs reasoning"):
        generate.text(think_model, thinking_budget=3)
    with pytest.raises(ReasoningError, match="marker pair"):
        generate.text(think_model, reasoning="yes")


def test_without_marker_tokens_a_marker_pair_is_needed(bpe_tokenizer):
    model = models.Transformers(tiny_llama(len(bpe_tokenizer), bos=0, eos=0), bpe_tokenizer)
    with pytest.raises(ReasoningError, match="no '<think>'/'</think>' tokens"):
        generate.text(model, reasoning=True)
    gen = continuous(generate.regex(model, r"[0-9]{2}", reasoning=("[T]", "[/T]"), thinking_budget=4))
    state = gen("Q: ", max_tokens=24, rng=torch.Generator().manual_seed(0))
    assert re.fullmatch(r"[0-9]{2}", state.value)
    end = tuple(bpe_tokenizer.encode("[/T]", add_special_tokens=False))
    ids, _ = generated(state, 0)
    assert any(tuple(ids[i:i + len(end)]) == end for i in range(len(ids)))  # the text marker, as its canonical ids


# ------------------------------------------------------------------------------------ prompts, states, samplers
def test_a_prompt_opening_the_thought_continues_inside_it(think_model):
    model = think_model
    opened = qwen3_prompt(model, "Hm.") + "<think>\n"
    state = continuous(generate.regex(model, REGEX, reasoning=True, thinking_budget=6))(
        opened, max_tokens=30, rng=torch.Generator().manual_seed(1))
    ids, _ = generated(state, 0)
    assert ids_of(model, "<think>") not in ids and ids.count(ids_of(model, "</think>")) == 1
    assert ids.index(ids_of(model, "</think>")) <= 7 and re.fullmatch(REGEX, state.value)


def test_continuing_a_thinking_state_thinks_again_and_slicing_keeps_the_thought(think_model, tmp_path):
    model = think_model
    gen = continuous(generate.json(model, SCHEMA, samplers.multinomial(2), reasoning=True, thinking_budget=10))
    first = gen(qwen3_prompt(model, "One."), max_tokens=40, rng=torch.Generator().manual_seed(2))
    row = first[0, 1, :]  # slicing keeps the row's thought and answer
    assert row.reasoning == first.reasoning[1] and row.value == first.value[1]
    # the closed thought is now history: the next turn opens a thought of its own
    again = gen(row + "<|im_end|>\n<|im_start|>user\nTwo.<|im_end|>\n<|im_start|>assistant\n", max_tokens=40,
                rng=torch.Generator().manual_seed(3))
    for r in range(2):
        jsonschema.validate(again.value[r], SCHEMA)
        check_thought(model, again[0, r, :], 0, 10, check_lps=r == 0)
    assert again._cached_real()[0] >= len(row._real_rows()[0][0]) - 1  # the first turn's cache was reused
    more = continuous(generate.text(model, samplers.greedy()))(again[0, 0, :] + " ok", max_tokens=2)  # added text
    assert more.reasoning == "" and list(more)[0].startswith(list(again)[0] + " ok")
    row.save(tmp_path / "s.safetensors")  # a saved state keeps its thought
    back = SequenceState.load(tmp_path / "s.safetensors", model)
    assert back.reasoning == row.reasoning and back.value == row.value
    with pytest.raises(ReasoningError, match="separate calls"):  # one prompt opened, one not: two phases
        gen([qwen3_prompt(model, "a"), qwen3_prompt(model, "b") + "<think>\n"], max_tokens=40)


def test_beam_search_guidance_and_no_fast_forward_think_then_answer(think_model):
    model = think_model
    prompt = qwen3_prompt(model, "Both?")
    for gen in (generate.choice(model, OPTIONS, samplers.beam_search(3), reasoning=True, thinking_budget=5),
                generate.regex(model, REGEX, samplers.beam_search(3), reasoning=True, thinking_budget=5),
                generate.json(model, SCHEMA, samplers.greedy(), reasoning=True, thinking_budget=5, guidance_scale=1.5),
                generate.cfg(model, GRAMMAR, samplers.multinomial(2), reasoning=True, thinking_budget=5, fast_forward=False)):
        state = continuous(gen)(prompt, max_tokens=48, rng=torch.Generator().manual_seed(4))
        values = state.value if isinstance(state.value, list) else [state.value]
        for r, v in enumerate(values):
            assert valid(gen.kind, v)
            check_thought(model, state[0, r, :], 0, 5, check_lps=gen.guidance is None and not gen.sampler.is_beam_search)


def test_text_with_reasoning_streams_the_thought_then_the_answer(think_model):
    model = think_model
    gen = generate.text(model, samplers.greedy(), reasoning=True, thinking_budget=8)
    prompt = qwen3_prompt(model, "Talk.")
    stream = gen.stream(prompt, max_tokens=24)
    chunks = list(stream)
    state = continuous(gen)(prompt, max_tokens=24)
    assert stream.result == state.value and stream.state.reasoning == state.reasoning
    assert "".join(chunks).endswith(state.value) and state.reasoning in "".join(chunks)
    check_thought(model, state, 0, 8)


def test_stop_strings_apply_to_the_answer_only(think_model):
    model = think_model
    gen = continuous(generate.text(model, samplers.multinomial(6), reasoning=True, thinking_budget=12))
    prompt = qwen3_prompt(model, "Stop?")
    free = gen(prompt, max_tokens=40, rng=torch.Generator().manual_seed(5))
    cut = gen(prompt, max_tokens=40, stop_at="e", rng=torch.Generator().manual_seed(5))
    assert cut.reasoning == free.reasoning  # the same thoughts: a stop string never cuts one
    assert any("e" in t for t in cut.reasoning)  # (and some thought holds the stop string)
    for r, (value, reason) in enumerate(zip(cut.value, cut.finish_reasons[0])):
        ids = cut._real_rows()[r][0]  # (a stop cut re-encodes the last token: count the markers on the whole row)
        assert ids.count(ids_of(model, "</think>")) == 1 and ids.count(ids_of(model, "<think>")) == 1
        assert "e" not in value[:-1] and (reason != "stop" or value.endswith("e"))
        assert free.value[r].startswith(value) or reason != "stop"
