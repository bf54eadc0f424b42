"""The oracle's history steps (``tests/test_oracle.py``): a call drawn, its input prepared, run, and verified against
the backend's own reference (``tests/oracle_checks.py``, on ``tests/oracle_backends.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import event, note
from hypothesis.errors import InvalidArgument
from hypothesis.stateful import multiple
from oracle_backends import MAX_TOKENS, Backend
from oracle_checks import check_beams, check_cfg, check_choice, check_greedy, check_pattern, check_state, real_rows

from continuum import SequenceState

from conftest import chars_key


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models gain nothing from intra-op threads on a shared 2-core machine (see test_properties): imported by the
    oracle's test modules (autouse there: one intra-op thread for the module)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# the choices' options the histories draw from (test_oracle) and the regressions reuse
OPTIONS = [(" yes", " no"), (" the", " there", " then"), (" a", " an", " and"), (" cat", " cats", " dog"),
           (" happy", " sad", " hap"), ("!", ".", "?"), (" ok",), (" once upon", " once", " one"),
           tuple(f" {i}" for i in range(10, 80))]  # (70 options: more paths than a small pool's ids, 64+ tree nodes)


# ------------------------------------------------------------------------------------------- the machine's steps
@dataclass(frozen=True)
class Call:
    kind: str  # greedy | lookup (greedy, speculating) | cfg (greedy, guided) | sample | fork | beam | choice | regex | json
    k: int | None = 4
    n: int = 1
    arg: Any = None  # options, a pattern or a schema's name
    seed: int = 0
    variant: str = "plain"
    suffix: str = ""  # text added to the input first (as a program would: ``pick(s + " ok?")``)


@dataclass
class Held:
    """A state the history holds, with the weight the algebra carried per row on top of its own tokens' log-probs
    (``state + other`` carries ``other``'s weight; ``None``: unknown)."""

    state: SequenceState
    carried: list
    final: bool = False  # by a call without max_tokens: checked, never continued (test_oracle's regressions)

    def __repr__(self) -> str:
        return f"Held({self.state.shape}, {[t[-24:] for t in self.state]!r})"


def cut_carried(before: SequenceState, after: SequenceState, carried: list) -> list:
    """A row that a cut shortened keeps only its kept tokens' log-probs (docs/state.md); an uncut row keeps all."""
    return [0.0 if len(a) < len(t) else c for t, a, c in zip(before, after, carried)]


def prepare(h: Held, call: Call) -> tuple[SequenceState, list]:
    """The call's input: sample 0 for a one-sample sampler, cut back under MAX_TOKENS, plus the call's suffix."""
    s, c = h.state, list(h.carried)
    if call.kind != "sample" and s.samples > 1:
        s, c = s[:, 0, :], [c[b * s.samples] for b in range(s.batch)]
    while longest(s) > MAX_TOKENS - 40:
        cut = s[chars_key(s, slice(None, max(len(t) for t in s) // 2))]
        s, c = cut, cut_carried(s, cut, c)
    return (s + call.suffix if call.suffix else s), c


def execute(b: Backend, call: Call, inp: SequenceState, asynchronous: bool = False):
    n = inp.samples if call.kind == "sample" else call.n
    gen = b.generator(call.variant, call.kind, n, call.arg)
    rng = torch.Generator().manual_seed(call.seed) if call.kind in ("sample", "fork") else None
    k = None if call.kind == "choice" else call.k
    return gen.acall(inp, max_tokens=k, rng=rng) if asynchronous else gen(inp, max_tokens=k, rng=rng)


def record(what: str, text: str) -> None:
    """``note`` the step and count it as an ``event`` inside hypothesis (the tour runs outside it)."""
    with contextlib.suppress(InvalidArgument):
        note(text)
        event(what)


def verify(b: Backend, call: Call, inp: SequenceState, carried: list, out: SequenceState) -> Held:
    """Checks ``out`` against the reference; returns it with the weights it carries."""
    record(call.kind, f"{call} on {list(inp)!r} -> {list(out)!r} weights {out.weights.flatten().tolist()}")
    src = [r if out.samples == inp.samples else r // out.samples for r in range(out.rows)]
    inputs = real_rows(inp)
    out_carried = [carried[i] for i in src]
    for r, (ids, _) in enumerate(real_rows(out)):
        assert ids[:len(inputs[src[r]][0])] == inputs[src[r]][0], f"row {r}: the input's tokens changed"
    check_state(b, out, out_carried)
    if call.kind in ("greedy", "lookup"):
        compared = check_greedy(b, out, [len(inputs[i][0]) for i in src], [inputs[i][0] for i in src])
        record(f"greedy tokens compared: {min(compared, 3)}+", "")
        if call.kind == "lookup":
            spec = out._last.speculation if out._last is not None else None
            record(f"lookup drafts accepted: {min((spec or {}).get('accepted', 0), 2)}+", "")
    elif call.kind == "cfg":
        last = [real_rows(inp)[i][0][-1] for i in src]
        record(f"guided tokens compared: {min(check_cfg(b, out, [len(inputs[i][0]) for i in src], last), 3)}+", "")
    elif call.kind == "choice":
        record(f"choices compared: {check_choice(b, inp, out, list(call.arg))}", "")
    elif call.kind == "beam" and b.kind == "hf":
        record(f"beams compared with generate: {check_beams(b, inp, out, call.n, call.k)}", "")
    elif call.kind in ("regex", "json"):
        check_pattern(out, call.arg if call.kind == "regex" else None, call.arg if call.kind == "json" else None)
    return Held(out, out_carried, final=call.k is None and call.kind in ("greedy", "lookup"))


def keep(*held: Held):
    """The states later steps may continue (not one that filled a small pool: see ``Held.final``)."""
    return multiple(*[h for h in held if not h.final])


def gather(b: Backend, jobs: list[tuple]) -> list[Held]:
    """``(call, input, carried)`` jobs merged by ``asyncio.gather`` of ``acall``, each result verified."""
    async def main():
        return await asyncio.gather(*[execute(b, c, inp, asynchronous=True) for c, inp, _ in jobs])

    return [verify(b, c, inp, carried, out) for (c, inp, carried), out in zip(jobs, asyncio.run(main()))]


def longest(state: SequenceState) -> int:
    return max(len(ids) for ids, _ in real_rows(state))


def run_program(b: Backend, h: Held, program: list[Call]) -> list[tuple]:
    """One program instance (on run_batch's worker thread): its calls chained, each input and output kept."""
    done = []
    for i, call in enumerate(program):
        if call.k is None and i < len(program) - 1:  # (only last: see Held.final)
            call = Call(call.kind, 6, call.n, call.arg, call.seed, call.variant, call.suffix)
        inp, carried = prepare(h, call)
        out = execute(b, call, inp)
        done.append((call, inp, carried, out))
        src = [r if out.samples == inp.samples else r // out.samples for r in range(out.rows)]
        h = Held(out, [carried[i] for i in src])
    return done

