"""HTML views of states and chats for notebooks: ``SequenceState._repr_html_``, ``state.to_html()``
and :func:`chat_to_html`.

What a row shows: one span per token. Prompt and added tokens are plain; generated tokens are
shaded by their probability ``exp(log-prob)`` (red = unlikely, green = likely); tokens a constraint
forced (fast-forward) are underlined in blue, a healed token has a dashed orange outline. A blue bar
marks where the KV cache ends, red bars where the last generation step starts and ends. Every token
has a tooltip: its index, id, text with whitespace made visible, and log-prob. Rows are laid out
batch x samples (samples side by side; beams in rank order, best first, as the state stores them),
each under a header with its weight and finish reason. Long rows show their first and last
:data:`HEAD`/:data:`TAIL` tokens around a count of the rest, so a 10,000-token state renders in
milliseconds and stays small.

Safety: every piece of text (model output, prompts, messages) is HTML-escaped, and the output is
pure ASCII (other characters are numeric references), with inline styles only: no script, no
external resource, the same in Jupyter, VS Code, Colab or a saved file.
"""

from __future__ import annotations

import bisect
import html
import json
import math
from collections.abc import Sequence

from .errors import BatchMismatch, ContinuumTypeError
from .state.text import token_char_spans

__all__ = ["state_to_html", "chat_to_html", "HEAD", "TAIL", "MAX_ROWS"]

HEAD, TAIL = 160, 160  # tokens shown at the start and at the end of a long row
MAX_ROWS = 64  # rows drawn at most; the rest are counted
_CONTEXT = 8  # tokens decoded before a window, so its first token decodes as it does in the row

_BOX = ("font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;font-size:12px;line-height:1.7;"
        "color:#1a1a1a;background:#fff;border:1px solid #d0d7de;border-radius:6px;padding:8px;margin:4px 0;max-width:100%")
_HEAD = "font-family:system-ui,-apple-system,Segoe UI,sans-serif;font-size:12px;color:#444;margin:2px 0"
_TEXT = "white-space:pre-wrap;word-break:break-word;overflow-wrap:anywhere"
_FORCED = "border-bottom:2px solid #1f5fd1;"
_HEALED = "outline:1px dashed #c25400;outline-offset:-1px;"
_SPECIAL = "color:#8a8a8a;font-size:10px;"
_SLIVER = "display:inline-block;min-width:3px;height:1.1em;vertical-align:text-bottom;"
_GAP = "background:#eceff3;color:#555;border-radius:3px;padding:0 5px;font-style:italic;white-space:nowrap"
_ROLES = {"system": "#6e7781", "user": "#1f5fd1", "assistant": "#1a7f37", "tool": "#8250df"}
_VISIBLE = str.maketrans({" ": "\u2423", "\n": "\u21b5", "\t": "\u21e5", "\r": "\u240d"})


def _esc(text: str) -> str:
    return html.escape(text, quote=True)


def _bar(color: str, title: str) -> str:
    return (f'<span title="{_esc(title)}" style="display:inline-block;width:0;height:1.25em;vertical-align:text-bottom;'
            f'border-left:2px solid {color};margin:0 1px"></span>')


def _shade(lp: float) -> str:
    """Background of a generated token: hue from red (p = 0) to green (p = 1)."""
    p = math.exp(lp) if lp > -700 else 0.0
    return f"background:hsl({round(120 * p)},75%,{84 - round(8 * p)}%);"


# ---------------------------------------------------------------------------------------------- tokens
class _Row:
    """One row's tokens, texts and the character layout of the windows shown (decoded lazily, per window)."""

    def __init__(self, state, r: int):
        self.tok = state._model.tokenizer
        self.ids, self.lps = state._real_rows()[r]
        self.text = state.texts[r]
        self._data: bytes | None = None

    def char_to_token(self, char: int) -> int:
        """The first token whose bytes reach past character ``char`` (via byte offsets: nothing decoded)."""
        if self._data is None:
            self._data = self.text.encode("utf-8", "surrogatepass")
            self._offs = self.tok.byte_offsets(self.ids)
            self._shift = (self._offs[-1] - len(self._data)) if self.ids else 0
        nbytes = len(self.text[:char].encode("utf-8", "surrogatepass")) + self._shift
        return min(bisect.bisect_right(self._offs, nbytes), len(self.ids))

    def window(self, lo: int, hi: int) -> list[tuple[int, int, str]]:
        """``(start, end, text)`` of tokens ``lo:hi``; start/end are chars of the row's text (-1 if unknown).

        The texts partition the window's decoded text (a character split over tokens goes to the first).
        """
        c0 = max(0, lo - _CONTEXT)
        part = self.ids[c0:hi]
        wtext = self.tok.decode(part)
        spans = token_char_spans(self.tok, part) if part else []
        base: int | None  # None: the window's text was not found in the row's
        if hi == len(self.ids) and self.text.endswith(wtext):  # a window that ends the row: exact
            base = len(self.text) - len(wtext)
        else:
            base = self._locate(c0, wtext)
        out, prev = [], spans[lo - c0][0] if hi > lo else 0
        for a, b in spans[lo - c0:]:
            a = max(a, prev)
            b = max(b, a)
            prev = b
            out.append((base + a if base is not None else -1, base + b if base is not None else -1, wtext[a:b]))
        return out

    def _locate(self, c0: int, wtext: str) -> int | None:
        """Where the text decoded from token ``c0`` on starts in the row's text (``None``: not found)."""
        probe = wtext.rstrip("\ufffd")
        if c0 == 0:
            return 0 if self.text.startswith(probe) else None
        guess = self._char_of_token(c0)  # exact unless the text holds U+FFFD (bytes that decode to none)
        for cand in (guess, guess + 1, guess - 1):  # SentencePiece drops a window's leading space
            if cand >= 0 and self.text.startswith(probe, cand):
                return cand
        found = self.text.find(probe, max(0, guess - 32))
        return found if found >= 0 and abs(found - guess) <= 32 else None

    def _char_of_token(self, k: int) -> int:
        self.char_to_token(0)  # sets the byte offsets
        assert self._data is not None  # set by char_to_token
        nbytes = max(self._offs[k - 1] - self._shift, 0)
        return len(self._data[:nbytes].decode("utf-8", "ignore"))


def _windows(lo: int, hi: int, head: int, tail: int) -> list[tuple[int, int]]:
    return [(lo, hi)] if hi - lo <= head + tail else [(lo, lo + head), (hi - tail, hi)]


def _tooltip(k: int, tid: int, text: str, lp: float, kind: str, cached: bool) -> str:
    lines = [f"token {k} · id {tid} · {json.dumps(text.translate(_VISIBLE), ensure_ascii=False)}"]
    lines.append("prompt or added text" if lp != lp else f"log-prob {lp:.3f} (p = {math.exp(lp):.3f})")
    if kind == "forced":
        lines.append("forced by the constraint (fast-forward)")
    elif kind == "healed":
        lines.append("healed: re-covers the prompt's removed last token")
    if cached:
        lines.append("in the KV cache")
    return "\n".join(lines)


def _tokens_html(row: _Row, lo: int, hi: int, *, cached: int = 0, marks=(), bars: Sequence[tuple[int, str, str]] = (),
                 clip: tuple[int, int] | None = None, head: int = HEAD, tail: int = TAIL) -> str:
    """Spans of tokens ``lo:hi``, elided in the middle when long.

    ``marks``: absolute ``(start, end, kind)`` char spans (forced/healed tokens); ``bars``:
    ``(char, color, title)`` boundaries drawn before the first token at or after ``char`` (a bar in
    the elided middle is named in the gap instead); ``clip``: show only these characters.
    """
    out: list[str] = []
    windows = _windows(lo, hi, head, tail)
    pending = sorted(bars, key=lambda b: b[0])
    for w, (wlo, whi) in enumerate(windows):
        toks = row.window(wlo, whi)
        if w:
            first = toks[0][0] if toks else -1
            inside = [t for c, _, t in pending if first < 0 or c < first]
            if windows[0][1] < cached <= wlo:
                inside.append(f"the KV cache ends after token {cached - 1}")
            pending = [b for b in pending if not (first < 0 or b[0] < first)]
            note = "; ".join(inside)
            out.append(f'<span style="{_GAP}" title="{_esc(note)}">\u22ef {wlo - windows[0][1]:,} tokens not shown'
                       f'{" (" + _esc(note) + ")" if note else ""} \u22ef</span>')
        for k, (a, b, text) in zip(range(wlo, whi), toks):
            while pending and a >= 0 and (pending[0][0] < b or pending[0][0] <= a):
                _, color, title = pending.pop(0)
                out.append(_bar(color, title))
            if clip is not None:
                if a < 0 or b <= clip[0] or a >= clip[1]:
                    continue
                text = text[max(clip[0] - a, 0):len(text) - max(b - clip[1], 0)]
            tid, lp = row.ids[k], row.lps[k]
            kind = next((m for s, e, m in marks if a >= 0 and s <= a and b <= e), "")
            tip = _esc(_tooltip(k, tid, text, lp, kind, k < cached))
            style = ("" if lp != lp else _shade(lp)) + (_FORCED if kind == "forced" else _HEALED if kind == "healed" else "")
            if text:
                out.append(f'<span data-tok="{k}" title="{tip}"' + (f' style="{style}"' if style else "")
                           + f">{_esc(text)}</span>")
            elif tid in row.tok.special_ids:  # BOS...: decodes to nothing; its name, outside the row's text
                name = row.tok.token_name(tid)
                out.append(f'<span data-special="{k}" title="{tip}" style="{_SPECIAL}{style}">{_esc(str(name))}</span>')
            else:  # the rest of a character another token began: a sliver with the token's shade
                out.append(f'<span data-tok="{k}" title="{tip}" style="{_SLIVER}{style}"></span>')
            if k + 1 == cached and cached < len(row.ids):
                out.append(_bar("#1f5fd1", f"KV cache: the {cached} tokens before this bar are cached"))
    for _, color, title in pending:  # boundaries at the very end of the row
        out.append(_bar(color, title))
    return "".join(out)


# ---------------------------------------------------------------------------------------------- states
def _row_header(state, r: int, label: str) -> str:
    ids, lps = state._real_rows()[r]
    gen = sum(1 for x in lps if x == x)
    cached = state._cached_real()[r]
    parts = [f"<b>{_esc(label)}</b>", f"weight {float(state._weights[r]):.3f}",
             f"{len(ids)} tokens ({gen} generated, {cached} cached)"]
    last = state._last
    if last is not None:
        finish = last.finish[r] if last.finish is not None else None
        if finish:
            parts.append(f"finish: {_esc(finish)}")
        if last.kind != "text":
            parts.append(_esc(last.kind) + (" complete" if last.complete[r] else
                                             ' <span style="color:#b00020">incomplete</span>'))
    return f'<div style="{_HEAD}">' + " · ".join(parts) + "</div>"


def _row_html(state, r: int, label: str) -> str:
    row = _Row(state, r)
    cached = state._cached_real()[r]
    bars, last = [], state._last
    marks: Sequence[tuple[int, int, str]] = ()
    if last is not None:
        s, e = last.starts[r], last.ends[r]
        bars.append((s, "#d1242f", f"last {last.kind} step starts here, at character {s}"))
        if e < len(row.text):
            bars.append((e, "#d1242f", f"last {last.kind} step ends here, at character {e}"))
        if last.marks is not None:
            marks = [(s + a, s + b, k) for a, b, k in last.marks[r]]
    body = _tokens_html(row, 0, len(row.ids), cached=cached, marks=marks, bars=bars)
    return (f'<div data-row="{r}" style="flex:1 1 320px;min-width:0;border-top:1px solid #e5e8eb;padding-top:4px">'
            f'{_row_header(state, r, label)}<div style="{_TEXT}">{body}</div></div>')


def _legend(bars: bool = True) -> str:
    ramp = "".join(f'<span style="{_shade(math.log(p))}padding:0 3px">{p:g}</span>' for p in (0.01, 0.25, 0.5, 0.75, 1))
    marks = (f'{_bar("#1f5fd1", "KV cache boundary")} cache ends · {_bar("#d1242f", "last step boundary")} last step · '
             if bars else "")
    return (f'<div style="{_HEAD};color:#666">{"prompt/added text plain · " if bars else ""}generated, shaded by '
            f'probability {ramp} · <span style="{_FORCED}">forced</span> · <span style="{_HEALED}padding:0 2px">healed'
            f"</span> · {marks}hover a token for its id and log-prob</div>")


def _ascii(markup: str) -> str:
    """Pure ASCII (other characters as numeric references): right whatever encoding a viewer assumes."""
    return markup.encode("ascii", "xmlcharrefreplace").decode("ascii")


def state_to_html(state) -> str:
    """An HTML fragment drawing ``state`` (see the module docstring); what ``state._repr_html_()`` returns.

    Example:
        >>> Path("state.html").write_text(state.to_html())  # doctest: +SKIP
    """
    shown = min(state.rows, MAX_ROWS)
    title = (f"SequenceState · batch {state.batch} × samples {state.samples}"
             + (f" · last step: {_esc(state._last.kind)}" if state._last is not None else ""))
    parts = [f'<div style="{_BOX}"><div style="{_HEAD}"><b>{title}</b></div>', _legend()]
    for b in range(state.batch):
        rows = [r for r in range(b * state.samples, (b + 1) * state.samples) if r < shown]
        if not rows:
            break
        parts.append(f'<div data-batch="{b}" style="margin-top:6px">')
        if state.samples > 1:
            parts.append(f'<div style="{_HEAD}"><b>batch {b}</b></div>')
        parts.append('<div style="display:flex;flex-wrap:wrap;gap:10px">')
        for r in rows:
            s = r - b * state.samples
            label = f"sample {s}" if state.samples > 1 else (f"batch {b}" if state.batch > 1 else "row 0")
            parts.append(_row_html(state, r, label))
        parts.append("</div></div>")
    if shown < state.rows:
        parts.append(f'<div style="{_HEAD}">\u22ef {state.rows - shown} more rows not shown (select them: state[b, s, :])</div>')
    parts.append("</div>")
    return _ascii("".join(parts))


# ---------------------------------------------------------------------------------------------- chats
def _conversations(messages) -> list[list[dict]]:
    hint = "chat_to_html takes a list of message dicts ({'role': ..., 'content': ...}) or a list of such lists"
    if not isinstance(messages, (list, tuple)):
        raise ContinuumTypeError(f"{hint}; got a {type(messages).__name__}")
    convs = [list(messages)] if not messages or isinstance(messages[0], dict) else [list(c) for c in messages]
    for c in convs:
        bad = next((m for m in c if not isinstance(m, dict) or "role" not in m), None)
        if bad is not None:
            raise ContinuumTypeError(f"{hint}; found an item {type(bad).__name__} without a 'role'")
    return convs


def _content_text(message: dict) -> str:
    content = message.get("content")
    if isinstance(content, list):  # content parts ({"type": "text", "text": ...})
        content = "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    text = "" if content is None else str(content)
    if message.get("tool_calls"):
        text += ("\n" if text else "") + json.dumps(message["tool_calls"], ensure_ascii=False, default=str)
    return text


def _bubble(role: str, body: str, extra: str = "") -> str:
    color = _ROLES.get(role, "#57606a")
    return (f'<div data-role="{_esc(role)}" style="margin:4px 0;padding:4px 8px;border-left:3px solid {color};'
            f'background:#f6f8fa;border-radius:4px"><div style="{_HEAD};color:{color}"><b>{_esc(role)}</b>{extra}</div>'
            f'<div style="{_TEXT}">{body}</div></div>')


def _reply_html(state, r: int) -> str:
    """The last step's tokens of row ``r``, shaded, with its forced and healed tokens."""
    row, last = _Row(state, r), state._last
    s, e = last.starts[r], last.ends[r]
    marks = [(s + a, s + b, k) for a, b, k in last.marks[r]] if last.marks is not None else ()
    # the token holding the step's first character may start before it (healing); byte offsets are
    # approximate where the text holds U+FFFD: a few tokens of margin, the clip keeps the step's characters
    lo, hi = max(0, row.char_to_token(s) - 4), row.char_to_token(max(e - 1, s)) + 4
    body = _tokens_html(row, lo, min(hi, len(row.ids)), marks=marks, clip=(s, e))
    return body if "data-tok" in body or s >= e else _esc(row.text[s:e])  # tokens not located: the text


def chat_to_html(messages, state=None) -> str:
    """HTML of one chat (a list of ``{"role", "content"}`` dicts) or several (a list of such lists).

    With ``state`` (a ``SequenceState`` with one batch row per chat, e.g. a ``Chat``'s state after a
    reply), the final assistant message is drawn from the state's last step: its tokens shaded by
    probability like :func:`state_to_html` (several samples or beams: one reply each, side by side).
    A final message that is not the state's last step is shown as plain text, with a note.

    Example:
        >>> chat_to_html([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}], state)  # doctest: +SKIP
    """
    convs = _conversations(messages)
    if state is not None and state.batch != len(convs):
        raise BatchMismatch(f"chat_to_html got {len(convs)} conversation(s) but a state with batch={state.batch}: "
                            f"pass one message list per batch row of the state (or no state)")
    parts = [f'<div style="{_BOX}">']
    if state is not None:
        parts.append(_legend(bars=False))
    for b, conv in enumerate(convs):
        parts.append(f'<div data-chat="{b}" style="margin-top:4px">')
        if len(convs) > 1:
            parts.append(f'<div style="{_HEAD}"><b>conversation {b}</b></div>')
        shade = state is not None and state._last is not None and conv and conv[-1].get("role") == "assistant"
        body = conv[:-1] if shade else conv
        for m in body:
            parts.append(_bubble(str(m.get("role")), _esc(_content_text(m))))
        if shade:
            parts.append(_final_reply(state, b, conv[-1]))
        parts.append("</div>")
    parts.append("</div>")
    return _ascii("".join(parts))


def _final_reply(state, b: int, message: dict) -> str:
    content = _content_text(message)
    rows = list(range(b * state.samples, (b + 1) * state.samples))
    texts, last = state.texts, state._last
    replies = [texts[r][last.starts[r]:last.ends[r]] for r in rows]
    if state.samples == 1 and replies[0].strip() != content.strip():
        note = ' <span style="font-weight:normal;color:#888">(not the state\'s last step: not shaded)</span>'
        return _bubble("assistant", _esc(content), note)
    cells = []
    for r in rows:
        extra = f" · weight {float(state._weights[r]):.3f}"
        if last.finish is not None:
            extra += f" · finish: {_esc(last.finish[r])}"
        if state.samples > 1:
            extra = f" · sample {r - rows[0]}" + extra
        cells.append(f'<div data-row="{r}" style="flex:1 1 300px;min-width:0">'
                     + _bubble("assistant", _reply_html(state, r), extra) + "</div>")
    return '<div style="display:flex;flex-wrap:wrap;gap:8px">' + "".join(cells) + "</div>"
