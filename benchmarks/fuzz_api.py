"""The long profile of the API fuzz harness (tests/test_fuzz_api.py): run it, print the tallies.

    python -m benchmarks.fuzz_api --examples 2000

Runs the hypothesis test with ``CONTINUUM_FUZZ_API_EXAMPLES`` examples in a child pytest (one thread),
then prints how many distinct inputs were tried, how many calls returned and how many raised each
``ContinuumError`` subclass, and the slowest call. A raw exception or a hang fails the run (exit 1).
The figure goes in docs/errors.md ("The fuzz harness").
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(examples: int, timeout_s: int) -> dict:
    """Run the harness with ``examples`` examples; returns the tally (plus ``returncode`` and ``wall_s``)."""
    with tempfile.TemporaryDirectory() as tmp:
        tally = Path(tmp) / "tally.json"
        env = dict(os.environ, CONTINUUM_FUZZ_API_EXAMPLES=str(examples), CONTINUUM_FUZZ_TALLY=str(tally),
                   OMP_NUM_THREADS="1")
        t = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "pytest", "tests/test_fuzz_api.py", "-q", "-x", "-p", "no:warnings",
                               "-k", "every_call or state_operations"],
                              cwd=ROOT, env=env, timeout=timeout_s, capture_output=True, text=True)
        out = json.loads(tally.read_text()) if tally.exists() else {}
        out.update(returncode=proc.returncode, wall_s=round(time.perf_counter() - t, 1))
        if proc.returncode:
            out["failure"] = proc.stdout[-4000:]
        return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", type=int, default=2000)
    ap.add_argument("--timeout", type=int, default=3600, help="seconds for the whole run")
    args = ap.parse_args(argv)
    out = run(args.examples, args.timeout)
    outcomes = out.get("outcomes", {})
    raised = {k: v for k, v in sorted(outcomes.items(), key=lambda kv: -kv[1]) if not k.endswith("ok")}
    returned = sum(v for k, v in outcomes.items() if k.endswith("ok"))
    print(f"examples {out.get('examples', 0)} (generator calls, then state operations: 'state-' outcomes), "
          f"distinct inputs {out.get('distinct_inputs', 0)}, returned {returned}, "
          f"raised a ContinuumError {sum(raised.values())}, "
          f"raw exceptions {0 if out['returncode'] == 0 else 'SEE FAILURE'}, slowest call {out.get('slowest_call_s')} s, "
          f"wall {out['wall_s']} s")
    for name, n in raised.items():
        print(f"  {name:28s} {n}")
    print("slowest:", out.get("slowest_call", ""))
    if out["returncode"]:
        print(out.get("failure", ""))
    return 1 if out["returncode"] else 0


if __name__ == "__main__":
    sys.exit(main())
