"""Every error a user can get (docs/errors.md): its type, a message that says what to do, and
inputs (state, generator, model) that stay usable afterwards: each test uses them again and
compares with a fresh run."""

from __future__ import annotations

import pytest
import torch

from continuum import SequenceState, continuous, generate, models, samplers
from continuum.errors import (
    BatchMismatch,
    ContinuumError,
    ContinuumTypeError,
    EmptyChoicesError,
    GeneratorArgumentError,
    InvalidChoicesError,
    InvalidRegexError,
    SampleMismatch,
    SlicingError,
    StateFileError,
    TokenizerError,
    UnsupportedSchemaError,
)

from conftest import assert_reuse_exact, make_bpe_tokenizer

PROMPTS = ["Once upon a time", "The dog"]


def text_c(model):
    return continuous(generate.text(model, samplers.greedy()))


def base(model) -> SequenceState:
    return text_c(model)(PROMPTS, max_tokens=4)


def assert_usable(state: SequenceState, model) -> None:
    """``state`` still continues exactly like the same state rebuilt from scratch."""
    ref = text_c(model)(base(model), max_tokens=3)
    got = text_c(model)(state, max_tokens=3)
    assert list(got) == list(ref)
    torch.testing.assert_close(got.weights, ref.weights)
    assert_reuse_exact(got)


def raises(exc, match, fn):
    with pytest.raises(exc, match=match) as info:
        fn()
    assert isinstance(info.value, ContinuumError)
    return info.value


# ------------------------------------------------------------------------------ indexing
@pytest.mark.parametrize("key, match", [
    ((0, 0, 0, 0), "takes"),                      # arity: (batch=2, samples=1) takes [batch, chars] or 3 indices
    (0, "takes"),
    ((0, 1.5), "chars index must be an int or a slice"),
    ((0, None), "chars index must be an int or a slice"),
    ((0, "a"), "chars index must be an int or a slice"),
    ((1.5, slice(None)), "batch index must be"),
    ((None, slice(None)), "batch index must be"),
    (("a", slice(None)), "batch index must be"),
    ((True, slice(None)), "batch index must be"),
    ((slice(None), slice(None, None, 2)), "step 1"),   # steps on the chars axis
    ((..., slice(None, None, -1)), "step 1"),
    ((5, slice(None)), "out of range"),
    ((..., 0, 5, slice(None)), "at most"),
    ((..., 1000), "out of range"),
    (([], slice(None)), "select at least one"),         # empty selections
    ((slice(2, 2), slice(None)), "select at least one"),
    ((..., ..., 0), "at most one"),
])
def test_bad_index(model, key, match):
    s = base(model)
    err = raises(SlicingError, match, lambda: s[key])
    assert isinstance(err, IndexError)
    assert_usable(s, model)


def test_valid_indexes_next_to_the_errors(model):
    s = base(model)
    assert list(s[::-1, :]) == list(s)[::-1]          # any step on the batch axis
    assert list(s[..., 3:3]) == ["", ""]              # an empty chars slice is an empty text, not an error
    assert_usable(s, model)


# ------------------------------------------------------------------------------ adding and stacking
@pytest.mark.parametrize("other", [1, None, b"bytes", 1.5, object(), [1, "a"]])
@pytest.mark.parametrize("side", ["right", "left"])
def test_add_wrong_type(model, other, side):
    s = base(model)
    err = raises(TypeError, "a str, a list of str", (lambda: s + other) if side == "right" else (lambda: other + s))
    if isinstance(other, bytes):
        assert "decode" in str(err)
    assert_usable(s, model)


def test_different_tokenizers(gpt2_model, llama_model):
    a, b = base(gpt2_model), base(llama_model)
    raises(TokenizerError, "different tokenizers.*list", lambda: a + b)
    raises(TokenizerError, "different tokenizers.*from_prompts", lambda: SequenceState.stack([a, b]))
    raises(GeneratorArgumentError, "tokenizer.*from_prompts", lambda: text_c(gpt2_model)(b, max_tokens=2))
    fixed = a + list(b)  # what the message says to do
    assert list(fixed) == [x + y for x, y in zip(a, b)]
    assert_usable(a, gpt2_model)
    assert_usable(b, llama_model)


def test_stack_wrong_items(model):
    s = base(model)
    raises(TypeError, "SequenceStates.*from_prompts", lambda: SequenceState.stack([s, "text"]))
    raises(BatchMismatch, "empty", lambda: SequenceState.stack([]))
    assert_usable(s, model)


def test_sample_and_batch_mismatches(model):
    s = base(model)                                                  # batch 2, samples 1
    one = text_c(model)("Once upon a time", max_tokens=4)            # batch 1
    three = continuous(generate.text(model, samplers.multinomial(3)))(PROMPTS, max_tokens=2,
                                                                       rng=torch.Generator().manual_seed(0))
    raises(BatchMismatch, r"select matching rows", lambda: s + one)
    raises(BatchMismatch, "one string per batch row", lambda: s + ["a", "b", "c"])
    raises(BatchMismatch, "one string per batch row", lambda: ["a", "b", "c"] + s)
    raises(SampleMismatch, "select one sample", lambda: s + three)
    raises(SampleMismatch, r"state\[:, :1, :\]", lambda: SequenceState.stack([s, three]))
    gen2 = continuous(generate.text(model, samplers.multinomial(2)))
    raises(SampleMismatch, r"multinomial\(3\).*state\[:, i, :\]", lambda: gen2(three, max_tokens=2))
    # the fixes the messages suggest
    assert list(s + three[:, 0, :]) == [x + y for x, y in zip(s, three[:, 0, :])]
    assert gen2(three[:, 0, :], max_tokens=2, rng=torch.Generator().manual_seed(1)).shape == (2, 2)
    assert_usable(s, model)


# ------------------------------------------------------------------------------ prompts
@pytest.mark.parametrize("prompt, exc, match", [
    (3, ContinuumTypeError, "must be text"),
    (None, ContinuumTypeError, "must be text"),
    (b"x", ContinuumTypeError, "decode"),
    ([1], ContinuumTypeError, "prompt 0 of the list"),
    (["a", None], ContinuumTypeError, "prompt 1 of the list"),
    ([], BatchMismatch, "empty list"),
])
@pytest.mark.parametrize("mode", ["plain", "continuous"])
def test_wrong_prompt_types(gpt2_model, prompt, exc, match, mode):
    gen = generate.text(gpt2_model, samplers.greedy())
    call = gen if mode == "plain" else continuous(gen)
    raises(exc, match, lambda: call(prompt, max_tokens=3))
    assert gen(PROMPTS, max_tokens=3) == generate.text(gpt2_model, samplers.greedy())(PROMPTS, max_tokens=3)


def test_empty_prompt_without_bos_is_an_error(gpt2_model):
    gen = generate.text(gpt2_model, samplers.greedy())
    assert gpt2_model.tokenizer.encode_prompts([""]) == [[]]  # this tokenizer adds no BOS
    raises(GeneratorArgumentError, r"row\(s\) \[0\].*non-empty prompt", lambda: gen("", max_tokens=3))
    raises(GeneratorArgumentError, r"row\(s\) \[1\]", lambda: gen(["ok", ""], max_tokens=3))
    empty = SequenceState.from_prompts(gpt2_model, "")  # a valid state: text can be added to it
    assert gen("Hi", max_tokens=3) == text_c(gpt2_model)(empty + "Hi", max_tokens=3).value


def hf_greedy_ids(model, ids: list[int], n: int) -> list[int]:
    out = model.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                               max_new_tokens=n, do_sample=False, pad_token_id=model.tokenizer.pad_token_id,
                               eos_token_id=model.tokenizer.eos_token_id)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("prompt", ["", " ", "  \n\t "])
def test_empty_and_whitespace_prompts_are_valid_text(model, prompt):
    ids = model.tokenizer.encode_prompts([prompt])[0]
    if not ids:  # "" without BOS: covered above
        return
    got = text_c(model)(prompt, max_tokens=5)
    new = got.token_ids[0, len(ids):].tolist()
    ref = hf_greedy_ids(model, ids, 5)
    assert new == ref[:len(new)] and (len(new) == 5 or ref[len(new)] in model.tokenizer.eos_token_ids)


# ------------------------------------------------------------------------------ call arguments
@pytest.mark.parametrize("kwargs, match", [
    (dict(max_tokens=-1), ">= 0"),
    (dict(max_tokens=1.5), "int or None"),
    (dict(max_tokens="3"), "int or None"),
    (dict(max_tokens=True), "int or None"),
    (dict(stop_at=""), "non-empty"),
    (dict(stop_at=[""]), "non-empty"),
    (dict(stop_at=["a", 3]), "non-empty"),
    (dict(stop_at=3), "string or a list"),
])
def test_bad_call_arguments(model, kwargs, match):
    gen = generate.text(model, samplers.greedy())
    s = base(model)
    raises(GeneratorArgumentError, match, lambda: gen("Once upon a time", **kwargs))
    raises(GeneratorArgumentError, match, lambda: continuous(gen)(s, **kwargs))
    assert gen("Once upon a time", max_tokens=4) == list(s)[0][len("Once upon a time"):]
    assert_usable(s, model)


def test_max_tokens_zero_and_empty_stop_list_are_valid(model):
    gen = generate.text(model, samplers.greedy())
    assert gen("Once upon a time", max_tokens=0) == ""
    s = continuous(gen)("Once upon a time", max_tokens=0)
    assert int(s.cached_tokens) == len(s.token_ids[0]) - 1  # prefill only
    assert gen("Once upon a time", max_tokens=4, stop_at=[]) == gen("Once upon a time", max_tokens=4)


# ------------------------------------------------------------------------------ constraints
@pytest.mark.parametrize("choices, exc, match", [
    (["yes", "yes", "no"], InvalidChoicesError, "distinct.*'yes'"),
    (["yes", ""], EmptyChoicesError, "non-empty"),
    ([], EmptyChoicesError, "at least one"),
    ("yes", EmptyChoicesError, "not a single string"),
    (["yes", 1], EmptyChoicesError, "non-empty strings"),
    (5, InvalidChoicesError, "list of option strings"),
])
@pytest.mark.parametrize("method", ["exact", "greedy"])
def test_bad_choices(gpt2_model, choices, exc, match, method):
    raises(exc, match, lambda: generate.choice(gpt2_model, choices, samplers.greedy(), method=method))
    gen = generate.choice(gpt2_model, ["yes", "no"], samplers.greedy(), method=method)
    assert gen("Answer:") in ("yes", "no")


@pytest.mark.parametrize("pattern, match", [
    ("", "only the empty string"),
    ("a{0}", "only the empty string"),
    ("x^", "no text this tokenizer can produce"),
    ("(", "syntax"),
])
def test_bad_regexes(gpt2_model, pattern, match):
    raises(InvalidRegexError, match, lambda: generate.regex(gpt2_model, pattern))
    out = generate.regex(gpt2_model, r"[0-9]{3}", samplers.greedy())("Code: ", max_tokens=8)
    assert len(out) == 3 and out.isdigit()


def test_unsupported_schema(gpt2_model):
    raises(UnsupportedSchemaError, "/not cannot be enforced.*Rewrite",
           lambda: generate.json(gpt2_model, {"type": "string", "not": {"pattern": "^a"}}, on_unsupported="raise"))
    raises(UnsupportedSchemaError, "pydantic model class", lambda: generate.json(gpt2_model, 3))
    assert generate.json(gpt2_model, {"type": "boolean"}, samplers.greedy())("Ok? ", max_tokens=4) in (True, False)


# ------------------------------------------------------------------------------ tokenizers
def _hf_tokenizer(**special):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=make_bpe_tokenizer().backend_tokenizer, **special)


def test_tokenizer_without_pad_eos_or_bos(gpt2_model, caplog):
    from conftest import tiny_gpt2

    with caplog.at_level("INFO", logger="continuum"):  # no pad: EOS pads, and says so
        no_pad = models.Tokenizer(_hf_tokenizer(eos_token="<|endoftext|>"))
    assert no_pad.pad_token_id == no_pad.eos_token_id and "pad token" in caplog.text
    raises(TokenizerError, "neither a pad token nor an EOS token", lambda: models.Tokenizer(_hf_tokenizer()))
    # no BOS: prompts are used as they are and generation matches HF
    tok = _hf_tokenizer(eos_token="<|endoftext|>")
    assert tok.bos_token_id is None
    m = models.Transformers(tiny_gpt2(len(tok)), tok)
    ids = m.tokenizer.encode_prompts(["The dog"])[0]
    s = text_c(m)("The dog", max_tokens=5)
    new = s.token_ids[0, len(ids):].tolist()
    assert new == hf_greedy_ids(m, ids, 5)[:len(new)]


def test_samplers_bad_arguments():
    bad = [lambda: samplers.multinomial(0), lambda: samplers.multinomial(1.5), lambda: samplers.multinomial("2"),
           lambda: samplers.multinomial(top_k=0), lambda: samplers.multinomial(top_k=1.5),
           lambda: samplers.multinomial(top_p=0), lambda: samplers.multinomial(top_p=1.5),
           lambda: samplers.multinomial(top_p="a"), lambda: samplers.multinomial(temperature=-1),
           lambda: samplers.multinomial(temperature="hot"), lambda: samplers.beam_search(0),
           lambda: samplers.beam_search(2.0)]
    for make in bad:
        err = raises(GeneratorArgumentError, "must be", make)
        assert isinstance(err, ValueError)


def test_wrong_sampler_and_model(gpt2_model):
    raises(ContinuumTypeError, r"samplers.greedy\(\)", lambda: generate.text(gpt2_model, "greedy"))
    raises(GeneratorArgumentError, "models.transformers", lambda: generate.text("gpt2"))
    assert generate.text(gpt2_model, samplers.greedy())("The dog", max_tokens=3) == \
        generate.text(gpt2_model, samplers.greedy())("The dog", max_tokens=3)


# ------------------------------------------------------------------------------ files and last steps
def test_corrupt_state_files(model, tmp_path):
    from safetensors.torch import save_file

    s = base(model)
    good = tmp_path / "good.st"
    s.save(good)
    garbage, truncated, foreign = tmp_path / "garbage.st", tmp_path / "truncated.st", tmp_path / "foreign.st"
    garbage.write_bytes(b"not a state")
    truncated.write_bytes(good.read_bytes()[:200])
    save_file({"x": torch.zeros(2)}, str(foreign))  # a safetensors file, not a state
    for path in (garbage, truncated, foreign):
        raises(StateFileError, "save the state again", lambda: SequenceState.load(path, model))  # noqa: B023 - called now
    with pytest.raises(FileNotFoundError):
        SequenceState.load(tmp_path / "missing.st", model)
    loaded = SequenceState.load(good, model)
    assert list(loaded) == list(s) and loaded.finish_reasons == s.finish_reasons == [["length"], ["length"]]
    assert_usable(loaded, model)


def test_value_of_a_state_no_generator_made(gpt2_model):
    s = SequenceState.from_prompts(gpt2_model, "Hello")
    with pytest.raises(ValueError, match="list\\(state\\)"):
        s.value
    assert s.finish_reasons is None and not bool(s.truncated.any())
    assert text_c(gpt2_model)(s, max_tokens=3).value == generate.text(gpt2_model, samplers.greedy())("Hello", max_tokens=3)
