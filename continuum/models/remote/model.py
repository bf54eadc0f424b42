"""``models.remote(url)``: a model whose calls run on a ``continuum serve``, whose states stay exact on the client.

A generator built on a :class:`RemoteModel` is the generator built on a local model: the constructor checks its
arguments here (with the server's tokenizer, fetched once) and remembers them (``continuum.generate.spec``). A call
does not run the decoding loop here: :meth:`RemoteModel.call_steps` sends the generator's spec, the sampler, the
limits and the input state to ``POST /v1/continuum/generate``, and the server runs the same call on its model.

The input state travels as its rows: a row whose first tokens the server holds (its KV handle names a stored state
and row, and the state's mask says how many tokens are covered) sends only the ids past them; any other row sends
all its ids. Per row the server answers which input row it grew from (forks and beams reorder rows), how many of that
row's tokens it kept, the tokens after them with their log-probs, the weight, and how many tokens its stored result
covers. The result is a plain :class:`~continuum.state.SequenceState` whose KV is a
:class:`~continuum.models.remote.handle.RemoteKV` on the stored result: slicing, adding, ``list(state)`` and ``repr``
are local, and continuing any slice of it sends the handle again.
"""

from __future__ import annotations

import json
import secrets
import threading
from collections.abc import Sequence
from typing import Any

import torch

from ...errors import BackendError, GeneratorArgumentError, ModelLoadError, RemoteError
from ...loop.checks import check_rng
from ...loop.decoding import Step
from ...state import SequenceState
from ...state.layout import right_aligned
from ..identity import ModelFingerprint
from .client import Client, load_tokenizer
from .handle import RemoteKV
from .wire import GENERATE, MODEL, floats, last_from, nans, rng_from, rng_json, sampler_json, speculator_json

__all__ = ["RemoteModel", "remote", "generator_json"]

# arguments of the generator constructors the server does not take as recorded: the sampler (every call sends its
# own), and reasoning, sent as the generator holds it (``with_reasoning`` changes it after construction)
_LOCAL_ONLY = ("sampler", "reasoning", "thinking_budget")


def remote(url: str, api_key: str | None = None, model: str | None = None, timeout: float = 120.0) -> RemoteModel:
    """The model served by ``continuum serve`` at ``url`` (its root or ``/v1`` URL), for every generator.

    ``api_key``: one of the server's ``--api-key``\\ s (states are stored per key); ``model``: the served name
    to expect (default: whatever the server serves); ``timeout``: seconds a call may take before
    :class:`~continuum.errors.RemoteError`.

    Example:
        >>> model = models.remote("http://127.0.0.1:8000", api_key="sk-local-1")   # doctest: +SKIP
        >>> s = continuous(generate.text(model, samplers.greedy()))("Once upon a time", max_tokens=8)  # doctest: +SKIP
    """
    return RemoteModel(url, api_key=api_key, model=model, timeout=timeout)


class RemoteModel:
    """A served model (see the module docstring). ``tokens_computed`` counts the positions the server computed for
    this client's calls (the server's own counter around each call: exact while a call runs alone there)."""

    runs_calls = True  # generators hand whole calls to call_steps (continuum.generate.generator)
    prefix_cache = None
    kv_budget = None
    max_call_rows = None
    world_size = 1
    hybrid = None
    layer_devices = None  # (no local KV tensors: a remote state never moves between devices)
    kv_dtype = None

    def __init__(self, url: str, api_key: str | None = None, model: str | None = None, timeout: float = 120.0):
        self.client = Client(url, api_key, timeout)
        info = self.client.get(MODEL)
        if model is not None and model != info["name"]:
            raise ModelLoadError(f"the server at {self.client.base} serves {info['name']!r}, not {model!r}: pass "
                                 f"model={info['name']!r} (or none), or point at the server of {model!r}")
        self.name: str = info["name"]
        self.fingerprint: Any = _fingerprint(info["fingerprint"])
        self.context_length: int | None = info.get("context_length")
        self.vocab_size: int = int(info["vocab_size"])
        # a run_batch program's greedy calls of one generator may go as one list call (loop/coalesce): one request
        self.joins: bool = bool(info.get("joins", False))
        self.tokenizer = load_tokenizer(self.client, info)
        self.device = torch.device("cpu")
        self.tokens_computed = 0
        self.forward_calls = 0  # calls sent
        self._count = threading.Lock()

    def __repr__(self) -> str:
        return f"RemoteModel({self.name!r} at {self.client.base})"

    def same_model(self, other: Any) -> bool:
        """Handles are valid on the server (or replicas behind one URL) that stored them, for the same weights."""
        return other is self or (isinstance(other, RemoteModel) and other.client.base == self.client.base
                                 and other.fingerprint == self.fingerprint)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise BackendError("a remote model runs whole generator calls on its server (models.remote), not single "
                           "forwards: call a generator built on it")

    forward_now = forward

    def detach(self, state: SequenceState) -> SequenceState:
        """``state`` without its server handle (same tokens, weights, log-probs and last step): the next call sends
        every token, for a handle the server no longer has (:class:`~continuum.errors.RemoteStateError`)."""
        from ...state.convert import uncached

        return uncached(state, self) if state._kv is not None else state

    # state files: a saved remote state keeps its handle (continuum.state.persistence)
    def save_kv(self, kv: RemoteKV) -> tuple[dict, dict]:
        return {}, {"backend": "remote", **kv.save()}

    def load_kv(self, tensors: dict, meta: dict) -> RemoteKV:
        return RemoteKV.restore(meta)

    # ------------------------------------------------------------------ calls
    def call_steps(self, gen: Any, state: SequenceState, max_tokens: int | None, stop_at: Any, rng: Any,
                   track_text: bool = False):
        """What ``gen._steps`` is for a local model: an iterator of steps whose return value is the new state. The
        call runs whole on the server; a stream's (``track_text``) steps come from it by server-sent events as it
        decodes, each with every row's text so far, as the local loop's steps have them."""

        def steps():
            if not track_text:
                return self.call(gen, state, max_tokens, stop_at, rng)
            body, real = self._body(gen, state, max_tokens, stop_at, rng)
            body["stream"] = True
            texts: list[str] = []
            for event in self.client.stream(GENERATE, body):
                if "answer" in event:
                    return self._finish(event["answer"], real, gen, rng)
                changes = event["texts"]
                if len(texts) != len(changes):
                    texts = [""] * len(changes)
                texts = [t[:keep] + added for t, (keep, added) in zip(texts, changes)]
                yield Step(list(texts), False)
            raise RemoteError(f"the stream of {self.client.base}{GENERATE} ended without its answer: call again")

        return steps()

    def _body(self, gen: Any, state: SequenceState, max_tokens: int | None, stop_at: Any,
              rng: torch.Generator | None) -> tuple[dict, list[tuple[list[int], list[float]]]]:
        check_rng(rng)
        real = state._real_rows()
        body = {"model": self.name, "generator": generator_json(gen), "batch": state.batch, "samples": state.samples,
                "rows": _rows_json(state, real), "max_tokens": max_tokens,
                "stop_at": list(stop_at) if isinstance(stop_at, (list, tuple)) else stop_at, "rng": rng_json(rng),
                "call": secrets.token_hex(16)}  # (a retry of this request gets the stored answer, not a new call)
        last = state._last
        if gen.guide is not None and last is not None and last.guide_key == _resume_key(gen) and \
                last.guide_states is not None and not all(last.complete):  # (resumed as a local call resumes it)
            body["resume"] = {"starts": list(last.starts), "complete": list(last.complete)}
        return body, real

    def call(self, gen: Any, state: SequenceState, max_tokens: int | None, stop_at: Any,
             rng: torch.Generator | None) -> SequenceState:
        """One generator call on the server: ``gen`` continuing ``state``; returns the new state."""
        body, real = self._body(gen, state, max_tokens, stop_at, rng)
        return self._finish(self.client.post(GENERATE, body), real, gen, rng)

    def _finish(self, data: dict, real: list[tuple[list[int], list[float]]], gen: Any,
                rng: torch.Generator | None) -> SequenceState:
        result = self._result(data, real, gen.parse)
        last = result._last
        if gen.guide is not None and last is not None and data["last"].get("resumable") and not all(last.complete):
            # (an unfinished constrained step: the same generator resumes it, as locally; the guide's states stay on
            # no side, the server walks the guide over the step's tokens again: native_state.resumed. The key is
            # not the guide's own, so a local generator never takes these placeholders for its states.)
            result._last = last._with(guide_key=_resume_key(gen), guide_states=(None,) * len(last.complete))
        if rng is not None and data.get("rng") is not None:  # the caller's generator moves on as a local call moves it
            moved = rng_from(data["rng"])
            assert moved is not None
            rng.set_state(moved.get_state())
        with self._count:
            self.tokens_computed += int(data["usage"]["positions"])
            self.forward_calls += 1
        return result

    def _result(self, data: dict, real: list[tuple[list[int], list[float]]], parse: Any) -> SequenceState:
        """The answer as a state: each row's kept input tokens, then the new ones; the stored result as its KV."""
        rows, cached = [], []
        for row in data["rows"]:
            ids, lps = real[row["source"]]
            keep = row["common"]
            rows.append((ids[:keep] + row["ids"], lps[:keep] + nans(row["logprobs"])))
            cached.append(int(row["cached"]))
        weights = torch.tensor([row["weight"] for row in data["rows"]], dtype=torch.float32)
        return layout(self, rows, cached, weights, data["batch"], data["samples"], last_from(data["last"], parse),
                      data["id"])


def _resume_key(gen: Any) -> str:
    return "remote:" + gen.guide.key


def _fingerprint(saved: dict) -> Any:
    """The server's model fingerprint as its backend's class (transformers' ``ModelFingerprint``, llama.cpp's
    ``LlamaCppFingerprint``): compared by ``same_model``, written in saved states' files."""
    if "gguf" in saved:
        from ..llamacpp.fingerprint import LlamaCppFingerprint

        return LlamaCppFingerprint(**saved)
    return ModelFingerprint.from_dict(saved)


def _rows_json(state: SequenceState, real: list[tuple[list[int], list[float]]]) -> list[dict]:
    """The input rows: the handle's (stored state, row, tokens covered) and the ids past them, or every id."""
    kv = state._kv if isinstance(state._kv, RemoteKV) else None
    covered = state._cached_real() if kv is not None else [0] * state.rows
    weights = state._weights.tolist()
    out = []
    for r, (ids, lps) in enumerate(real):
        c, entry = covered[r], kv.entries[r] if kv is not None else None
        if not c or entry is None:
            c = 0
        row: dict = {"ids": ids[c:], "logprobs": floats(lps[c:]), "weight": weights[r]}
        if c:  # (the last covered id: a cheap check that the server's row is the one this row extends)
            assert entry is not None
            row.update(state=entry[0], row=entry[1], cached=c, check=ids[c - 1])
        out.append(row)
    return out


def layout(model: RemoteModel, rows: Sequence[tuple[list[int], list[float]]], cached: Sequence[int],
           weights: torch.Tensor, batch: int, samples: int, last: Any, stored: str) -> SequenceState:
    """A state of ``rows`` (ids, log-probs) whose first ``cached[r]`` tokens the stored state ``stored`` covers: the
    covered tokens right-aligned in the first columns, the rest after them (the layout every state has: KV columns
    first, the uncached suffix last, so the algebra cuts and stacks it like any other)."""
    pad = model.tokenizer.pad_token_id
    head = right_aligned([ids[:c] for (ids, _), c in zip(rows, cached)], [lp[:c] for (_, lp), c in zip(rows, cached)],
                          pad, model.device)
    tail = right_aligned([ids[c:] for (ids, _), c in zip(rows, cached)], [lp[c:] for (_, lp), c in zip(rows, cached)],
                          pad, model.device)
    width = head[0].shape[1]
    kv = RemoteKV(tuple((stored, r) for r in range(len(rows))), width) if width else None
    return SequenceState(model=model, ids=torch.cat([head[0], tail[0]], 1), mask=torch.cat([head[1], tail[1]], 1),
                         logprobs=torch.cat([head[2], tail[2]], 1), weights=weights, kv=kv, batch=batch,
                         samples=samples, last=last)


def generator_json(gen: Any) -> dict:
    """The generator as the server rebuilds it: its constructor, its arguments (JSON), its sampler. Raises
    :class:`~continuum.errors.GeneratorArgumentError` for what does not run remotely yet."""
    cached = getattr(gen, "_remote_json", None)
    if cached is not None:
        return cached
    spec = getattr(gen, "spec", None)
    if spec is None:
        raise GeneratorArgumentError(f"{gen!r} was not built by continuum.generate's constructors (text, choice, regex, "
                                     f"json, cfg), so a server cannot rebuild it")
    args = {k: v for k, v in spec.arguments.items() if k not in _LOCAL_ONLY}
    if gen.reasoning:  # (True, or the marker pair; resolved against the server's tokenizer there, as here)
        args["reasoning"] = gen.reasoning if gen.reasoning is True else list(gen.reasoning)
        args["thinking_budget"] = gen.thinking_budget
    if args.get("speculate") is not None:
        args["speculate"] = speculator_json(args["speculate"])
    if args.get("negative_prompt") is not None and not isinstance(args["negative_prompt"], str):
        args["negative_prompt"] = list(args["negative_prompt"])  # (strings, the constructor checked: JSON's list)
    schema = args.get("schema")
    if isinstance(schema, type) and hasattr(schema, "model_json_schema"):  # pydantic: the server validates its schema
        args["schema"] = schema.model_json_schema()  # (values are still parsed into the class here: gen.parse)
    if "choices" in args:
        args["choices"] = list(args["choices"])
    out = {"kind": spec.kind, "arguments": args, "sampler": sampler_json(gen.sampler)}
    try:
        json.dumps(out)
    except (TypeError, ValueError) as exc:
        raise GeneratorArgumentError(f"a remote model sends the generator's arguments as JSON, and one is not ({exc}): "
                                     f"pass JSON values (e.g. bounds as 'default', 'small' or None)") from None
    gen._remote_json = out
    return out
