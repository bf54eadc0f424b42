"""``/v1/responses``: stateful conversations. A stored response keeps its ``SequenceState``.

``previous_response_id`` continues that state through ``Chat``: the stored conversation plus the new
input items are rendered, the stored state is reconciled with the rendering (its cache kept over
the longest common token prefix), and only the new messages and the reply are computed;
``usage.input_tokens_details.cached_tokens`` says how many input tokens were reused. Two responses
may continue the same one (a tree). ``instructions`` apply to one request only, as in OpenAI's API.
A response is stored (state file, then the SQLite row) before it is returned or ``response.completed``
is sent; ``store: false`` keeps nothing.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from .chat_completions import STREAM_HEADERS, check_plan
from .errors import APIError, from_exception, not_found
from .messages import new_id, text_of
from .reasoning import plan_reasoning
from .schemas import ResponsesRequest
from .served import Cancelled, Plan, Reply, Sampling
from .sse import ThreadStream, sse

__all__ = ["register"]


def _plan(req: ResponsesRequest) -> Plan:
    tools = [{"name": t.name, "description": t.description, "parameters": t.parameters} for t in req.tools or []]
    names = [t["name"] for t in tools]
    if len(set(names)) != len(names):
        raise APIError(400, f"tool names must be unique, got {names}", param="tools")
    choice = req.tool_choice
    if choice is not None and not isinstance(choice, str):
        if choice.name not in names:
            raise APIError(400, f"tool_choice names {choice.name!r}, which is not among the tools {names}", param="tool_choice")
        return Plan("tools", tools=tools, tool_choice=choice.name)
    if choice == "required" and not tools:
        raise APIError(400, "tool_choice 'required' needs tools", param="tool_choice")
    fmt = req.text.format if req.text is not None else None
    if fmt is None or fmt.type == "text":
        plan = Plan("text")
    elif fmt.type == "json_object":
        plan = Plan("json", schema={"type": "object"})
    elif fmt.schema_ is None:
        raise APIError(400, "text.format of type 'json_schema' needs a schema", param="text.format.schema")
    else:
        plan = Plan("json", schema=fmt.schema_, strict=bool(fmt.strict))
    if tools and choice != "none":  # in "auto", a reply that is not a call follows the format (serve/either.py)
        return Plan("tools", schema=plan.schema, strict=plan.strict, tools=tools, tool_choice=choice or "auto")
    return plan


def _input_messages(req: ResponsesRequest, previous: list[dict]) -> list[dict]:
    if isinstance(req.input, str):
        return [{"role": "user", "content": req.input}]
    names = {c["id"]: c["function"]["name"] for m in previous for c in m.get("tool_calls") or ()}
    out: list[dict] = []
    for i, item in enumerate(req.input):
        kind = item.type or ("message" if item.role is not None else None)
        where = f"input[{i}]"
        if kind == "message":
            if item.role is None:
                raise APIError(400, f"{where}: a message needs a role", param=f"{where}.role")
            out.append({"role": item.role, "content": text_of(item.content, where)})
        elif kind == "function_call_output":
            if item.call_id is None or item.output is None:
                raise APIError(400, f"{where}: a function_call_output needs call_id and output", param=where)
            msg = {"role": "tool", "content": item.output, "tool_call_id": item.call_id}
            if item.call_id in names:
                msg["name"] = names[item.call_id]
            out.append(msg)
        elif kind == "function_call":
            if item.call_id is None or item.name is None:
                raise APIError(400, f"{where}: a function_call needs call_id and name", param=where)
            names[item.call_id] = item.name
            out.append({"role": "assistant", "content": "", "tool_calls": [
                {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments or "{}"}}]})
        else:
            raise APIError(400, f"{where}: unsupported input item (use a message, function_call or function_call_output)",
                           param=where)
    if not out:
        raise APIError(400, "input is empty", param="input")
    return out


def _usage(reply: Reply) -> dict:
    out = reply.completion_tokens
    return {"input_tokens": reply.prompt_tokens, "input_tokens_details": {"cached_tokens": reply.cached_tokens},
            "output_tokens": out, "output_tokens_details": {"reasoning_tokens": reply.rows[0].reasoning_tokens},
            "total_tokens": reply.prompt_tokens + out}


def _message_item(mid: str, text: str, status: str) -> dict:
    return {"type": "message", "id": mid, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _output(reply: Reply, mid: str) -> list[dict]:
    row = reply.rows[0]
    items = []
    if row.reasoning is not None:  # the thought first, its text as a summary part
        items.append({"type": "reasoning", "id": new_id("rs"), "status": "completed",
                      "summary": [{"type": "summary_text", "text": row.reasoning}]})
    if row.content or not row.tool_calls:
        items.append(_message_item(mid, row.content, "completed" if row.finish_reason != "length" else "incomplete"))
    for c in row.tool_calls:
        items.append({"type": "function_call", "id": new_id("fc"), "call_id": c["id"], "name": c["name"],
                      "arguments": c["arguments"], "status": "completed"})
    return items


def _skeleton(ctx, req: ResponsesRequest, rid: str, created: int) -> dict:
    fmt = req.text.format.model_dump(by_alias=True, exclude_none=True) if req.text and req.text.format else {"type": "text"}
    tools = [{"type": "function", **t.model_dump(exclude_none=True, exclude={"type"})} for t in req.tools or []]
    choice: Any = req.tool_choice.model_dump() if req.tool_choice is not None and not isinstance(req.tool_choice, str) \
        else (req.tool_choice or "auto")
    return {"id": rid, "object": "response", "created_at": created, "status": "in_progress", "error": None,
            "incomplete_details": None, "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "model": ctx.config.served_model_name, "output": [], "parallel_tool_calls": False,
            "previous_response_id": req.previous_response_id, "store": req.store,
            "reasoning": {"effort": req.reasoning.effort, "summary": None} if req.reasoning is not None else None,
            "temperature": req.temperature if req.temperature is not None else 1.0,
            "top_p": req.top_p if req.top_p is not None else 1.0, "text": {"format": fmt}, "tool_choice": choice,
            "tools": tools, "truncation": "disabled", "usage": None, "metadata": req.metadata or {}}


def _final(skeleton: dict, reply: Reply, mid: str) -> dict:
    row = reply.rows[0]
    incomplete = row.finish_reason == "length"
    return {**skeleton, "status": "incomplete" if incomplete else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "output": _output(reply, mid), "usage": _usage(reply)}


def register(app: FastAPI, ctx) -> None:
    @app.post("/v1/responses")
    async def create_response(req: ResponsesRequest, request: Request):
        owner = ctx.owner(request)
        ctx.check_model(req.model)
        plan = _plan(req)
        plan.reasoning, plan.thinking_budget = plan_reasoning(ctx.served.reasoning, None,
                                                              req.reasoning.effort if req.reasoning else None,
                                                              req.thinking_budget)
        plan.soft_budget = req.thinking_budget is None
        sampling = Sampling(temperature=req.temperature, top_p=req.top_p, seed=req.seed, max_tokens=req.max_output_tokens)
        rid, mid, created = new_id("resp"), new_id("msg"), int(time.time())
        skeleton = _skeleton(ctx, req, rid, created)

        def build():
            check_plan(ctx, plan)
            previous, state = [], None
            if req.previous_response_id is not None:
                record = ctx.store.get(req.previous_response_id, owner)
                if record is None:
                    raise not_found("response", req.previous_response_id, "previous_response_id")
                previous, state = record.messages, ctx.store.state(record)
            conversation = previous + _input_messages(req, previous)
            system = [{"role": "system", "content": req.instructions}] if req.instructions else []
            chat = ctx.served.chat(system + conversation, plan.tools or None, state, reasoning=plan.reasoning)
            return chat, conversation, state

        def keep(reply: Reply, conversation: list, base) -> dict:
            body = _final(skeleton, reply, mid)
            if req.store:  # durable before anyone sees the response; only what ``base`` lacks is written
                row = reply.rows[0]
                ctx.store.put(rid, owner, body, conversation + [row.message()], row.chat.state,
                              parent=req.previous_response_id, base=base)
            return body

        chat, conversation, base = await ctx.run(build)
        if not req.stream:
            return await ctx.run(lambda: keep(ctx.served.reply(chat, plan, sampling), conversation, base), reply=True)

        def work(emit, cancelled):  # (with reasoning, the items are sent whole at the end: the thought comes first)
            live = None if plan.reasoning else (lambda r, t: emit(t))
            reply = ctx.served.reply(chat, plan, sampling, on_delta=live, cancelled=cancelled)
            return keep(reply, conversation, base)

        stream = ThreadStream(work)
        first = await stream.get()
        if first[0] == "error":
            raise from_exception(first[1])
        return StreamingResponse(_events(skeleton, mid, stream, first, plan), media_type="text/event-stream",
                                 headers=STREAM_HEADERS)

    @app.get("/v1/responses/{rid}")
    async def get_response(rid: str, request: Request):
        owner = ctx.owner(request)
        record = await ctx.run(lambda: ctx.store.get(rid, owner))
        if record is None:
            raise not_found("response", rid)
        return record.body

    @app.delete("/v1/responses/{rid}")
    async def delete_response(rid: str, request: Request):
        owner = ctx.owner(request)
        if not await ctx.run(lambda: ctx.store.delete(rid, owner)):
            raise not_found("response", rid)
        return {"id": rid, "object": "response.deleted", "deleted": True}


async def _events(skeleton: dict, mid: str, stream: ThreadStream, first, plan: Plan):
    seq = 0

    def event(kind: str, **fields) -> str:
        nonlocal seq
        seq += 1
        return sse({"type": kind, "sequence_number": seq - 1, **fields}, event=kind)

    yield event("response.created", response=skeleton)
    yield event("response.in_progress", response=skeleton)
    text_item = plan.mode != "tools" and not plan.reasoning  # text and JSON replies stream into one message item
    sent = ""
    if text_item:
        yield event("response.output_item.added", output_index=0, item={**_message_item(mid, "", "in_progress"), "content": []})
        yield event("response.content_part.added", item_id=mid, output_index=0, content_index=0,
                    part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})
    body: dict | None = None
    async for kind, item in stream.items(first):
        if kind == "event":
            sent += item
            yield event("response.output_text.delta", item_id=mid, output_index=0, content_index=0, delta=item, logprobs=[])
        elif kind == "error":
            if not isinstance(item, Cancelled):
                err = from_exception(item).body()["error"]
                yield event("error", code=err["code"], message=err["message"], param=err["param"])
                yield event("response.failed", response={**skeleton, "status": "failed", "error": {
                    "code": "server_error", "message": err["message"]}})
            return
        else:
            body = item
    assert body is not None
    for index, out in enumerate(body["output"]):
        if out["type"] == "message":
            text = out["content"][0]["text"]
            if not text_item or index > 0:
                yield event("response.output_item.added", output_index=index,
                            item={**out, "status": "in_progress", "content": []})
                yield event("response.content_part.added", item_id=out["id"], output_index=index, content_index=0,
                            part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})
                sent = ""
            rest = text[len(sent):] if text.startswith(sent) else ""
            if rest:
                yield event("response.output_text.delta", item_id=out["id"], output_index=index, content_index=0, delta=rest,
                            logprobs=[])
            yield event("response.output_text.done", item_id=out["id"], output_index=index, content_index=0, text=text,
                        logprobs=[])
            yield event("response.content_part.done", item_id=out["id"], output_index=index, content_index=0,
                        part=out["content"][0])
        elif out["type"] == "reasoning":
            text = out["summary"][0]["text"]
            yield event("response.output_item.added", output_index=index, item={**out, "summary": [], "status": "in_progress"})
            yield event("response.reasoning_summary_part.added", item_id=out["id"], output_index=index, summary_index=0,
                        part={"type": "summary_text", "text": ""})
            yield event("response.reasoning_summary_text.delta", item_id=out["id"], output_index=index, summary_index=0,
                        delta=text)
            yield event("response.reasoning_summary_text.done", item_id=out["id"], output_index=index, summary_index=0,
                        text=text)
            yield event("response.reasoning_summary_part.done", item_id=out["id"], output_index=index, summary_index=0,
                        part=out["summary"][0])
        else:
            yield event("response.output_item.added", output_index=index, item={**out, "arguments": "", "status": "in_progress"})
            yield event("response.function_call_arguments.delta", item_id=out["id"], output_index=index, delta=out["arguments"])
            yield event("response.function_call_arguments.done", item_id=out["id"], output_index=index,
                        arguments=out["arguments"], name=out["name"])
        yield event("response.output_item.done", output_index=index, item=out)
    yield event("response.completed", response=body)  # also when incomplete: the openai client's stream helper waits for it
