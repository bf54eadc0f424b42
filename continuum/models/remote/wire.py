"""What travels between ``models.remote`` and ``continuum serve``'s native routes, written and read on both sides.

JSON only: log-probs as floats with ``null`` for NaN (JSON has no NaN; a Python float is a double, so a float32
log-prob comes back bit for bit), a torch generator's state as base64 (so a seeded call draws on the server what it
would draw locally, and the caller's generator moves on exactly as a local call moves it), samplers and the last
step as small dicts.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Sequence
from typing import Any

import torch

from ...errors import GeneratorArgumentError
from ...samplers import BeamSearchSampler, GreedySampler, MultinomialSampler, Sampler
from ...state.laststep import LastStep

__all__ = ["MODEL", "GENERATE", "TOKENIZER", "TUNNEL", "floats", "nans", "sampler_json", "sampler_from", "rng_json", "rng_from",
           "last_json", "last_from", "speculator_json", "speculator_from"]

MODEL = "/v1/continuum/model"  # what the server serves: its name, fingerprints, context length
GENERATE = "/v1/continuum/generate"  # one generator call on stored states
TOKENIZER = "/v1/continuum/tokenizer"  # the served model's tokenizer files, fetched once per client
# the three above through a gateway that routes only what it knows (SMG forwards SGLang's /generate with its body
# as sent): {"text": "", "stream": ..., "continuum": {"route": one of the three, "body": its body}}
TUNNEL = "/generate"


def floats(values: Sequence[float]) -> list[float | None]:
    """Log-probs as JSON: NaN (prompt and added tokens) as None."""
    return [None if math.isnan(v) else v for v in values]


def nans(values: Sequence[float | None]) -> list[float]:
    return [math.nan if v is None else float(v) for v in values]


def sampler_json(sampler: Sampler) -> dict:
    if isinstance(sampler, GreedySampler):
        return {"type": "greedy"}
    if isinstance(sampler, MultinomialSampler):
        return {"type": "multinomial", "samples": sampler.samples, "top_k": sampler.top_k, "top_p": sampler.top_p,
                "temperature": sampler.temperature}
    if isinstance(sampler, BeamSearchSampler):
        return {"type": "beam_search", "beams": sampler.samples}
    raise GeneratorArgumentError(f"a remote model runs continuum's own samplers (greedy, multinomial, beam_search), "
                                 f"not {type(sampler).__name__}")


def sampler_from(spec: Any) -> Sampler:
    from ... import samplers

    if not isinstance(spec, dict):
        raise GeneratorArgumentError(f"sampler: expected an object, got {type(spec).__name__}")
    kind = spec.get("type")
    if kind == "greedy":
        return samplers.greedy()
    if kind == "multinomial":
        return samplers.multinomial(spec.get("samples", 1), top_k=spec.get("top_k"), top_p=spec.get("top_p"),
                                    temperature=spec.get("temperature"))
    if kind == "beam_search":
        return samplers.beam_search(spec.get("beams", 1))
    raise GeneratorArgumentError(f"sampler type {kind!r}: expected 'greedy', 'multinomial' or 'beam_search'")


def speculator_json(spec: Any) -> dict:
    """A speculator as the server rebuilds it: prompt lookup (``speculate.lookup``) and its settings."""
    import dataclasses

    from ...speculate import Lookup

    if type(spec) is not Lookup:
        raise GeneratorArgumentError(f"a remote model speculates with speculate.lookup(...), not {type(spec).__name__}: "
                                     f"use it, or run this generator on a local model")
    return {"type": "lookup", **{f.name: getattr(spec, f.name) for f in dataclasses.fields(spec) if f.init}}


def speculator_from(data: Any) -> Any:
    from ... import speculate

    if not isinstance(data, dict) or data.get("type") != "lookup":
        raise GeneratorArgumentError(f"speculate: expected {{'type': 'lookup', ...}}, got {data!r}")
    try:
        return speculate.lookup(**{k: v for k, v in data.items() if k != "type"})
    except TypeError as exc:
        raise GeneratorArgumentError(f"speculate: {exc}") from None


def rng_json(rng: torch.Generator | None) -> str | None:
    return None if rng is None else base64.b64encode(rng.get_state().numpy().tobytes()).decode()


def rng_from(data: str | None) -> torch.Generator | None:
    if data is None:
        return None
    rng = torch.Generator()
    try:
        rng.set_state(torch.frombuffer(bytearray(base64.b64decode(data)), dtype=torch.uint8))
    except (ValueError, RuntimeError) as exc:
        raise GeneratorArgumentError(f"rng: not a torch CPU generator's state ({exc})") from None
    return rng


def last_json(last: LastStep | None) -> dict | None:
    """The last step without what cannot travel (the parse function: the client's generator has its own; guide
    states: an unfinished constrained step is not resumed remotely yet)."""
    if last is None:
        return None
    return {"kind": last.kind, "starts": list(last.starts), "ends": list(last.ends), "complete": list(last.complete),
            "max_tokens": last.max_tokens, "finish": list(last.finish) if last.finish is not None else None,
            "marks": [[list(m) for m in row] for row in last.marks] if last.marks is not None else None,
            "thoughts": [list(t) for t in last.thoughts] if last.thoughts is not None else None,
            "speculation": last.speculation,
            "resumable": last.guide_states is not None}  # (an unfinished step the same generator resumes)


def last_from(data: dict | None, parse: Any) -> LastStep | None:
    if data is None:
        return None
    marks, thoughts, spec = data.get("marks"), data.get("thoughts"), data.get("speculation")
    return LastStep(kind=data["kind"], starts=tuple(data["starts"]), ends=tuple(data["ends"]),
                    complete=tuple(data["complete"]), parse=parse, max_tokens=data.get("max_tokens"),
                    finish=tuple(data["finish"]) if data.get("finish") is not None else None,
                    marks=tuple(tuple((int(a), int(b), str(k)) for a, b, k in row) for row in marks) if marks else None,
                    thoughts=tuple((int(a), int(b), int(c), int(d)) for a, b, c, d in thoughts) if thoughts else None,
                    speculation={str(k): int(v) for k, v in spec.items()} if spec else None)
