"""``POST /v1/completions`` (legacy): free text after a prompt (or a list of prompts, one batch).

A prompt is text or token ids (as lm-eval sends). With ``echo`` and ``logprobs``, the log-probs cover
the prompt's tokens too (the first one null), as OpenAI's do: see ``echo.py``."""

from __future__ import annotations

import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from ..generate import continuous
from .chat_completions import STREAM_HEADERS, stops
from .echo import prompt_logprobs, prompt_state
from .errors import APIError, from_exception
from .messages import new_id
from .schemas import CompletionRequest
from .served import Cancelled, Sampling
from .sse import DONE, ThreadStream, sse
from .tokens import generated_count, prediction_tokens, row_tokens, safe_length

__all__ = ["register"]


def _run(ctx, prompts: list, sampling: Sampling, emit=None, cancelled=lambda: False) -> dict:
    """Generate; returns per row (batch-major): text, finish reason, tokens, log-probs, top log-probs; and usage."""
    with ctx.served.queue.generation() as g:
        out = _generate(ctx, prompts, sampling, emit, cancelled)
        g.prompt_tokens, g.generation_tokens = out["usage"]["prompt_tokens"], out["usage"]["completion_tokens"]
        return out


def _generate(ctx, prompts: list, sampling: Sampling, emit, cancelled) -> dict:
    gen, rec = ctx.served.generator("text", None, False, sampling, sampling.top_logprobs is not None)
    cgen, rng = continuous(gen), sampling.rng()
    inputs: Any = prompts if all(isinstance(p, str) for p in prompts) else prompt_state(ctx.model, prompts)
    if emit is None:
        state = cgen(inputs, max_tokens=sampling.max_tokens, stop_at=sampling.stop or None, rng=rng)
    else:
        stream = cgen.stream(inputs, max_tokens=sampling.max_tokens, stop_at=sampling.stop or None, rng=rng)
        acc: dict[int, str] = {}
        sent: dict[int, int] = {}
        for chunk in stream:
            flat = chunk if isinstance(chunk, list) else [chunk]
            flat = [x for c in flat for x in (c if isinstance(c, list) else [c])]
            for r, piece in enumerate(flat):
                acc[r] = acc.get(r, "") + piece
                safe = safe_length(acc[r], sampling.stop)  # a stop sequence is never streamed
                if safe > sent.get(r, 0):
                    emit((r, acc[r][sent.get(r, 0):safe]))
                    sent[r] = safe
            if cancelled():
                raise Cancelled()
        state = stream.state
    texts = state.last_text
    flat_texts = texts if isinstance(texts, list) else [texts]
    flat_texts = [x for t in flat_texts for x in (t if isinstance(t, list) else [t])]
    finish = [x for row in state.finish_reasons or [] for x in row]
    rows, prompt_tokens = [], 0
    for r in range(state.rows):
        ids, lps = row_tokens(state, r)
        g = generated_count(lps)
        if r % sampling.n == 0:
            prompt_tokens += len(ids) - g
        top = None
        if rec is not None:
            top = []
            for values, tids in rec.steps[:g]:
                i = r if len(values) == state.rows else r * len(values) // state.rows
                top.append(list(zip(tids[i], values[i])))
        out: str = flat_texts[r]
        cut = next((x for x in sampling.stop if finish[r] == "stop" and out.endswith(x)), None)
        out = out[: -len(cut)] if cut is not None else out  # OpenAI's completions end before the stop sequence
        rows.append({"text": out, "finish": "length" if finish[r] in ("length", "context") else "stop",
                     "tokens": ids[len(ids) - g:], "logprobs": lps[len(lps) - g:], "top": top})
    completion = sum(len(r["tokens"]) for r in rows)
    usage: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                             "total_tokens": prompt_tokens + completion}
    if predictions := prediction_tokens(state):  # (--speculate: drafted tokens kept and rejected)
        usage["completion_tokens_details"] = predictions
    return {"rows": rows, "usage": usage}


def _echoed(ctx, prompts: list, k: int) -> list[dict]:
    """Per prompt, its tokens (as generation tokenizes it), their log-probs and top ``k`` (the first: null)."""
    state = prompt_state(ctx.model, prompts)
    out = []
    for r in range(state.rows):
        ids, _ = row_tokens(state, r)
        lps, top = prompt_logprobs(ctx.model, ids, k)
        out.append({"tokens": ids, "logprobs": lps, "top": top, "special": True})
    return out


def _logprobs(ctx, rows: list[dict], offset: int) -> dict:
    """OpenAI's legacy ``logprobs`` of ``rows`` (the echoed prompt's then the generated tokens', or one of them).
    A prompt's tokens show their share of its text (:func:`_shares`; BOS: none), so they join to the echoed text."""
    tokens: list[str] = []
    lps, tops, offsets, at = [], [], [], offset
    for row in rows:
        texts = (_shares(ctx.model.tokenizer, row["tokens"]) if row.get("special")
                 else [ctx.served.token_text(t) for t in row["tokens"]])
        for i, t in enumerate(texts):
            offsets.append(at)
            at += len(t)
            step = row["top"][i] if row["top"] is not None else None
            tops.append(_top(ctx, step) if step is not None else None)
        tokens += texts
        lps += row["logprobs"]
    has_top = any(row["top"] is not None for row in rows)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops if has_top else None, "text_offset": offsets}


def _shares(tok, ids: list[int]) -> list[str]:
    """Each token's share of the row's text: the characters it completes (a special token, or a byte token
    inside a character: none). They join to the row's text, SentencePiece's dropped first space included."""
    text = tok.decode(ids)
    done, pending = tok.char_ends(ids)
    cuts = [0] + done
    if pending and pending[-1]:  # the row ends inside a character: its U+FFFD goes to the last token
        cuts[-1] += 1
    return [text[a:b] for a, b in zip(cuts, cuts[1:])]


def _top(ctx, step: list[tuple[int, float]]) -> dict[str, float]:
    """Alternatives keyed by text (OpenAI's shape): of two tokens that decode alike, the likelier one."""
    out: dict[str, float] = {}
    for t, v in sorted(step, key=lambda tv: -tv[1]):
        out.setdefault(ctx.served.token_text(t), v)
    return out


def _prompts(prompt, vocab: int) -> list:
    """The request's prompts: texts, or token-id lists (each id below ``vocab``)."""
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(isinstance(t, int) for t in prompt):
        prompt = [prompt]
    if not prompt or any(len(p) == 0 for p in prompt):
        raise APIError(400, "prompt is empty: give a non-empty string, list of strings, or list of token ids", param="prompt")
    bad = next((t for p in prompt if not isinstance(p, str) for t in p if not 0 <= t < vocab), None)
    if bad is not None:
        raise APIError(400, f"prompt holds the token id {bad}, outside this model's vocabulary (0 to {vocab - 1})",
                       param="prompt")
    return [p if isinstance(p, str) else list(p) for p in prompt]


def register(app: FastAPI, ctx) -> None:
    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        ctx.owner(request)
        ctx.check_model(req.model)
        prompts = _prompts(req.prompt, len(ctx.model.tokenizer))
        texts = [p if isinstance(p, str) else ctx.model.tokenizer.decode(p) for p in prompts]
        k = req.logprobs
        sampling = Sampling(temperature=req.temperature, top_p=req.top_p, seed=req.seed, n=req.n, max_tokens=req.max_tokens,
                            stop=stops(req.stop), top_logprobs=req.logprobs)
        cid, created = new_id("cmpl"), int(time.time())

        def body(result: dict, echoed: list[dict] | None) -> dict:
            choices = []
            for i, row in enumerate(result["rows"]):
                prefix = texts[i // req.n] if req.echo else ""
                lps = None
                if k is not None:
                    lps = _logprobs(ctx, [echoed[i // req.n], row], 0) if echoed is not None else _logprobs(ctx, [row], 0)
                choices.append({"index": i, "text": prefix + row["text"], "logprobs": lps, "finish_reason": row["finish"]})
            return {"id": cid, "object": "text_completion", "created": created, "model": ctx.config.served_model_name,
                    "choices": choices, "usage": result["usage"], "system_fingerprint": None}

        def echo() -> list[dict] | None:
            return _echoed(ctx, prompts, k) if req.echo and k is not None else None

        if not req.stream:
            return body(*await ctx.run(lambda: (_run(ctx, prompts, sampling), echo()), reply=True))
        echoed = await ctx.run(echo)
        stream = ThreadStream(lambda emit, cancelled: _run(ctx, prompts, sampling, emit, cancelled))
        first = await stream.get()
        if first[0] == "error":
            raise from_exception(first[1])

        def chunk(choices: list, usage: Any = None) -> str:
            out = {"id": cid, "object": "text_completion", "created": created, "model": ctx.config.served_model_name,
                   "choices": choices, "system_fingerprint": None}
            if usage is not None:
                out["usage"] = usage
            return sse(out)

        async def events():
            sent = [""] * (len(prompts) * req.n)
            if req.echo:
                for i in range(len(sent)):
                    lps = _logprobs(ctx, [echoed[i // req.n]], 0) if echoed is not None else None
                    yield chunk([{"index": i, "text": texts[i // req.n], "logprobs": lps, "finish_reason": None}])
            async for kind, item in stream.items(first):
                if kind == "event":
                    r, text = item
                    sent[r] += text
                    yield chunk([{"index": r, "text": text, "logprobs": None, "finish_reason": None}])
                elif kind == "error":
                    if not isinstance(item, Cancelled):
                        yield sse(from_exception(item).body())
                    return
                else:
                    for i, row in enumerate(item["rows"]):
                        rest = row["text"][len(sent[i]):] if row["text"].startswith(sent[i]) else ""
                        lps = _logprobs(ctx, [row], 0) if req.logprobs is not None else None
                        yield chunk([{"index": i, "text": rest, "logprobs": lps, "finish_reason": row["finish"]}])
                    if req.stream_options and req.stream_options.include_usage:
                        yield chunk([], item["usage"])
                    yield DONE

        return StreamingResponse(events(), media_type="text/event-stream", headers=STREAM_HEADERS)
