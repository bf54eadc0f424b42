"""A re-rendered history keeps the model's own tokens for its replies ("template-exact").

A chat's state holds the tokens the model generated for its replies; the next turn re-renders the
history with the template and tokenizes it canonically. The reply's TEXT comes back unchanged, but a
constrained or sampled reply is often not in its canonical split (JSON chosen under a grammar, a
sampled rare merge), so a token-level diff would cut the state at the first differing token of the
reply and recompute the reply and everything after it.

:func:`own_tokens` gives the prompt to continue instead: the canonical rendering, except that each
reply of the state whose text lies unchanged at the same place of the rendering (its end on a token
boundary of the rendering) keeps the model's tokens. Everything outside the model's replies is the
template's rendering, token for token; a reply the template changed (a thought dropped, a content
stripped) or whose bytes are not valid UTF-8 (its text holds U+FFFD) falls back to the canonical
tokens from there on. A reply is a maximal run of tokens with a
log-prob in the state (prompt and appended tokens have NaN).

Example (token ids as a byte-level BPE may split them; ``lps`` NaN outside the reply)::

    state:      <|im_start|>assistant\\n  {"  a  ":  1  }           (the model's split, generated)
    rendering:  <|im_start|>assistant\\n  {"a":  1  }  <|im_end|> ...  (canonical split)
    own_tokens: <|im_start|>assistant\\n  {"  a  ":  1  }  <|im_end|> ...  (the state's reply, then the rendering)
"""

from __future__ import annotations

from collections.abc import Sequence

from ..models.seqprefix import common_prefix

__all__ = ["own_tokens", "common_prefix"]

_WINDOW = 8  # tokens around the binary search's answer (enough for any one character)


def _boundary(decode, prompt: Sequence[int], lo: int, text: str) -> int | None:
    """The ``m >= lo`` with ``decode(prompt[:m]) == text`` (the smallest), or None: a binary search on the
    decoded length, then a check of the candidates around it (an incomplete UTF-8 character decodes longer)."""
    a, b = lo, len(prompt)
    while a < b:  # the smallest m whose decoded prefix is at least as long as text
        mid = (a + b) // 2
        if len(decode(prompt[:mid])) < len(text):
            a = mid + 1
        else:
            b = mid
    for m in range(max(lo, a - _WINDOW), min(len(prompt), a + _WINDOW) + 1):
        if decode(prompt[:m]) == text:
            return m
    return None


def own_tokens(tokenizer, ids: Sequence[int], lps: Sequence[float], prompt: Sequence[int]) -> list[int]:
    """``prompt`` (a canonical rendering) with the state's own tokens for every reply it renders unchanged.

    ``ids``/``lps``: a state row's tokens and log-probs (NaN for tokens that were not generated). The
    result is ``ids[:k] + prompt[j:]`` with ``ids[:k]`` and ``prompt[:j]`` the same text (special tokens
    included), ``k`` as large as the replies allow: it shares the state's tokens (and cache) up to ``k``.
    """
    p = common_prefix(ids, prompt)
    k, j = p, p
    text: str | None = None

    def decode(t: Sequence[int]) -> str:
        return tokenizer.decode(list(t), skip_special=False)

    if k < len(ids) and j < len(prompt) and lps[k] == lps[k]:
        try:
            decode([])
        except TypeError:  # a tokenizer that cannot show its special tokens' text: no exact comparison, canonical
            return list(prompt)
    while k < len(ids) and j < len(prompt) and lps[k] == lps[k]:  # the diff starts inside a reply
        end = k
        while end < len(ids) and lps[end] == lps[end]:
            end += 1
        if text is None:
            text = decode(prompt)
        upto = decode(ids[:end])  # the history up to the reply's end, as the model wrote it
        if not text.startswith(upto) or "\ufffd" in upto[len(decode(ids[:k])):]:
            # the template changed the reply (or what precedes it), or the reply's bytes are not valid UTF-8 (its
            # text holds U+FFFD, whose bytes differ from the model's): canonical from here
            break
        j2 = _boundary(decode, prompt, j, upto)
        if j2 is None:
            break  # the reply's end is inside a token of the rendering: no exact split point
        q = common_prefix(ids[end:], prompt[j2:])
        k, j = end + q, j2 + q
    return list(prompt) if k == p else list(ids[:k]) + list(prompt[j:])
