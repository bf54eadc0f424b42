"""Why a target is missed on a 2-core CPU, when it is known: the runner prints it under each missed target.

A miss with no entry here (and no ``Row.achievable`` from the scenario itself, measured in the run) is printed as
unexplained: a regression until shown otherwise. Each entry says what bounds the figure and where the evidence
is (docs/benchmarks.md, docs/speculation.md); keep them to what was measured.
"""

from __future__ import annotations

__all__ = ["KNOWN_MISSES", "explain"]

KNOWN_MISSES: dict[str, str] = {
    "B1": "parity by construction: both sides run the same forwards on the same tokens, and a step is 98.7% the "
          "model's matrix-vector work; single pairs spread 0.92-1.08 on a shared machine (docs/benchmarks.md, "
          "'Targets: what holds, and why')",
    "B2": "the same forwards as B1: outside them continuum spends ~0.5 ms a step; a busy core moves it by more",
    "B22a": "each program's own Python (its prompt's state, its call's entry, its rows of the joint result) runs once "
            "per program where a list call runs it once: 0.91-0.94x in lockstep at 32 and 128 programs (full mode); "
            "--quick's runs last 0.03 s, so one stall of the machine moves them (docs/benchmarks.md, eighth session)",
    "B22b": "three calls per program, each with per-program Python around it (state + text, its rows split out of "
            "each joint call and stacked into the next), against three lockstep list calls: 0.54-0.58x in lockstep "
            "(0.21-0.45x with a thread per program) (docs/benchmarks.md, eighth session)",
    "B24a": "a lone call's step is one llama_decode (94% of the wall time measured around it): paired runs sit at "
            "0.93-0.97x of llama-cpp-python, whose own figure moves by 10% run to run (docs/benchmarks.md, B24)",
    "B24c": "llama.cpp's batched decode itself is ~3.3x one at a time on 2 cores, so >= 3x leaves ~10% for "
            "everything continuum does per step; --quick's 16 programs batch less than the full mode's 32 (3.56x "
            "in the full mode, 2.7-3.3x in --quick) (docs/benchmarks.md, B24 under OpenMP's default)",
    "B24e": "a JSON token costs llguidance's mask over Gemma's 262,144-token vocabulary beside a ~20 ms decode: "
            "1.11x in the full mode's 5 pairs (met), 1.25-1.36x in --quick's 2 pairs of 32 tokens (docs/benchmarks.md, "
            "B24 under OpenMP's default)",
    "B25a": "every drafted position needs its logits and Gemma's output layer (262,144 x 640) is about half a CPU "
            "decode step, so 7x fewer target forwards give 1.4-1.5x; on a GPU's weight-bound step they would cost "
            "nearly one step each (docs/benchmarks.md, 'B25 again')",
    "B25b": "on this CPU a verified position costs as much as a decoded one (Gemma's 262k-row output layer per "
            "position; forced JSON tokens need their log-probs anyway): 1.15x is the measured ceiling's "
            "neighbourhood, a GPU's weight-bound step is what makes 1.5x reachable (docs/speculation.md)",
    "B25e": "no call drafts while more than 4 share a step, so the figure is plain decoding's noise: 0.91-1.14x "
            "across runs (docs/benchmarks.md, 'B25 again')",
    "B21s": "ready = the weights loaded (llama.cpp repacks them on every core) plus Python's start and uvicorn; "
            "under load the load slows: measure on idle cores (docs/serve.md, 'Start-up')",
}


def explain(row_id: str) -> str:
    """The known reason ``row_id`` misses its target (the longest entry it starts with: ``B22a-16a`` is a
    ``B22a``, ``B24e`` its own), or a line saying none is known."""
    for key in sorted(KNOWN_MISSES, key=len, reverse=True):
        if row_id.startswith(key) and not row_id[len(key):len(key) + 1].isdigit():
            return KNOWN_MISSES[key]
    return "not a known miss on this machine: a regression until shown otherwise (compare docs/benchmarks.md)"
