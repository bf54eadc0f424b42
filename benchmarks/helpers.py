"""Helpers the scenario modules share (HF baseline calls, token counts, the B5/B10 schema).

They live below every scenario module (``scenarios.py``, ``fastforward.py``, ...), so a scenario in
its own module imports them from here and ``scenarios.py`` imports the scenarios: no circle.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum
from typing import Annotated

import torch

from continuum import IncompleteGenerationError, SequenceState
from continuum.errors import SchemaViolationError

from .measurement import Call, paired
from .model import Bench, n_tokens
from .results import log

__all__ = ["hf_generate", "new_tokens", "real_len", "real_ids", "complete", "fresh", "compare_with_hf", "json_schema"]


def hf_generate(bench: Bench, prompt, new: int, **kwargs) -> torch.Tensor:
    """HF ``generate`` of ``new`` tokens per sequence.

    With random weights EOS is (almost) never produced, so no ``min_new_tokens`` processor is added (it
    costs HF ~1-2 ms per step); the scenarios check that both sides generated the same counts. With a
    real model (``bench.force_length``) EOS is suppressed until ``new`` tokens.
    """
    enc = bench.tok(prompt, return_tensors="pt")
    if bench.force_length:
        kwargs.setdefault("min_new_tokens", new)
    with torch.inference_mode():
        out = bench.hf.generate(**enc, max_new_tokens=new, pad_token_id=bench.pad_id, **kwargs)
    return out[:, enc["input_ids"].shape[1]:]


def new_tokens(state: SequenceState, before: int) -> int:
    """New real tokens in row 0 of ``state`` given ``before`` tokens in the input."""
    return int(state.attention_masks[0].sum()) - before


def real_len(state: SequenceState) -> int:
    return int(state.attention_masks[0].sum())


def real_ids(state: SequenceState) -> list[list[int]]:
    """Every row's real token ids (padding and holes dropped), from the public ``token_ids`` / ``attention_masks``."""
    return [ids[mask.bool()].tolist() for ids, mask in zip(state.token_ids, state.attention_masks)]


def complete(state: SequenceState) -> bool:
    """Whether the last constrained step matched its whole pattern (``state.value`` raises
    ``IncompleteGenerationError`` when a row was cut first); an output that fails its schema is complete."""
    try:
        _ = state.value
    except IncompleteGenerationError:
        return False
    except SchemaViolationError:
        return True
    return True


def fresh(state: SequenceState) -> SequenceState:
    """A new state object equal to ``state`` (same tensors, no memoised texts): ``state + ""``."""
    return state + ""


def compare_with_hf(bench: Bench, prompt, new: int, run: Callable[[], SequenceState], reps: int,
                    **hf_kwargs) -> tuple[list[Call], list[Call], bool]:
    """Paired timing of HF ``generate(**hf_kwargs)`` and ``run()``; also whether row 0's tokens agree."""
    plen = n_tokens(bench.tok, prompt)
    outputs = {}

    def base():
        out = hf_generate(bench, prompt, new, **hf_kwargs)
        outputs["hf"] = out[0].tolist()
        return out.shape[1]

    def cont():
        s = run()
        outputs["cont"] = s.token_ids[0, plen:].tolist()
        return new_tokens(s, plen)

    b, c = paired(bench, base, cont, reps, log=log)
    return b, c, outputs.get("hf") == outputs.get("cont")


def json_schema():
    from pydantic import BaseModel, Field

    class Color(str, Enum):
        red = "red"
        green = "green"
        blue = "blue"

    class Address(BaseModel):
        city: str = Field(max_length=12)
        zip_code: str = Field(pattern=r"^[0-9]{5}$")

    class Person(BaseModel):
        name: str = Field(max_length=12)
        age: int = Field(json_schema_extra={"maxDigits": 3})
        favourite: Color
        address: Address
        tags: list[Annotated[str, Field(max_length=8)]] = Field(max_length=3)

    return Person


USER_TURNS = [
    "\nQ: Who saw the ship first?\nA:",
    "\nQ: What colour were its sails?\nA:",
    "\nQ: Where did the ship go next?\nA:",
    "\nQ: What did Anna write down?\nA:",
    "\nQ: Was the weather good that day?\nA:",
    "\nQ: Who climbed the tower?\nA:",
    "\nQ: What did the baker forget?\nA:",
    "\nQ: What happened at the end?\nA:",
]


def user_turns(n: int) -> list[str]:
    return [USER_TURNS[i % len(USER_TURNS)] for i in range(n)]
