"""Compilation budgets: every guide compiles, or fails with a clear error, in a few seconds.

Compiling a constraint costs what the constraint asks for, and a typo can ask for a lot
(``[a-z]{1000000}``). Prevention, not timers (a Rust call cannot be interrupted):

* outlines-core builds its whole token-level index up front, in time about proportional to
  (automaton states) x (vocabulary size). :func:`~continuum.guides.regex_size.estimate_regex` estimates
  it from the pattern; past :attr:`CompileLimits.outlines_max_work` the ``"auto"`` backend compiles
  with llguidance instead (lazy: it never builds the whole automaton) and ``"outlines"`` raises
  ``InvalidRegexError`` saying what is too large and what to do;
* llguidance gets its resource limits explicitly (:func:`llguidance_limits`, not its defaults); a
  limit it hits is reported by name (:func:`explain_llguidance_error`);
* the JSON Schema normaliser refuses schemas nested too deeply (or cyclic Python objects), with
  too many nodes or too large an ``enum`` (:func:`check_schema_bounds`).

The defaults keep a compilation under ~3 s on two busy cores. Change them for the whole process:

Example:
    >>> from continuum.guides.limits import compile_limits, set_compile_limits
    >>> old = set_compile_limits(outlines_max_work=10**8)   # allow ~4x slower outlines-core compilations
    >>> compile_limits().outlines_max_work
    100000000
    >>> _ = set_compile_limits(**old.__dict__)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..errors import UnsupportedSchemaError

__all__ = ["CompileLimits", "compile_limits", "set_compile_limits", "llguidance_limits",
           "explain_llguidance_error", "llguidance_limit_hit", "check_schema_bounds"]


@dataclass(frozen=True)
class CompileLimits:
    """Budgets of guide compilation (see the module docstring).

    Attributes:
        outlines_max_work: estimated automaton states x breadth x vocabulary size an outlines-core index
            may cost (measured ~8e-8 s per unit on a busy CPU core: 3e7 is ~2.5 s).
        schema_max_depth: nesting levels of a JSON schema (objects and lists).
        schema_max_nodes: objects, lists and values of a JSON schema.
        schema_max_enum: values of one ``enum``.
        llg_*: llguidance's ``LLParserLimits`` (same names, llguidance 1.9's defaults).
    """

    outlines_max_work: int = 30_000_000
    schema_max_depth: int = 64
    schema_max_nodes: int = 200_000
    schema_max_enum: int = 10_000
    llg_max_items_in_row: int = 2_000
    llg_initial_lexer_fuel: int = 1_000_000
    llg_step_lexer_fuel: int = 200_000
    llg_step_max_items: int = 50_000
    llg_max_lexer_states: int = 250_000
    llg_max_grammar_size: int = 500_000


_LIMITS = CompileLimits()


def compile_limits() -> CompileLimits:
    """The budgets in force."""
    return _LIMITS


def set_compile_limits(**changes: int) -> CompileLimits:
    """Change budgets for the whole process (names of :class:`CompileLimits`); returns the previous ones."""
    global _LIMITS
    names = {f.name for f in dataclasses.fields(CompileLimits)}
    bad = sorted(set(changes) - names)
    if bad:
        raise TypeError(f"unknown compile limit(s) {bad}; known: {sorted(names)}")
    for k, v in changes.items():
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"compile limit {k} must be a positive int, got {v!r}")
    old, _LIMITS = _LIMITS, dataclasses.replace(_LIMITS, **changes)
    return old


def llguidance_limits():
    """The ``LLParserLimits`` every matcher is built with (short errors: no grammar dump)."""
    from llguidance import LLParserLimits

    lim = _LIMITS
    return LLParserLimits(max_items_in_row=lim.llg_max_items_in_row, initial_lexer_fuel=lim.llg_initial_lexer_fuel,
                          step_lexer_fuel=lim.llg_step_lexer_fuel, step_max_items=lim.llg_step_max_items,
                          max_lexer_states=lim.llg_max_lexer_states, max_grammar_size=lim.llg_max_grammar_size,
                          precompute_large_lexemes=True, verbose_errors=False)


# llguidance's messages when a limit stops it, and the limits that cause them.
_LLG_LIMIT_HINTS = (
    ("too many expressions", ("llg_initial_lexer_fuel", "llg_step_lexer_fuel", "llg_max_lexer_states")),
    ("lexer too complex", ("llg_initial_lexer_fuel", "llg_step_lexer_fuel", "llg_max_lexer_states")),
    ("too many items", ("llg_step_max_items", "llg_max_items_in_row")),
    ("grammar size", ("llg_max_grammar_size",)),
    ("grammar too large", ("llg_max_grammar_size",)),
    ("too many symbols", ("llg_max_grammar_size",)),
)


def llguidance_limit_hit(message: str) -> tuple[str, ...]:
    """The names of the limits (:class:`CompileLimits` fields) an llguidance error ``message`` comes from; ``()`` if none."""
    low = message.lower()
    return next((names for needle, names in _LLG_LIMIT_HINTS if needle in low), ())


def explain_llguidance_error(message: str) -> str:
    """llguidance's ``message`` (first lines), naming the limit it hit and how to raise it, if it hit one."""
    short = "\n".join(line for line in message.strip().splitlines()[:3] if "non-verbose" not in line)[:600]
    names = llguidance_limit_hit(message)
    if names:
        values = ", ".join(f"{n}={getattr(_LIMITS, n)}" for n in names)
        return (f"{short} [llguidance stopped at a resource limit ({values}): simplify the constraint "
                f"(smaller repetition bounds, fewer alternatives), or raise the limit with "
                f"continuum.guides.limits.set_compile_limits({names[0]}=...)]")
    return short


def check_schema_bounds(schema: Any) -> None:
    """Refuse a JSON schema too deep, too large, with a huge ``enum`` or cyclic (an iterative walk:
    no recursion, so a 10,000-level schema is an error, not a ``RecursionError``)."""
    lim = _LIMITS
    nodes, stack = 0, [(schema, 1, "")]
    while stack:
        node, depth, path = stack.pop()
        if depth > lim.schema_max_depth:
            raise UnsupportedSchemaError(
                f"the JSON schema is nested more than {lim.schema_max_depth} levels deep (at {path[:120] or '/'}; "
                f"or it contains itself): flatten it, move repeated parts under $defs and use $ref, or raise "
                f"set_compile_limits(schema_max_depth=...)", keyword="", path=path[:200])
        nodes += 1
        if nodes > lim.schema_max_nodes:
            raise UnsupportedSchemaError(
                f"the JSON schema has more than {lim.schema_max_nodes} nodes: split it, or raise "
                f"set_compile_limits(schema_max_nodes=...)")
        if isinstance(node, dict):
            enum = node.get("enum")
            if isinstance(enum, list) and len(enum) > lim.schema_max_enum:
                raise UnsupportedSchemaError(
                    f"the enum at {path or '/'} has {len(enum)} values (limit {lim.schema_max_enum}): use a pattern "
                    f"or a type instead, or raise set_compile_limits(schema_max_enum=...)", keyword="enum",
                    path=f"{path}/enum")
            stack.extend((v, depth + 1, f"{path}/{k}") for k, v in node.items())
        elif isinstance(node, list):
            stack.extend((v, depth + 1, f"{path}/{i}") for i, v in enumerate(node))
