"""``ChatStream``: a reply's text as it is generated (end-of-turn markers held back), then the new chat.

Kept apart from :mod:`continuum.chat` (the session logic): this module only turns the decoding
loop's steps into text chunks.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Sequence
from typing import Any

from ..generate.reasoning import step_texts

__all__ = ["ChatStream"]


def _held_back(text: str, markers: Sequence[str]) -> str:
    """``text`` without an end-of-turn marker and what follows it, nor a suffix that may start one."""
    for m in markers:
        at = text.find(m)
        if at >= 0:
            text = text[:at]
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), 0, -1):
            if text.endswith(m[:k]):
                return text[:-k]
    return text


class ChatStream:
    """Iterates the reply's text chunks (a ``str``, or a list over rows); then :attr:`chat` is the new chat.

    Beam search reorders its beams at every step, so it yields one chunk: the final replies.
    """

    def __init__(self, turn: Any, steps):
        self._turn, self._steps, self._chat = turn, steps, None
        self._beams = turn.generator.sampler.is_beam_search
        self._iter = type(self)._run(weakref.proxy(self))  # (no cycle: dropping the stream closes its loop at once)

    def __iter__(self) -> Iterator:
        return self

    def __next__(self):
        return next(self._iter)

    def _run(self):
        emitted: list[str] = []
        shape = lambda chunks: chunks[0] if len(chunks) == 1 else chunks  # noqa: E731
        while True:
            try:
                step = next(self._steps)
            except StopIteration as stop:
                self._chat = self._turn.finish(stop.value)
                break
            if self._beams or step.texts is None:
                continue
            safe = [_held_back(t, self._turn.markers) for t in step.texts]
            emitted = emitted if len(emitted) == len(safe) else [""] * len(safe)
            chunks = [s[len(e):] if s.startswith(e) else "" for s, e in zip(safe, emitted)]
            emitted = [e + c for e, c in zip(emitted, chunks)]
            if any(chunks):
                yield shape(chunks)
        final = step_texts(self._chat.state)  # (with reasoning: the thought, then the reply)
        emitted = emitted if len(emitted) == len(final) else [""] * len(final)
        rest = [f[len(e):] if f.startswith(e) else f for f, e in zip(final, emitted)]
        if self._beams or any(rest):
            yield shape(rest)

    @property
    def reasoning(self):
        """The reply's reasoning guide (markers, initial phase), None without reasoning."""
        return getattr(self._steps, "guide", None)

    def phases(self) -> list[str | None]:
        """Each row's reasoning phase as of the chunk just yielded (what splits a stream into thought and answer);
        empty without reasoning. Read with the chunk's text in the loop's thread, not from the guide, which the
        engine may have moved on since."""
        phases = getattr(self._steps, "phases", None)
        return phases() if phases is not None else []

    @property
    def chat(self) -> Any:
        """The chat with the reply (available once the stream is exhausted)."""
        if self._chat is None:
            raise RuntimeError("the stream is not finished yet: iterate over it first")
        return self._chat
