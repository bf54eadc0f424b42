"""What the API-wide fuzz harness (tests/test_fuzz_api.py) found, each fixed at the source: a specific continuum error,
with a message that says what to do, where a raw error, a hang or a killed process was.
"""

from __future__ import annotations

import pytest
import torch
from pydantic import BaseModel

from continuum import SequenceState, continuous, generate, samplers

from conftest import check_unchanged, snapshot


def test_found_rng_of_the_wrong_type(gpt2_model):
    from continuum.errors import ContinuumTypeError

    state = SequenceState.from_prompts(gpt2_model, ["hi"])
    for rng in ("seed", 3, torch.zeros(1)):
        with pytest.raises(ContinuumTypeError, match="rng must be a torch.Generator"):
            generate.text(gpt2_model)("hi", max_tokens=2, rng=rng)
        with pytest.raises(ContinuumTypeError, match="rng must be a torch.Generator"):
            generate.choice(gpt2_model, ["a", "b"])("hi", rng=rng)
        with pytest.raises(ContinuumTypeError, match="rng must be a torch.Generator"):
            continuous(generate.text(gpt2_model))(state, max_tokens=2, rng=rng)


def test_found_negative_prompt_of_the_wrong_type(gpt2_model):
    from continuum.errors import GeneratorArgumentError

    for bad in (3, b"x", 1.5):
        with pytest.raises(GeneratorArgumentError, match="negative_prompt must be a string"):
            generate.text(gpt2_model, guidance_scale=2.0, negative_prompt=bad)


@pytest.mark.parametrize("schema", [{"anyOf": None}, {"properties": 3}, {"items": "x"}, {"required": "a"}, {"enum": 5}])
def test_found_malformed_keywords_are_refused_by_the_metaschema(gpt2_model, schema):
    from continuum.errors import UnsupportedSchemaError

    with pytest.raises(UnsupportedSchemaError, match="not a valid"):
        generate.json(gpt2_model, schema)


def test_found_pydantic_base_model_itself(gpt2_model):
    from continuum.errors import UnsupportedSchemaError

    with pytest.raises(UnsupportedSchemaError, match="pydantic cannot give the JSON schema of BaseModel"):
        generate.json(gpt2_model, BaseModel)


def test_found_continuous_of_something_else():
    from continuum.errors import ContinuumTypeError

    for bad in ("text", None, generate.text):
        with pytest.raises(ContinuumTypeError, match="continuous\\(\\) takes a generator"):
            continuous(bad)


@pytest.mark.parametrize("make", [lambda: samplers.multinomial(10**6), lambda: samplers.beam_search(10**6),
                                  lambda: samplers.multinomial(2**70)])
def test_found_a_fork_larger_than_memory(gpt2_model, make):
    """multinomial(10**6) got the process killed by the kernel (no exception); now refused before the fork."""
    from continuum.errors import GeneratorArgumentError
    from continuum.models.memory import available_bytes

    if available_bytes(gpt2_model.device) is None:
        pytest.skip("available memory unknown here")
    state = SequenceState.from_prompts(gpt2_model, ["hi"])
    before = snapshot(state)
    with pytest.raises(GeneratorArgumentError, match="rows would need"):
        continuous(generate.text(gpt2_model, make()))(state, max_tokens=2)
    with pytest.raises(GeneratorArgumentError, match="rows would need"):
        generate.choice(gpt2_model, ["a", "b"], make())("hi")
    check_unchanged(state, before)
    assert len(continuous(generate.text(gpt2_model, samplers.multinomial(3)))(state, max_tokens=2).texts) == 3
