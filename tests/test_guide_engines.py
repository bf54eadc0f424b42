"""The two constraint engines side by side (continuum/guides/): llguidance next to outlines-core. Both allow the same
tokens at every step of a walk; what no engine can enforce is refused; llguidance's JSON whitespace and bounds are
enforced; its mask maps every EOS. References: the other engine, jsonschema, brute-force walks of the vocabulary.
"""

from __future__ import annotations

import re

import pytest
import torch

from continuum import continuous, generate, samplers
from continuum.errors import IncompleteGenerationError, InvalidRegexError, UnsupportedSchemaError


def test_regex_on_both_engines(model):
    """Both engines allow the same tokens at every step of a walk, so greedy outputs agree."""
    pattern = r"[0-9]{2,4}-(ab|c)[a-z]{1,3}"
    outlines = generate.regex(model, pattern, samplers.greedy(), backend="outlines")
    llg = generate.regex(model, pattern, samplers.greedy(), backend="llguidance")
    assert generate.regex(model, pattern).guide is outlines.guide  # auto = outlines-core for regexes
    out = llg(["x", "Code: "], max_tokens=20)
    assert all(re.fullmatch(pattern, o) for o in out)
    assert out == outlines(["x", "Code: "], max_tokens=20)
    vocab = len(model.tokenizer.hf)
    so, sl = outlines.guide.new_state(), llg.guide.new_state()
    for t in model.tokenizer.encode_continuation("1234-abxy"):
        mo = outlines.guide.apply_mask(torch.zeros(1, vocab), [so]).isfinite()
        ml = llg.guide.apply_mask(torch.zeros(1, vocab), [sl]).isfinite()
        assert torch.equal(mo, ml)
        so, sl = outlines.guide.advance(so, t), llg.guide.advance(sl, t)
    assert outlines.guide.is_final(so) and llg.guide.is_final(sl)
    assert llg.guide.advance(sl, model.tokenizer.encode_continuation("!")[0]) is None  # dead, no exception
    choice = generate.choice(model, ["yes", "no way"], samplers.multinomial(3), method="greedy", backend="llguidance")
    assert set(choice("Q: ", rng=torch.Generator().manual_seed(0))) <= {"yes", "no way"}


def test_backend_argument_is_checked(model):
    from continuum.errors import GeneratorArgumentError

    for make in (lambda b: generate.regex(model, "a", backend=b), lambda b: generate.json(model, {"type": "integer"}, backend=b),
                 lambda b: generate.choice(model, ["a"], backend=b)):
        with pytest.raises(GeneratorArgumentError, match="backend"):
            make("xgrammar")
    with pytest.raises(InvalidRegexError, match="llguidance"):
        generate.regex(model, "[a-", backend="llguidance")


def test_what_no_engine_can_enforce_is_refused(model):
    with pytest.raises(UnsupportedSchemaError, match="/not"):  # no exact negation: refused, naming the path
        generate.json(model, {"type": "string", "not": {"pattern": "^a"}}, on_unsupported="raise")
    with pytest.raises(UnsupportedSchemaError, match="nowhere"):
        generate.json(model, {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}})
    # `not required` has an exact rewrite (the normaliser). The object is closed: an open one (any other key) costs
    # outlines-core ~14 s to compile per vocabulary, and the rewrite under test is the same.
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}},
              "additionalProperties": False, "not": {"required": ["a"]}}
    guides = {backend: generate.json(model, schema, backend=backend).guide for backend in ("llguidance", "outlines")}
    g = guides["llguidance"]
    assert _accepts(model, g, '{"b": true}') and _accepts(model, g, "{}")
    assert not _accepts(model, g, '{"a": 1}') and not _accepts(model, g, '{"a": 1, "b": true}')


def _accepts(model, guide, doc: str) -> bool:
    """Whether ``guide`` walks ``doc``'s tokens to a final state."""
    state = guide.new_state()
    for t in model.tokenizer.encode_continuation(doc):
        state = guide.advance(state, t)
        if state is None:
            return False
    return guide.is_final(state)


def test_llguidance_json_whitespace_is_bounded(model):
    """The default whitespace_pattern reaches llguidance: one optional space, never two, no newline."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}
    bounded = generate.json(model, schema).guide
    free = generate.json(model, schema, whitespace_pattern=None).guide

    def accepts(guide, doc):
        return _accepts(model, guide, doc)

    assert accepts(bounded, '{"a": 1}') and accepts(bounded, '{ "a" : 1 }') and accepts(bounded, '{"a":1}')
    assert not accepts(bounded, '{"a":  1}') and not accepts(bounded, '{\n"a": 1}')
    assert accepts(free, '{\n  "a":  1\n}')


def test_llguidance_json_bounds_are_enforced(model):
    """Keywords outlines-core ignores (minimum/maximum, uniqueItems) hold in llguidance outputs."""
    import jsonschema

    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 3, "maximum": 40},
                                               "s": {"type": "array", "items": {"enum": [1, 2, 3]}, "maxItems": 3}},
              "required": ["n", "s"], "additionalProperties": False}
    gen = continuous(generate.json(model, schema, samplers.multinomial(4)))
    complete = 0
    for seed in range(2):
        state = gen("data: ", max_tokens=40, rng=torch.Generator().manual_seed(seed))
        for i in range(4):
            try:
                jsonschema.validate(state[i, :].value, schema)
                complete += 1
            except IncompleteGenerationError:
                pass
    assert complete > 0


def test_same_json_generator_resumes_with_llguidance(model):
    schema = {"type": "object", "properties": {"k": {"enum": ["alpha", "beta"]}, "v": {"type": "boolean"}},
              "required": ["k", "v"], "additionalProperties": False}
    gen = continuous(generate.json(model, schema, samplers.greedy()))
    part = gen(["x", "y"], max_tokens=3)
    done = gen(part, max_tokens=40)
    assert done.value == gen(["x", "y"], max_tokens=40).value
    assert all(set(v) == {"k", "v"} for v in done.value)


def test_llguidance_mask_maps_every_eos_and_pads_wide_heads(bpe_tokenizer):
    """EOS is allowed exactly where the grammar accepts, for every EOS id of the tokenizer; ids past
    the vocabulary (a padded LM head) are never allowed."""
    from continuum.guides.llguidance import llguidance_guide, regex_grammar
    from continuum.models.tokenizer import Tokenizer

    extra = bpe_tokenizer.convert_tokens_to_ids("a")
    tok = Tokenizer(bpe_tokenizer, generation_eos=[extra])
    guide = llguidance_guide(regex_grammar("(xy)+"), tok)
    V = len(bpe_tokenizer)
    state = guide.new_state()
    first = guide.apply_mask(torch.zeros(1, V + 7), [state]).isfinite()[0]
    assert not first[tok.eos_token_id] and not first[extra] and not first[V:].any()
    for t in tok.encode_continuation("xy"):
        state = guide.advance(state, t)
    after = guide.apply_mask(torch.zeros(2, V + 7), [state, None]).isfinite()
    assert after[0, tok.eos_token_id] and after[0, extra] and not after[0, V:].any()
    assert after[1].all()  # a free row is untouched
