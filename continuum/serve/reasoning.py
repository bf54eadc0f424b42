"""Reasoning in the server: request fields -> a thought budget, and a streamed reply split into
``reasoning_content`` and ``content`` deltas (docs/reasoning.md, docs/serve.md).

``reasoning_effort`` (chat completions) and ``reasoning.effort`` (Responses) map to budgets:

=========  ===============================================
effort     thinking_budget
=========  ===============================================
none       no thought (the template's switch is turned off)
minimal    0 (the end marker at once)
low        256
medium     1024
high       none (bounded by ``max_tokens`` only)
=========  ===============================================

An explicit ``thinking_budget`` (an extension field) wins over the effort.

Example:
    >>> plan_reasoning(True, None, "low", None)
    (True, 256)
    >>> plan_reasoning(False, None, None, None)
    (None, None)
"""

from __future__ import annotations

from typing import Any

from ..guides.reasoning import ANSWER, OPEN, SEP, THINK
from .errors import APIError

__all__ = ["EFFORT_BUDGETS", "plan_reasoning", "Splitter"]

EFFORT_BUDGETS: dict[str, int | None] = {"minimal": 0, "low": 256, "medium": 1024, "high": None}


def plan_reasoning(default: bool, enable: bool | None, effort: str | None, budget: int | None) -> tuple[Any, int | None]:
    """``(reasoning, thinking_budget)`` of a request: ``reasoning`` None (not asked: the template's
    default), True (think) or False (no thought). ``enable``: ``chat_template_kwargs.enable_thinking``."""
    if effort is not None and effort != "none" and effort not in EFFORT_BUDGETS:
        raise APIError(400, f"reasoning effort must be one of {['none', *EFFORT_BUDGETS]}, got {effort!r}",
                       param="reasoning_effort")
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 0):
        raise APIError(400, f"thinking_budget must be an integer >= 0, got {budget!r}", param="thinking_budget")
    if effort == "none" or enable is False:
        return False, None
    asked = enable is True or effort is not None or budget is not None
    if not (asked or default):
        return None, None
    return True, budget if budget is not None else EFFORT_BUDGETS.get(effort or "high")


class Splitter:
    """One streamed row: raw text chunks (thought, then answer; special markers decode to nothing) and
    the row's phase after each chunk -> ``(reasoning delta, answer text so far)``.

    The thought ends where the phase leaves ``think``; the template's newlines after the end marker
    (``sep``) are neither. Reasoning is streamed with its leading and trailing newlines held back
    (a reply's ``reasoning_content`` is stripped as templates strip it), so the deltas add up to it.
    """

    def __init__(self, guide, tokenizer):
        m, (initial, pos) = guide.markers, guide.initial
        self.raw, self.sent = "", 0
        self.sep_text, self.end_text = tokenizer.decode(list(m.close_sep)), m.end_text
        self.special_end = tokenizer.decode(list(m.end)) == ""  # a special token decodes to nothing
        self.thought_end: int | None = 0 if initial in (SEP, ANSWER) else None
        # a prompt that ended with the marker (or inside its newlines): the rest of them come first
        self.answer_from = len(tokenizer.decode(list(m.close_sep[pos:]))) if initial == SEP else 0

    def feed(self, chunk: str, phase: str | None) -> tuple[str, str]:
        before = len(self.raw)
        self.raw += chunk
        if self.thought_end is None and phase not in (None, OPEN, THINK):
            # the thought closed in this chunk: a fast-forwarded run may hold the thought's last token, the
            # forced "\n", the marker, its newlines and a forced start of the answer (no blank line in it)
            if not self.special_end:  # a text marker: its text is in the chunk (or began earlier)
                at = self.raw.rfind(self.end_text)
                self.thought_end = at if at >= 0 else before
                self.answer_from = self.thought_end + len(self.end_text) + len(self.sep_text)
            else:
                at = self.raw.rfind(self.sep_text, before) if self.sep_text else -1
                self.thought_end = at if at >= 0 else len(self.raw)
                self.answer_from = self.thought_end + len(self.sep_text)
        if self.thought_end is None:
            thought = self._safe(self.raw)
        else:
            thought = self.raw[:self.thought_end].strip("\n")
        delta = thought[self.sent:] if len(thought) > self.sent else ""
        self.sent = max(self.sent, len(thought))
        answer = self.raw[self.answer_from:] if self.thought_end is not None else ""
        return delta, answer

    def _safe(self, text: str) -> str:
        """The thought so far that cannot change: leading newlines dropped, trailing ones (and a
        possible start of a text end marker) held back."""
        text = text.lstrip("\n")
        if not self.special_end:
            for k in range(min(len(self.end_text) - 1, len(text)), 0, -1):
                if text.endswith(self.end_text[:k]):
                    text = text[:-k]
                    break
        return text.rstrip("\n")
