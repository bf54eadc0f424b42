"""Reasoning in chats: which generator a reply runs, where its thought goes, how history renders.

A reply with reasoning records its thought as the assistant message's ``reasoning_content`` (the
field Qwen3's and DeepSeek's templates read). The history policy is an explicit choice:

* ``keep_reasoning=False`` (default): the template decides. Qwen3's drops the thoughts of earlier
  turns, so the next rendering differs from the state from the first dropped ``<think>`` on: the
  chat rewinds the state there (its cache kept up to that token) and computes the changed suffix
  once, deterministically (``chat.recomputed``).
* ``keep_reasoning=True``: every earlier thought stays in the rendered history, written into the
  message content as the model wrote it (``<think>\\n...\\n</think>\\n\\n`` + answer, with an empty
  ``reasoning_content`` so templates do not split it off again): the rendering extends the state,
  and a turn computes only the new messages and the reply (like Qwen's ``preserve_thinking``).

Example:
    >>> chat = Chat(model, reasoning=True, keep_reasoning=True)                       # doctest: +SKIP
    >>> chat = chat.user("2+2?").reply(generate.regex(model, r"[0-9]+"), thinking_budget=64)  # doctest: +SKIP
    >>> chat.messages[-1]["reasoning_content"], chat.value, chat.recomputed            # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..errors import ContinuumTypeError, ReasoningError

__all__ = ["template_kwargs_for", "history_for", "reply_generator", "with_thoughts", "check_chat_reasoning"]


def check_chat_reasoning(reasoning: Any, keep_reasoning: Any, thinking_budget: Any) -> None:
    from ..generate.reasoning import check_reasoning

    if reasoning is not None:
        check_reasoning(reasoning, thinking_budget)
    if not isinstance(keep_reasoning, bool):
        raise ContinuumTypeError(f"keep_reasoning must be True or False, got {keep_reasoning!r}")


def template_kwargs_for(template: str | None, tokenizer, kwargs: dict, reasoning: Any) -> dict:
    """The template kwargs with the template's thinking switch set from ``reasoning`` (when the
    template has one and the caller did not set it): ``enable_thinking`` for Qwen3 and SmolLM3."""
    text = template if template is not None else (tokenizer.chat_template or "")
    out = dict(kwargs)
    if reasoning is not None and isinstance(text, str) and "enable_thinking" in text:
        out.setdefault("enable_thinking", bool(reasoning))
    return out


def history_for(messages: Sequence[dict], markers: tuple[str, str] | None) -> list[dict]:
    """``keep_reasoning=True``: earlier assistant thoughts written into the content, as generated."""
    if markers is None:
        return [dict(m) for m in messages]
    start, end = markers
    out = []
    for i, m in enumerate(messages):
        thought = m.get("reasoning_content")
        if m["role"] == "assistant" and isinstance(thought, str) and thought and i < len(messages) - 1:
            m = {**m, "content": f"{start}\n{thought}\n{end}\n\n{m['content']}", "reasoning_content": ""}
        out.append(dict(m))
    return out


def reply_generator(generator, default: Any, reasoning: Any, thinking_budget: int | None, default_budget: int | None):
    """The generator a reply runs: ``generator`` with the reply's settings, else the chat's, else its own."""
    want = default if reasoning is None else reasoning
    if want is None and generator.markers is not None:
        want = generator.reasoning  # (the generator's own thought; a reply's budget still applies)
    if not want and thinking_budget is not None:
        raise ReasoningError("thinking_budget needs reasoning: pass reasoning=True to the reply (or the Chat, or the "
                             "generator)")
    if want is None:
        return generator
    if not want:
        return generator.with_reasoning(False) if generator.markers is not None else generator
    has = generator.markers is not None
    budget = thinking_budget if thinking_budget is not None else (generator.thinking_budget if has else default_budget)
    pair = generator.reasoning if want is True and has else want
    if has and pair == generator.reasoning and budget == generator.thinking_budget:
        return generator
    return generator.with_reasoning(pair, budget)


def with_thoughts(rows: tuple, state) -> tuple:
    """The chat rows with each reply's thought as ``reasoning_content`` (rows whose step thought)."""
    last = state._last_step()
    if last.thoughts is None:
        return rows
    from ..generate.reasoning import thought_texts

    out = []
    for msgs, thought in zip(rows, thought_texts(state)):
        out.append(msgs[:-1] + ({**msgs[-1], "reasoning_content": thought},))
    return tuple(out)
