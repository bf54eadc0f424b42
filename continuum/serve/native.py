"""continuum's own API over HTTP, next to the OpenAI routes: what ``models.remote`` calls (docs/remote.md).

* ``GET /v1/continuum/model``: the served name, the model's and tokenizer's fingerprints, the context length;
* ``GET /v1/continuum/tokenizer``: the tokenizer's files (base64), fetched once by each client and cached there;
* ``POST /v1/continuum/generate``: one generator call. The body names the generator (its constructor and
  arguments, as ``continuum.generate.spec`` records them; the sampler), the limits, the caller's rng state, and the
  input rows (``native_state.py``: a stored state's handle and the ids past it, or all the ids). The server builds
  the same generator on its model (cached per spec: a schema compiles once), continues the rebuilt state (only the
  uncached suffix is computed), stores the result like a response (the same store, key and retention: per-key
  isolation, ``kill -9`` safety, chains of parts), and answers the new tokens, log-probs, weights, the last step,
  the stored state's id and ``usage.positions``, the positions the model computed meanwhile. A ``call`` id makes a
  repeat safe: the answer is stored with the state, under an id that follows from the key and the call id, and a
  repeat of the call gets it back instead of a second generation.

Errors are continuum's own, named in the error body's ``code`` (``serve/errors.py``), so the client raises the same
class; a handle this key does not own is a :class:`~continuum.errors.RemoteStateError`.
"""

from __future__ import annotations

import base64
import hashlib
import json
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError

from ..errors import GeneratorArgumentError
from ..loop.arrivals import ARRIVALS, Handoff
from ..models.remote.wire import GENERATE, MODEL, TOKENIZER, TUNNEL, last_json, rng_from, rng_json, sampler_from, speculator_from
from ..models.seqprefix import common_prefix
from .chat_completions import STREAM_HEADERS
from .errors import APIError, from_exception
from .messages import new_id
from .native_state import answer_rows, input_state, resumed
from .served import Cancelled
from .sse import DONE, ThreadStream, sse

__all__ = ["register"]

# what each constructor may receive over the wire (anything else is a client of another version: refused by name)
_EVERY = {"guidance_scale", "negative_prompt", "guidance_rescale", "cfg_mode",  # (classifier-free guidance)
          "reasoning", "thinking_budget"}  # (a thought first: continuum.generate.reasoning)
_ARGUMENTS = {
    "text": {"token_healing", "speculate", *_EVERY},
    "regex": {"pattern", "backend", "fast_forward", "token_healing", "speculate", *_EVERY},
    "choice": {"choices", "method", "backend", "fast_forward", "token_healing", *_EVERY},
    "json": {"schema", "whitespace_pattern", "backend", "max_string_length", "additional_properties", "on_unsupported",
             "max_items", "bounds", "fast_forward", "token_healing", "speculate", *_EVERY},
    "cfg": {"grammar", "syntax", "backend", "fast_forward", "token_healing", "speculate", *_EVERY},
}
_ANSWER = TypeAdapter(Any)  # (what FastAPI's own encoding writes: NaN and infinities as null)
_GENERATORS_KEPT = 128  # generators built, least recently used out (a schema's compiled guide lives in each)


class RowIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    ids: list[int]
    logprobs: list[float | None]
    weight: float = 0.0
    state: str | None = None  # the stored state this row extends, its row, and how many of its tokens
    row: int = 0
    cached: int = 0
    check: int | None = None  # the last covered id (a cheap check that the handle is this row's)


class GenerateRequest(BaseModel):
    model: str | None = None
    generator: dict[str, Any]
    rows: list[RowIn]
    batch: int
    samples: int
    max_tokens: int | None = None
    stop_at: str | list[str] | None = None
    rng: str | None = None
    call: str | None = None  # the client's id of this call: a repeat (a retry) gets the stored answer
    stream: bool = False  # server-sent events: each step's new text per row, then the answer
    resume: dict[str, Any] | None = None  # the unfinished constrained step the input ends with (native_state.resumed)


class Native:
    """The routes' work, on worker threads; generators cached by spec."""

    def __init__(self, ctx: Any):
        self.ctx, self.model = ctx, ctx.model
        self._generators: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()
        self._calls: dict[str, threading.Event] = {}  # calls with an id running now (a resent copy waits for them)
        self._files: dict[str, str] | None = None

    def info(self) -> dict:
        tok = self.model.tokenizer
        # joins: a client may send its programs' greedy calls of one generator as one list call (loop/coalesce), which
        # returns each row what it returns alone, except in llama.cpp's batch-invariant mode, which promises bits
        joins = not getattr(getattr(self.model, "llama", None), "batch_invariant", False)
        return {"name": self.ctx.config.served_model_name, "fingerprint": self.model.fingerprint.as_dict(),
                "context_length": self.model.context_length, "vocab_size": self.model.vocab_size, "joins": joins,
                "tokenizer": {"fingerprint": tok.fingerprint, "eos_token_ids": sorted(tok.eos_token_ids),
                              "name": tok.name, "kind": "gguf" if getattr(tok, "hf", None) is None else "transformers"}}

    def tokenizer_files(self) -> dict:
        """The tokenizer's files (base64): a transformers tokenizer's ``save_pretrained`` folder, or a GGUF's
        metadata as a vocab-only GGUF (``vocab.gguf``: the header and key-values, no tensors), which the client loads
        with llama.cpp's own tokenizer code (``continuum.models.remote.gguf``)."""
        if self._files is None:
            tok = self.model.tokenizer
            hf = getattr(tok, "hf", None)
            path = getattr(getattr(tok, "model", None), "path", None)
            if hf is not None and hasattr(hf, "save_pretrained"):
                with tempfile.TemporaryDirectory() as tmp:
                    hf.save_pretrained(tmp)
                    self._files = {p.name: base64.b64encode(p.read_bytes()).decode()
                                   for p in sorted(Path(tmp).iterdir()) if p.is_file()}
            elif path is not None and str(path).lower().endswith(".gguf"):
                from ..models.remote.gguf import vocab_only

                self._files = {"vocab.gguf": base64.b64encode(vocab_only(path)).decode()}
            else:
                raise APIError(400, f"this server's tokenizer ({type(tok).__name__}) cannot be sent: models.remote "
                                    f"needs a transformers or GGUF model on the server (docs/remote.md)",
                               code="not_supported")
        return {"files": self._files}

    def generator(self, spec: dict) -> Any:
        key = json.dumps(spec, sort_keys=True)
        with self._lock:
            gen = self._generators.get(key)
            if gen is not None:
                self._generators.move_to_end(key)
                return gen
        gen = _build(self.model, spec)
        with self._lock:
            self._generators[key] = gen
            while len(self._generators) > _GENERATORS_KEPT:
                self._generators.popitem(last=False)
        return gen

    def generate(self, req: GenerateRequest, owner: str, emit: Callable[[Any], None] | None = None,
                 cancelled: Callable[[], bool] = lambda: False) -> dict:
        """The call; its answer, stored before it is returned. ``emit``: a stream's, called with each step's text
        as ``[[kept, added], ...]`` per row (the characters of the row's previous text it keeps, then the new ones:
        the client rebuilds every step's texts exactly, so its chunks are a local stream's)."""
        if req.call is None:
            return self._generate(new_id("cs"), req, owner, emit, cancelled)
        # the call's stored state id follows from (key, call id): a retry finds its answer. A copy of a call still
        # running here (the client resent it when its connection broke) waits for that one's answer instead of
        # generating a second (a sampled call would differ, and its state file would replace the first's)
        sid = "cs_" + hashlib.sha256(f"{owner}:{req.call}".encode()).hexdigest()[:48]
        while True:
            done = self.ctx.store.get(sid, owner)
            if done is not None and "answer" in done.body:
                return done.body["answer"]
            with self._lock:
                running = self._calls.get(sid)
                if running is None:
                    self._calls[sid] = mine = threading.Event()
            if running is None:
                break
            running.wait()  # (then its stored answer; or, if it failed, this copy runs)
        try:
            return self._generate(sid, req, owner, emit, cancelled)
        except Exception:
            done = self.ctx.store.get(sid, owner)  # (another replica stored this call first: its answer stands)
            if done is not None and "answer" in done.body:
                return done.body["answer"]
            raise
        finally:
            with self._lock:
                del self._calls[sid]
            mine.set()

    def _generate(self, sid: str, req: GenerateRequest, owner: str, emit: Callable[[Any], None] | None,
                  cancelled: Callable[[], bool]) -> dict:
        gen = self.generator(req.generator)
        state, parent, base = input_state(self.model, self.ctx.store, owner, req.rows, req.batch, req.samples,
                                            self.ctx.config.served_model_name)
        if req.resume is not None:
            state = resumed(state, gen, req.resume)
        rng = rng_from(req.rng)
        before = self.model.tokens_computed
        out = self._run(gen, state, req, rng, emit, cancelled)
        positions = self.model.tokens_computed - before  # (the model's counter: exact while this call runs alone)
        ARRIVALS.arrived()  # (the store's write below is not on the way to a call: steps do not wait for it)
        answer = {"id": sid, "object": "continuum.generation", "batch": out.batch, "samples": out.samples,
                  "rows": answer_rows(state, out), "last": last_json(out._last), "rng": rng_json(rng),
                  "usage": {"positions": positions, "cached_tokens": sum(state._cached_real())}}
        body = {"id": sid, "object": "continuum.state", "created": time.time(), "model": self.ctx.config.served_model_name,
                "answer": answer}
        self.ctx.store.put(sid, owner, body, [], out, parent=parent, base=base)  # durable before it is answered
        return answer

    @staticmethod
    def _run(gen: Any, state: Any, req: GenerateRequest, rng: Any, emit: Callable[[Any], None] | None,
             cancelled: Callable[[], bool]) -> Any:
        from ..generate import continuous
        from ..loop.decoding import check_max_tokens

        if emit is None:
            return continuous(gen)(state, max_tokens=req.max_tokens, stop_at=req.stop_at, rng=rng)
        check_max_tokens(req.max_tokens)  # (what a continuous call checks first)
        steps = gen._steps(state, req.max_tokens, req.stop_at, rng, True)  # (the steps a local stream reads)
        sent: list[str] | None = None
        beams = gen.sampler.is_beam_search  # (a local stream shows beams once, at the end: nothing to send per step)
        try:
            while True:
                try:
                    step = next(steps)
                except StopIteration as stop:
                    return stop.value
                if cancelled():
                    raise Cancelled()
                if beams or step.texts is None:
                    continue
                texts = list(step.texts)
                if sent is None or len(sent) != len(texts):
                    sent = [""] * len(texts)
                if texts != sent:
                    emit([[(n := common_prefix(a, b)), b[n:]] for a, b in zip(sent, texts)])
                sent = texts
        finally:
            steps.close()  # (a cancelled stream leaves the decoding loop: its rows freed)


def _build(model: Any, spec: dict) -> Any:
    from .. import generate

    kind, arguments = str(spec.get("kind")), spec.get("arguments") or {}
    allowed = _ARGUMENTS.get(kind)
    if allowed is None:
        raise GeneratorArgumentError(f"generator kind {kind!r}: expected one of {sorted(_ARGUMENTS)}")
    extra = sorted(set(arguments) - allowed)
    if extra:
        raise GeneratorArgumentError(f"generate.{kind} on a remote model does not take {extra} (docs/remote.md)")
    if arguments.get("speculate") is not None:
        arguments = {**arguments, "speculate": speculator_from(arguments["speculate"])}
    if isinstance(arguments.get("reasoning"), list):  # (a marker pair: JSON's list, the constructor's tuple)
        arguments = {**arguments, "reasoning": tuple(arguments["reasoning"])}
    return getattr(generate, kind)(model, sampler=sampler_from(spec.get("sampler") or {"type": "greedy"}), **arguments)


def register(app: FastAPI, ctx: Any) -> None:
    native = Native(ctx)

    @app.get(MODEL)
    async def model_info(request: Request) -> dict:
        ctx.owner(request)
        return native.info()

    @app.get(TOKENIZER)
    async def tokenizer(request: Request) -> dict:
        ctx.owner(request)
        return await ctx.run(native.tokenizer_files)

    @app.post(GENERATE)
    async def generate_route(request: Request) -> Any:
        # the body read and validated in one pass (pydantic's JSON parser), not parsed by FastAPI and then validated
        try:
            req = GenerateRequest.model_validate_json(await request.body())
        except ValidationError as exc:
            raise RequestValidationError(exc.errors(include_url=False)) from None
        return await generate_call(req, request)

    async def generate_call(req: GenerateRequest, request: Request) -> Any:
        owner = ctx.owner(request)
        if req.model is not None:
            ctx.check_model(req.model)
        if not req.stream:  # (the answer's JSON written at once: no FastAPI encoding pass over every id and log-prob)
            # plain calls that clients send together run as one list call (loop/coalesce: greedy calls only, each row
            # what it is alone); counted as on their way from their worker's start, not while queued for a worker
            # (a full pool's queue would hold every step's wait for arrivals at its bound)
            handoff = Handoff(early=False)
            answer = await ctx.run(lambda: handoff.run(lambda: native.generate(req, owner)), reply=True)
            return Response(_ANSWER.dump_json(answer), media_type="application/json")
        stream = ThreadStream(lambda emit, cancelled: native.generate(req, owner, emit, cancelled))
        first = await stream.get()
        if first[0] == "error":  # (refused before its first step: an HTTP error, as without a stream)
            raise from_exception(first[1])

        async def events():
            async for kind, item in stream.items(first):
                if kind == "event":
                    yield sse({"texts": item})
                elif kind == "error":
                    if not isinstance(item, Cancelled):
                        yield sse(from_exception(item).body())
                    return
                else:
                    yield sse({"answer": item})
                    yield DONE

        return StreamingResponse(events(), media_type="text/event-stream", headers=STREAM_HEADERS)

    @app.post(TUNNEL)
    async def tunnel(request: Request) -> Any:
        """The native routes through a gateway that forwards only the routes it knows (SMG: SGLang's ``/generate``,
        its body as sent): ``{"continuum": {"route": ..., "body": ...}}``."""
        try:
            data = await request.json()
        except ValueError:
            data = None
        inner = data.get("continuum") if isinstance(data, dict) else None
        route = inner.get("route") if isinstance(inner, dict) else None
        if route not in (MODEL, TOKENIZER, GENERATE):
            raise APIError(404, "POST /generate carries models.remote's calls through gateways ({\"continuum\": "
                                "{\"route\": \"/v1/continuum/...\", \"body\": ...}}); SGLang's /generate is not served "
                                "here: use the OpenAI routes", code="unknown_route")
        assert isinstance(inner, dict)
        if route == MODEL:
            return await model_info(request)
        if route == TOKENIZER:
            return await tokenizer(request)
        try:
            req = GenerateRequest.model_validate(inner.get("body"))
        except ValidationError as exc:
            raise APIError(400, f"the generate call's body is not valid: {exc}", code="invalid_request") from None
        return await generate_call(req, request)
