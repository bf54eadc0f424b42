"""Rendering a chat with its template (the tokenizer's ``apply_chat_template``), and the end-of-turn marker.

Kept apart from :mod:`continuum.chat` (the session logic) so each module has one job: this one knows
how a template turns messages into a prompt and how a turn ends, nothing about states.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import ChatTemplateError

__all__ = ["Renderer"]

_SENTINEL = "\u2063CONTINUUM_END_OF_TURN_PROBE\u2063"


@dataclass(eq=False)
class Renderer:
    """How the chats derived from one ``Chat(...)`` render: the model's tokenizer, template, tools and
    template kwargs (the end-of-turn marker is read once and kept)."""

    model: Any
    template: str | None
    tools: list | None
    template_kwargs: dict
    reasoning: Any = None  # the chat's default for replies (continuum.chat.reasoning)
    keep_reasoning: bool = False
    thinking_budget: int | None = None
    _end: tuple[frozenset, tuple[str, ...]] | None = field(default=None, repr=False)

    def render(self, messages: Sequence[dict], *, tokenize: bool, generation: bool) -> Any:
        """``apply_chat_template`` of ``messages``: a prompt for a reply (``generation=True``:
        generation prompt, or continuing a final assistant message) or the history as it stands."""
        cont = generation and bool(messages) and messages[-1]["role"] == "assistant"
        if self.keep_reasoning:  # earlier thoughts written into the history (continuum.chat.reasoning)
            from .reasoning import history_for

            r = self.reasoning
            messages = history_for(messages, tuple(r) if isinstance(r, (tuple, list)) else ("<think>", "</think>"))
        try:
            return self.model.tokenizer.apply_chat_template(
                [dict(m) for m in messages], tools=self.tools, chat_template=self.template,
                add_generation_prompt=generation and not cont, continue_final_message=cont,
                tokenize=tokenize, **self.template_kwargs)
        except ChatTemplateError:
            raise
        except Exception as exc:  # jinja2.TemplateError (raise_exception), ValueError (continue_final_message)...
            raise ChatTemplateError(f"the chat template refused these messages: {exc} (roles: "
                                    f"{[m['role'] for m in messages]}); change the messages to what the template "
                                    f"accepts, or pass another template=") from exc

    def end_of_turn(self) -> tuple[frozenset, tuple[str, ...]]:
        """(token ids, texts) that end an assistant turn, read from a rendered sentinel reply."""
        if self._end is None:
            ids: frozenset[int] = frozenset()
            texts: tuple[str, ...] = ()
            probe = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": _SENTINEL}]
            try:
                rendered = self.render(probe, tokenize=False, generation=False)
            except ChatTemplateError:
                rendered = ""
            after = rendered.split(_SENTINEL, 1)[1] if _SENTINEL in rendered else ""
            marker = after.strip().split()[0] if after.strip() else ""
            if marker:
                tok = self.model.tokenizer
                first = tok.encode_special(marker)
                if len(first) == 1 and (first[0] in tok.special_ids or not tok.decode(first)):
                    ids = frozenset(first)  # a special token (<|im_end|>, <|eot_id|>, </s>): an extra EOS id
                else:
                    texts = (marker,)  # plain text (<end_of_turn> in a tokenizer without it): a stop string
            self._end = (ids, texts)
        return self._end
