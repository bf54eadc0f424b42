"""How much an outlines-core index of a regex would cost, estimated from the pattern before building it.

outlines-core determinises the regex into a byte-level automaton, then walks the vocabulary from
every state: time is about ``states x vocabulary x breadth`` (breadth: how many tokens get past a
state's first byte; a literal stops most of them at once). Measured on GPT-2's 50k vocabulary:
``[a-z]{1000}`` 1,001 states 4.2 s, ``(ab|cd|ef){200}`` 801 states 0.3 s, ``.{500}`` 4,001 states
7.8 s; on a 400-token vocabulary ``[a-z]*a[a-z]{14}`` has 65,536 states (the determinised automaton
tracks every place the ``a`` may have been: 2^k states) and ``\\w{100}`` 31,647 (a Unicode class is
hundreds of byte states).

The pattern is parsed with Python's own regex parser (``re._parser``), after rewriting the Rust
spellings outlines-core accepts and Python does not (``\\p{L}``, ``[[:alpha:]]``, ``(?<name>``,
``\\z``); a pattern it still cannot parse gets a rough count from its repetition bounds.

Example:
    >>> estimate_regex("[a-z]{1000000}").states
    1000000.0
    >>> estimate_regex("[0-9]{3}").states
    3.0
"""

from __future__ import annotations

import math
import re
import sys
from dataclasses import dataclass

# Python's regex parser: `re._parser`/`re._constants` from 3.11 (the old names then warn on import), `sre_parse`/
# `sre_constants` on 3.10 (requires-python >= 3.10; mypy's python_version = "3.10" checks this branch).
if sys.version_info >= (3, 11):
    from re import _constants as c  # type: ignore[attr-defined]  # private module; typeshed stubs only sre_*
    from re import _parser  # type: ignore[attr-defined]  # same
else:
    import sre_constants as c
    import sre_parse as _parser

__all__ = ["RegexSize", "estimate_regex"]

_CAP = 1e30  # estimates saturate here (a number, not an overflow)
# What one automaton state costs outlines-core beyond the vocabulary walk, in the budget's units (one unit: a
# vocabulary token walked from a state). Measured on 2 cores: ((ab){500}c){500}, 500,500 states, 22.9 s on a
# 512-token vocabulary (~46 us a state); the budget (30M, [a-z]{1000} on GPT-2's 50k tokens: 4.2 s for 50M) puts a
# unit near 0.08 us, so a state is ~600 units: the budget then stops near 50,000 literal states (~2.5 s).
STATE_COST = 600
_SAMPLE = [chr(i) for i in range(128)] + ["\u00e9", "\u6771", "\U0001f600", "\u00a0", "\u0660"]
_RUST = re.compile(r"\\\\|\\[pP]\{[^}]*\}|\\[pP][A-Za-z]|\[:\^?[a-z]+:\]|\(\?<(?=[A-Za-z_])|\\z")


@dataclass(frozen=True)
class RegexSize:
    """Estimated automaton ``states`` and ``work`` (states x breadth, per vocabulary token) of a pattern."""

    states: float
    work: float
    exact_parse: bool  # False: the pattern was not parseable here; the numbers are a rough bound

    def cost(self, vocab_size: int) -> float:
        """The vocabulary walk (``work`` per token) plus the automaton itself (``STATE_COST`` per state): a pattern
        of many states over a small vocabulary (``((ab){500}c){500}``: 500,500 states, 512 tokens) took 22.9 s to
        index while its walk alone estimated under the budget."""
        return min(_CAP, self.work * max(1, vocab_size) + self.states * STATE_COST)


@dataclass
class _Node:
    states: float
    work: float
    min_len: float
    max_len: float
    first: frozenset  # sample characters that can start it
    chars: frozenset  # sample characters it can consume anywhere
    iters: float = 0  # how many more iterations a repetition may take (hi - lo): the places its end can be


def _rust_to_python(pattern: str) -> str:
    def sub(m: re.Match) -> str:
        t = m.group(0)
        if t == "\\\\":
            return t
        if t.startswith(("\\p", "\\P")):
            return "\\w"  # a Unicode property: as large as \w
        if t.startswith("[:"):
            return "a-zA-Z0-9"
        if t == "\\z":
            return "$"
        return "(?P<"

    return _RUST.sub(sub, pattern)


def _category(code: str, ch: str) -> bool:
    neg = "NOT_" in code
    if "DIGIT" in code:
        hit = ch.isdigit()
    elif "SPACE" in code:
        hit = ch.isspace()
    elif "WORD" in code:
        hit = ch.isalnum() or ch == "_"
    else:  # LINEBREAK
        hit = ch == "\n"
    return hit != neg


def _class(items, constants) -> tuple[frozenset, float, float]:
    """(sample characters matched, byte states, breadth) of a character class ``[...]``."""
    c = constants
    negate, states, n_chars, unicode = False, 1.0, 0, False

    def member(ch: str) -> bool:
        for op, av in items:
            if op is c.LITERAL and ord(ch) == av:
                return True
            if op is c.RANGE and av[0] <= ord(ch) <= av[1]:
                return True
            if op is c.CATEGORY and _category(str(av), ch):
                return True
        return False

    for op, av in items:
        if op is c.NEGATE:
            negate = True
        elif op is c.CATEGORY:
            code = str(av)
            states = max(states, 8 if "NOT_" in code or "LINEBREAK" in code else 320 if "WORD" in code else
                         40 if "DIGIT" in code else 4)
            n_chars += 100
        elif op is c.RANGE:
            n_chars += av[1] - av[0] + 1
            unicode |= av[1] > 127
        elif op is c.LITERAL:
            n_chars += 1
            unicode |= av > 127
    if negate:
        states = max(states, 8)
    elif unicode:
        states = max(states, 4 + len(items))
    matched = frozenset(ch for ch in _SAMPLE if member(ch) != negate)
    breadth = 1.0 if negate or n_chars > 3 else 0.2
    return matched, states, breadth


def _literal(ch: str) -> _Node:
    n = len(ch.encode("utf-8", "surrogatepass"))
    s = frozenset([ch]) & frozenset(_SAMPLE) or frozenset(["\u00e9"])
    return _Node(n, 0.1 * n, 1, 1, s, s)


def _seq(nodes: list[_Node]) -> _Node:
    if not nodes:
        return _Node(0, 0, 0, 0, frozenset(), frozenset())
    first: set = set()
    for nd in nodes:
        first |= nd.first
        if nd.min_len > 0:
            break
    # A variable-length item followed by items that can also continue it: the determinised automaton
    # tracks every place the item may have ended (up to 2^k states for a run of k such positions).
    blowup = 0.0
    for i, nd in enumerate(nodes):
        width = nd.iters  # an optional item (?) has 2 places to end: (k+1) states; X* has any: 2^k
        if width <= 0:
            continue
        k, distinct = 0.0, False
        for nxt in nodes[i + 1:]:
            if not (nxt.first & nd.first):
                break
            distinct |= nxt.chars != nd.first
            k += nxt.max_len if math.isfinite(nxt.max_len) else 64
            if k >= 64:
                break
        if k and distinct:
            k = min(k, 99)
            blowup = max(blowup, min(2.0 ** (k + 1), (k + 1) ** min(width, 99)))
    return _Node(max(blowup, sum(n.states for n in nodes)), max(blowup, sum(n.work for n in nodes)),
                 sum(n.min_len for n in nodes),
                 sum(n.max_len for n in nodes), frozenset(first), frozenset().union(*(n.chars for n in nodes)))


def _walk(sub, c) -> _Node:
    nodes = []
    for op, av in sub:
        if op is c.LITERAL:
            nodes.append(_literal(chr(av)))
        elif op is c.NOT_LITERAL or op is c.ANY:
            s = frozenset(ch for ch in _SAMPLE if not (op is c.NOT_LITERAL and ord(ch) == av))
            nodes.append(_Node(8, 8, 1, 1, s, s))
        elif op is c.IN:
            s, states, breadth = _class(av, c)
            nodes.append(_Node(states, states * breadth, 1, 1, s, s))
        elif op is c.BRANCH:
            alts = [_walk(b, c) for b in av[1]]
            nodes.append(_Node(sum(a.states for a in alts), sum(a.work for a in alts), min(a.min_len for a in alts),
                               max(a.max_len for a in alts), frozenset().union(*(a.first for a in alts)),
                               frozenset().union(*(a.chars for a in alts))))
        elif op is c.SUBPATTERN:
            nodes.append(_walk(av[-1], c))
        elif op in (c.MAX_REPEAT, c.MIN_REPEAT, getattr(c, "POSSESSIVE_REPEAT", c.MAX_REPEAT)):
            lo, hi, body = av
            b = _walk(body, c)
            times = (lo + 1) if hi is c.MAXREPEAT else hi
            max_len = math.inf if hi is c.MAXREPEAT else b.max_len * hi
            nodes.append(_Node(min(_CAP, b.states * max(times, 1)), min(_CAP, b.work * max(times, 1)),
                               b.min_len * lo, max_len, b.first, b.chars, math.inf if hi is c.MAXREPEAT else hi - lo))
        elif op is getattr(c, "ATOMIC_GROUP", None):
            nodes.append(_walk(av, c))
        else:  # anchors, assertions, back-references: outlines-core judges them
            nodes.append(_Node(1, 1, 0, 0, frozenset(), frozenset()))
    return _seq(nodes)


def _rough(pattern: str) -> RegexSize:
    """A bound for a pattern Python cannot parse: its length plus its repetition bounds."""
    bounds = [int(m.group(2) or m.group(1)) for m in re.finditer(r"\{(\d{1,12})(?:,(\d{1,12}))?\}", pattern)]
    states = float(len(pattern) + sum(bounds)) * (8 if "\\p" in pattern or "\\w" in pattern else 1)
    return RegexSize(min(_CAP, states), min(_CAP, states), False)


def estimate_regex(pattern: str) -> RegexSize:
    """Estimated size of the outlines-core automaton of ``pattern`` (see the module docstring)."""
    try:
        tree = _parser.parse(_rust_to_python(pattern))
    except OverflowError:  # a repetition bound past 2^32: huge
        return RegexSize(_CAP, _CAP, False)
    except (re.error, RecursionError, ValueError, TypeError):
        return _rough(pattern)
    try:
        node = _walk(tree, c)
    except RecursionError:
        return _rough(pattern)
    return RegexSize(min(_CAP, node.states), min(_CAP, node.work), True)
