"""``Completion``: the text a text generator returns, a ``str`` that also says why it ended."""

from __future__ import annotations

__all__ = ["Completion", "FINISH_REASONS"]

#: Why a row's generation step ended.
FINISH_REASONS = {
    "eos": "the model produced an end-of-sequence token",
    "stop": "a stop_at string was generated",
    "length": "max_tokens tokens were generated",
    "context": "the row reached the model's context length (truncated)",
    "pattern": "the constraint (choice, regex, JSON) completed",
}


class Completion(str):
    """A generated text. It *is* a ``str`` (compares, hashes, prints and serialises as one) and
    also carries :attr:`finish_reason` and :attr:`truncated`.

    Example:
        >>> c = Completion(" there was a", "context")
        >>> c == " there was a", c.finish_reason, c.truncated
        (True, 'context', True)
    """

    finish_reason: str

    def __new__(cls, text: str, finish_reason: str) -> Completion:
        obj = super().__new__(cls, text)
        obj.finish_reason = finish_reason
        return obj

    # pickling and copy; str's stub says a 1-tuple, but __new__ here takes (text, finish_reason)
    def __getnewargs__(self) -> tuple[str, str]:  # type: ignore[override]
        return (str(self), self.finish_reason)

    @property
    def truncated(self) -> bool:
        """True when generation was cut by the model's context length (not by ``max_tokens``)."""
        return self.finish_reason == "context"
