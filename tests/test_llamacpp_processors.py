"""continuum's processors inside llama-cpp-python's own generation (``continuum/processors/llamacpp.py``):
``Llama.create_completion`` / ``Llama.generate`` with ``logits_processor=``, outputs checked with ``re`` and
``jsonschema`` (greedy and sampled), a reused instance, and the tokenizer read from the ``Llama``'s vocabulary.
"""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest

from continuum.processors import LlamaCppLogitsProcessor, llamacpp_choice, llamacpp_json, llamacpp_regex

from llamacpp_support import gguf, llama_cpp, load

PATTERN = r" (happy|sad|very big)\. [0-9]{2}"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"},
                                           "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 2}},
          "required": ["name", "age"]}


@pytest.fixture(scope="module")
def llm():
    return llama_cpp.Llama(model_path=str(gguf("f32")), n_ctx=256, n_threads=2, verbose=False)


def complete(llm, prompt: str, proc, **kw) -> dict:
    out = llm.create_completion(prompt, logits_processor=llama_cpp.LogitsProcessorList([proc]), **kw)
    return out["choices"][0]


def test_regex_outputs_match_greedy_and_sampled(llm):
    proc = llamacpp_regex(llm, PATTERN)
    for seed, temp in [(0, 0.0), (1, 1.0), (2, 1.5)]:  # the same instance, one call after another: it resets itself
        got = complete(llm, "Once upon a time she was", proc, max_tokens=16, temperature=temp, seed=seed)
        assert re.fullmatch(PATTERN, got["text"]) and got["finish_reason"] == "stop", got
        assert proc.error is None
    free = llm.create_completion("Once upon a time she was", max_tokens=8, temperature=0)["choices"][0]["text"]
    assert not re.fullmatch(PATTERN, free)  # the constraint did the work


def test_json_outputs_validate_against_the_schema(llm):
    proc = llamacpp_json(llm, SCHEMA)
    for seed in range(3):
        got = complete(llm, "Lily wrote:", proc, max_tokens=60, temperature=1.0, seed=seed)
        assert got["finish_reason"] == "stop", got
        jsonschema.validate(json.loads(got["text"]), SCHEMA)
        assert proc.parse(got["text"]) == json.loads(got["text"])


def test_choice_through_generate_with_token_ids(llm):
    proc = llamacpp_choice(llm, [" cat", " dog", " big dragon"])
    prompt = llm.tokenize(b"Once upon a time there was a")
    eos = llm.token_eos()
    out = []
    for tok in llm.generate(prompt, temp=0.0, logits_processor=llama_cpp.LogitsProcessorList([proc])):
        if tok == eos or len(out) > 6:
            break
        out.append(tok)
    assert llm.detokenize(out).decode() in (" cat", " dog", " big dragon")


def test_a_reused_instance_starts_afresh_on_a_new_input(llm):
    proc = llamacpp_regex(llm, r" [0-9]{3}")
    first = complete(llm, "One", proc, max_tokens=8, temperature=0)["text"]
    # a new prompt that extends the last input by one token the mask did not allow: a new generation, not a step
    second = complete(llm, "One" + first + " and", proc, max_tokens=8, temperature=0)["text"]
    assert re.fullmatch(r" [0-9]{3}", first) and re.fullmatch(r" [0-9]{3}", second)
    ids = np.array(llm.tokenize(b"One"))
    scores = np.zeros(llm.n_vocab(), np.float32)
    a = proc(ids, scores)
    proc.reset()
    assert np.array_equal(proc(ids, scores), a)


def test_an_internal_error_ends_the_generation_instead_of_going_on_unconstrained(llm):
    proc = llamacpp_regex(llm, r" [0-9]{3}")
    with pytest.warns(RuntimeWarning, match="ended here"):
        out = proc(np.array(llm.tokenize(b"One")), np.zeros(7, np.float32))  # scores of the wrong width
    assert proc.error is not None
    eos = sorted(proc.processor._eos)
    assert np.isfinite(out[eos]).all() and np.isfinite(out).sum() == len(eos)


def test_the_tokenizer_is_the_gguf_s_own(llm):
    from continuum.processors.llamacpp import llamacpp_tokenizer

    tok = llamacpp_tokenizer(llm)
    assert tok is llamacpp_tokenizer(llm)  # cached per Llama
    _, own, _ = load("f32")  # continuum's tokenizer over its own load of the same file
    assert tok.fingerprint == own.fingerprint
    text = "Once upon a time, 42 cats!"
    assert tok.encode_prompts([text])[0] == llm.tokenize(text.encode())
    assert isinstance(llamacpp_regex(llm, "a"), LlamaCppLogitsProcessor)
