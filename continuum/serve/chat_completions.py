"""``POST /v1/chat/completions``: stateless chat (the whole conversation in every request).

Nothing is stored: each request renders its messages with the chat template and replies. Shared
prefixes are reused across requests only by the model's prefix cache (``--prefix-cache``), which
``usage.prompt_tokens_details.cached_tokens`` does not count; a conversation that wants its state
kept exactly uses ``/v1/responses`` with ``previous_response_id``.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from .errors import APIError, from_exception
from .messages import chat_messages, new_id, tool_call_schema
from .reasoning import plan_reasoning
from .schemas import ChatCompletionRequest
from .served import Cancelled, Plan, Reply, Sampling
from .sse import DONE, ThreadStream, sse

__all__ = ["STREAM_HEADERS", "logprob_entries", "register", "stops"]

STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def stops(stop) -> list[str]:
    out = [stop] if isinstance(stop, str) else list(stop or [])
    if any(not s for s in out):
        raise APIError(400, "stop strings must be non-empty", param="stop")
    if len(out) > 4:
        raise APIError(400, f"at most 4 stop strings, got {len(out)}", param="stop")
    return out


def _plan(req: ChatCompletionRequest) -> Plan:
    tools = [{"name": t.function.name, "description": t.function.description, "parameters": t.function.parameters}
             for t in req.tools or []]
    names = [t["name"] for t in tools]
    if len(set(names)) != len(names):
        raise APIError(400, f"tool names must be unique, got {names}", param="tools")
    choice = req.tool_choice
    if choice is not None and not isinstance(choice, str):
        if choice.function.name not in names:
            raise APIError(400, f"tool_choice names {choice.function.name!r}, which is not among the tools {names}",
                           param="tool_choice")
        return Plan("tools", tools=tools, tool_choice=choice.function.name)
    if choice == "required" and not tools:
        raise APIError(400, "tool_choice 'required' needs tools", param="tool_choice")
    fmt = req.response_format
    if fmt is None or fmt.type == "text":
        plan = Plan("text")
    elif fmt.type == "json_object":
        plan = Plan("json", schema={"type": "object"})
    elif fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise APIError(400, "response_format of type 'json_schema' needs json_schema.schema", param="response_format.json_schema")
    else:
        plan = Plan("json", schema=fmt.json_schema.schema_, strict=bool(fmt.json_schema.strict))
    if tools and choice != "none":  # in "auto", a reply that is not a call follows the format (serve/either.py)
        return Plan("tools", schema=plan.schema, strict=plan.strict, tools=tools, tool_choice=choice or "auto")
    return plan


def check_plan(ctx, plan: Plan) -> None:
    """Compile the schemas now, so a refused schema is a 400 (with the engine's reason) before any streaming."""
    if plan.schema is not None and (plan.mode == "json" or plan.tool_choice == "auto"):
        ctx.served.check_schema(plan.schema, plan.strict)
    if plan.mode == "tools":
        for t in plan.tools:
            if t["parameters"] is not None:
                ctx.served.check_schema(t["parameters"], True)
        # the envelope the calls are generated under (each tool's parameters embedded, their references rewritten)
        only = None if plan.tool_choice in ("auto", "required") else plan.tool_choice
        ctx.served.call_generator(tool_call_schema(plan.tools, only), Sampling(temperature=0), False, None)
        if only is None and plan.tool_choice == "auto" and plan.schema is not None:  # the call-or-answer grammar
            ctx.served.either(plan, Sampling(temperature=0), False)


def logprob_entries(engine, row) -> list[dict]:
    out = []
    for i, (tok, lp) in enumerate(zip(row.tokens, row.logprobs)):
        text = engine.token_text(tok)
        top = [{"token": engine.token_text(t), "logprob": v, "bytes": engine.token_bytes(t)}
               for t, v in (row.top[i] if row.top is not None and i < len(row.top) else [])]
        out.append({"token": text, "logprob": lp, "bytes": engine.token_bytes(tok), "top_logprobs": top})
    return out


def _usage(reply: Reply) -> dict:
    return {"prompt_tokens": reply.prompt_tokens, "completion_tokens": reply.completion_tokens,
            "total_tokens": reply.prompt_tokens + reply.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": reply.cached_tokens},
            "completion_tokens_details": {"reasoning_tokens": sum(r.reasoning_tokens for r in reply.rows),
                                          **reply.predictions}}


def _tool_calls(row) -> list[dict]:
    return [{"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
            for c in row.tool_calls]


def _body(ctx, req: ChatCompletionRequest, cid: str, created: int, reply: Reply) -> dict:
    choices = []
    for i, row in enumerate(reply.rows):
        message: dict[str, Any] = {"role": "assistant", "content": row.content if not row.tool_calls else (row.content or None),
                                   "refusal": None}
        if row.tool_calls:
            message["tool_calls"] = _tool_calls(row)
        if row.reasoning is not None:  # (vLLM's and DeepSeek's field)
            message["reasoning_content"] = row.reasoning
        lps = {"content": logprob_entries(ctx.served, row), "refusal": None} if req.logprobs else None
        choices.append({"index": i, "message": message, "logprobs": lps, "finish_reason": row.finish_reason})
    return {"id": cid, "object": "chat.completion", "created": created, "model": ctx.config.served_model_name,
            "choices": choices, "usage": _usage(reply), "system_fingerprint": None}


def register(app: FastAPI, ctx) -> None:
    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        ctx.owner(request)
        ctx.check_model(req.model)
        plan = _plan(req)
        enable = (req.chat_template_kwargs or {}).get("enable_thinking")
        plan.reasoning, plan.thinking_budget = plan_reasoning(ctx.served.reasoning, enable if isinstance(enable, bool) else None,
                                                              req.reasoning_effort, req.thinking_budget)
        plan.soft_budget = req.thinking_budget is None
        if req.top_logprobs and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        sampling = Sampling(temperature=req.temperature, top_p=req.top_p, seed=req.seed, n=req.n, max_tokens=max_tokens,
                            stop=stops(req.stop), top_logprobs=(req.top_logprobs or 0) if req.logprobs else None)
        messages = chat_messages(req.messages)
        tools = plan.tools or None
        cid, created = new_id("chatcmpl"), int(time.time())

        def build():
            check_plan(ctx, plan)
            return ctx.served.chat(messages, tools, template_kwargs=req.chat_template_kwargs, reasoning=plan.reasoning)

        chat = await ctx.run(build)
        if not req.stream:
            reply = await ctx.run(lambda: ctx.served.reply(chat, plan, sampling), reply=True)
            return _body(ctx, req, cid, created, reply)

        def work(emit, cancelled):
            return ctx.served.reply(chat, plan, sampling, on_delta=lambda r, t: emit((r, t)), cancelled=cancelled,
                                    on_reasoning=lambda r, t: emit((r, t, "reasoning")))

        stream = ThreadStream(work)
        first = await stream.get()
        if first[0] == "error":
            raise from_exception(first[1])
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(_events(ctx, req, cid, created, stream, first, include_usage),
                                 media_type="text/event-stream", headers=STREAM_HEADERS)


def _chunk(ctx, cid: str, created: int, choices: list, usage: dict | None = None) -> str:
    body: dict[str, Any] = {"id": cid, "object": "chat.completion.chunk", "created": created,
                            "model": ctx.config.served_model_name, "choices": choices, "system_fingerprint": None}
    if usage is not None:
        body["usage"] = usage
    return sse(body)


async def _events(ctx, req, cid, created, stream: ThreadStream, first, include_usage: bool):
    sent, thought = [""] * req.n, [""] * req.n
    for i in range(req.n):
        yield _chunk(ctx, cid, created, [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                          "finish_reason": None}])
    async for kind, item in stream.items(first):
        if kind == "event" and len(item) == 3:  # the thought, streamed before the answer
            r, text, _ = item
            thought[r] += text
            yield _chunk(ctx, cid, created, [{"index": r, "delta": {"reasoning_content": text}, "logprobs": None,
                                              "finish_reason": None}])
        elif kind == "event":
            r, text = item
            sent[r] += text
            yield _chunk(ctx, cid, created, [{"index": r, "delta": {"content": text}, "logprobs": None, "finish_reason": None}])
        elif kind == "error":
            if not isinstance(item, Cancelled):
                yield sse(from_exception(item).body())
            return
        else:
            reply: Reply = item
            for i, row in enumerate(reply.rows):
                delta: dict[str, Any] = {}
                if row.reasoning and row.reasoning.startswith(thought[i]) and len(row.reasoning) > len(thought[i]):
                    delta["reasoning_content"] = row.reasoning[len(thought[i]):]
                if row.tool_calls:
                    delta["tool_calls"] = [{"index": k, **c} for k, c in enumerate(_tool_calls(row))]
                rest = row.content[len(sent[i]):] if row.content.startswith(sent[i]) else ""
                if rest:
                    delta["content"] = rest
                lps = {"content": logprob_entries(ctx.served, row), "refusal": None} if req.logprobs else None
                choice = {"index": i, "delta": delta, "logprobs": lps, "finish_reason": row.finish_reason}
                yield _chunk(ctx, cid, created, [choice])
            if include_usage:
                yield _chunk(ctx, cid, created, [], _usage(reply))
            yield DONE
