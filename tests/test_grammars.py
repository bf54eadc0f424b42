"""Context-free grammars (``generate.cfg``, llguidance): outputs parse with independent parsers.

The grammars below are finite (bounded repetitions, closing terminals), so once the closing
terminal is generated the matcher is stopped and the row ends: outputs of the random tiny models
always complete within ``max_tokens``.
"""

from __future__ import annotations

import ast
import json

import pytest
import torch

from continuum import SequenceState, continuous, generate, samplers
from continuum.errors import GeneratorArgumentError, IncompleteGenerationError, InvalidGrammarError

ARITH = r"""
start: expr ";"
expr: term (OP term){0,3}
term: NUMBER | "(" inner ")"
inner: NUMBER (OP NUMBER){0,2}
OP: "+" | "-" | "*"
NUMBER: /[1-9][0-9]{0,2}/
"""

JSONISH = r"""
start: "{" (pair ("," pair){0,2})? "}"
pair: KEY ":" val
val: STRING | NUMBER | "true" | "false" | "null" | "[" (scalar ("," scalar){0,2})? "]"
scalar: STRING | NUMBER
KEY: /"[a-z]{1,5}"/
STRING: /"[a-zA-Z ]{0,6}"/
NUMBER: /-?[1-9][0-9]{0,3}/
"""

GBNF = r"""
root ::= "(" num ("+" num){0,2} ")"
num ::= [1-9] [0-9]?
"""

SAMPLERS = [samplers.greedy, lambda: samplers.multinomial(3), lambda: samplers.beam_search(3)]


def _flat(values):
    out = []
    for v in values if isinstance(values, list) else [values]:
        out.extend(_flat(v) if isinstance(v, list) else [v])
    return out


def check_arith(text: str) -> None:
    """An arithmetic expression followed by ';': Python's own parser agrees, and it evaluates."""
    assert text.endswith(";"), text
    tree = ast.parse(text[:-1], mode="eval")
    allowed = (ast.Expression, ast.BinOp, ast.Constant, ast.Add, ast.Sub, ast.Mult)
    assert all(isinstance(node, allowed) for node in ast.walk(tree)), text
    assert isinstance(eval(compile(tree, "<arith>", "eval")), int)  # noqa: S307 - checked AST of ints


def check_gbnf(text: str) -> None:
    assert text[0] == "(" and text[-1] == ")", text
    nums = text[1:-1].split("+")
    assert 1 <= len(nums) <= 3 and all(n.isdigit() and n[0] != "0" and len(n) <= 2 for n in nums), text


def generated_tokens(state: SequenceState, prompt_tokens: list[int], row: int) -> list[int]:
    ids = state.token_ids[row][state.attention_masks[row].bool()].tolist()
    assert ids[:len(prompt_tokens)] == prompt_tokens
    return ids[len(prompt_tokens):]


@pytest.mark.parametrize("make_sampler", SAMPLERS, ids=["greedy", "multinomial", "beam"])
def test_arithmetic_grammar_outputs_parse(model, make_sampler):
    gen = generate.cfg(model, ARITH, make_sampler())
    for seed in range(2):
        for text in _flat(gen(["1+1=", "Compute: "], max_tokens=80, rng=torch.Generator().manual_seed(seed))):
            check_arith(text)


@pytest.mark.parametrize("make_sampler", SAMPLERS, ids=["greedy", "multinomial", "beam"])
def test_json_like_grammar_outputs_load(model, make_sampler):
    gen = generate.cfg(model, JSONISH, make_sampler())
    for text in _flat(gen(["data: ", "{"], max_tokens=90, rng=torch.Generator().manual_seed(0))):
        assert isinstance(json.loads(text), dict), text


def test_gbnf_grammar(model):
    gen = generate.cfg(model, GBNF, samplers.multinomial(4), syntax="gbnf")
    for seed in range(2):
        for text in _flat(gen("sum: ", max_tokens=20, rng=torch.Generator().manual_seed(seed))):
            check_gbnf(text)


def test_stream_equals_call(model):
    gen = generate.cfg(model, ARITH, samplers.multinomial(2))
    prompts = ["1+1=", "x"]
    expected = gen(prompts, max_tokens=80, rng=torch.Generator().manual_seed(3))
    stream = gen.stream(prompts, max_tokens=80, rng=torch.Generator().manual_seed(3))
    chunks = list(stream)
    joined = [["".join(c[b][s] for c in chunks) for s in range(2)] for b in range(2)]
    assert joined == expected == stream.result


def test_continuous_text_then_grammar(model):
    text = continuous(generate.text(model, samplers.greedy()))("Once upon a time", max_tokens=5)
    state = continuous(generate.cfg(model, ARITH, samplers.greedy()))(text + "\nSum: ", max_tokens=80)
    check_arith(state.value)
    assert list(state)[0] == list(text)[0] + "\nSum: " + state.value
    # and back to free text after the grammar
    more = continuous(generate.text(model, samplers.greedy()))(state, max_tokens=3)
    assert list(more)[0].startswith(list(state)[0])


def test_resume_unfinished_grammar_step(model):
    gen = continuous(generate.cfg(model, ARITH, samplers.greedy()))
    part = gen(["1+1=", "N"], max_tokens=2)
    with pytest.raises(IncompleteGenerationError):
        part.value
    done = gen(part, max_tokens=80)
    again = gen(part, max_tokens=80)  # the input state's matchers were copied, not advanced
    assert list(done) == list(again)
    for prompt, value, text in zip(["1+1=", "N"], done.value, done):
        check_arith(value)
        assert text == prompt + value
    # the whole output is what one uninterrupted call produces
    assert done.value == gen(["1+1=", "N"], max_tokens=80).value
    # a state that was edited starts the grammar afresh
    fresh = gen(part + "(", max_tokens=80)
    for value in fresh.value:
        check_arith(value)


def test_beam_reorders_copy_matchers(model):
    """Every beam's tokens are accepted by a fresh matcher: no two beams ever shared one."""
    guide_gen = generate.cfg(model, JSONISH, samplers.beam_search(4))
    prompts = ["data: ", "x"]
    state = continuous(guide_gen)(prompts, max_tokens=90)
    guide = guide_gen.guide
    for r in range(state.rows):
        prompt_ids = model.tokenizer.encode_prompts([prompts[r // 4]])[0]
        matcher = guide.new_state()
        for t in generated_tokens(state, prompt_ids, r):
            matcher = guide.advance(matcher, t)
            assert matcher is not None, (r, state.last_text)
        assert guide.is_final(matcher)
    for row in state.value:
        for text in row:
            json.loads(text)


def test_fork_gives_each_sample_its_own_matcher(model):
    base = continuous(generate.text(model, samplers.greedy()))("Sum: ", max_tokens=0)
    state = continuous(generate.cfg(model, GBNF, samplers.multinomial(5), syntax="gbnf"))(
        base, max_tokens=20, rng=torch.Generator().manual_seed(1))
    assert state.samples == 5
    for text in state.value:
        check_gbnf(text)


def test_invalid_grammars_raise_at_creation(model):
    with pytest.raises(InvalidGrammarError, match="unknown name"):
        generate.cfg(model, "start: foo")
    with pytest.raises(InvalidGrammarError, match="Expected"):
        generate.cfg(model, "start: (")
    with pytest.raises(InvalidGrammarError, match="GBNF"):
        generate.cfg(model, "root := x", syntax="gbnf")
    with pytest.raises(GeneratorArgumentError, match="syntax"):
        generate.cfg(model, ARITH, syntax="ebnf")
    with pytest.raises(GeneratorArgumentError, match="backend"):
        generate.cfg(model, ARITH, backend="outlines")
    with pytest.raises(GeneratorArgumentError):
        generate.cfg(model, "")
    assert issubclass(InvalidGrammarError, ValueError)
    # the model stays usable after an error
    check_arith(generate.cfg(model, ARITH, samplers.greedy())("x", max_tokens=80))


def test_grammar_state_saves_and_loads(model, tmp_path):
    """llguidance matchers are not saved: a loaded unfinished step restarts its grammar, a finished one reads back."""
    gen = continuous(generate.cfg(model, ARITH, samplers.greedy()))
    done = gen("1+1=", max_tokens=80)
    done.save(tmp_path / "s.safetensors")
    loaded = SequenceState.load(tmp_path / "s.safetensors", model)
    assert loaded.value == done.value
    part = gen("1+1=", max_tokens=2)
    part.save(tmp_path / "p.safetensors")
    restarted = gen(SequenceState.load(tmp_path / "p.safetensors", model), max_tokens=80)
    check_arith(restarted.value)
