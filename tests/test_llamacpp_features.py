"""Every generator kind on llama.cpp, against the transformers backend on the same weights (stories260K as
safetensors and as an f32 GGUF: independent implementations, logits within ~1e-3 here, so greedy outputs agree)
and against each call alone (threads, asyncio, in the batch-invariant mode: exactly)."""

from __future__ import annotations

import asyncio
import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest
import torch

from continuum import generate, models, samplers

from llamacpp_support import gguf

GRAMMAR = """start: "The " animal " was " mood "."
animal: "cat" | "dog" | "bird"
mood: /[a-z]{3,8}/
"""
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "pet": {"enum": ["cat", "dog", "bird"]}, "happy": {"type": "boolean"}},
          "required": ["name", "pet", "happy"], "additionalProperties": False}


@pytest.fixture(scope="module")
def model():
    return models.llamacpp(gguf("f32"), batch_invariant=True, n_threads=2)


def _json(m, **options):
    return generate.json(m, SCHEMA, samplers.greedy(), whitespace_pattern="", **options)


def _valid(value) -> bool:
    jsonschema.validate(value, SCHEMA)
    return True


CASES = {
    "grammar": (lambda m: generate.cfg(m, GRAMMAR, samplers.greedy()), "Once upon a time. ",
                lambda out: re.fullmatch(r"The (cat|dog|bird) was [a-z]{3,8}\.", out)),
    "regex": (lambda m: generate.regex(m, r"[A-Z][a-z]{1,8} (was|is) [a-z]{2,8}\.", samplers.greedy()),
              "Lily had a cat. ", lambda out: re.fullmatch(r"[A-Z][a-z]{1,8} (was|is) [a-z]{2,8}\.", out)),
    "json, fast-forward": (lambda m: _json(m, fast_forward=True), "A cat: ", _valid),
    "json, token by token": (lambda m: _json(m, fast_forward=False), "A cat: ", _valid),
    "json after a thought": (lambda m: _json(m, reasoning=("<think>", "</think>"), thinking_budget=6), "<think>", _valid),
}


@pytest.mark.parametrize("case", list(CASES))
def test_every_generator_kind_agrees_with_the_transformers_backend(model, stories, case):
    make, prompt, valid = CASES[case]
    ours, ref = (make(m)(prompt, max_tokens=80) for m in (model, stories))
    assert valid(ours), ours
    assert ours == ref


def test_beams_and_seeded_sampling_agree_with_the_transformers_backend(model, stories):
    outs = {}
    for m in (model, stories):
        beams = generate.text(m, samplers.beam_search(3))("Once upon a time", max_tokens=8)
        drawn = generate.text(m, samplers.multinomial(2))("Once upon a time", max_tokens=8,
                                                          rng=torch.Generator().manual_seed(7))
        outs[m] = (beams, drawn)
    assert outs[model][0] == outs[stories][0]
    assert outs[model][1] == outs[stories][1]


def test_threads_and_asyncio_return_what_each_call_returns_alone(model):
    gen = generate.text(model, samplers.greedy())
    prompts = ["Once", "One day", "The cat", "Lily and Tom", "The sun was"]
    alone = [gen(p, max_tokens=10) for p in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        assert list(pool.map(lambda p: gen(p, max_tokens=10), prompts)) == alone

    async def main():
        return await asyncio.gather(*(gen.acall(p, max_tokens=10) for p in prompts))

    assert asyncio.run(main()) == alone
    chunks = asyncio.run(_stream(gen, prompts[1]))
    assert "".join(chunks) == alone[1]


async def _stream(gen, prompt):
    return [c async for c in gen.astream(prompt, max_tokens=10)]


def test_json_value_is_parsed(model):
    value = generate.json(model, SCHEMA, samplers.greedy())("A cat: ", max_tokens=80)
    assert json.loads(json.dumps(value)) == value
