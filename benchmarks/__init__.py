"""continuum benchmarks: every figure is a ratio against a baseline measured in the same run.

Run ``python -m benchmarks`` (or ``python benchmarks/run.py``); ``--quick`` for a ~2 minute pass.
See ``docs/benchmarks.md``. This package must not import torch at import time: the runner sets
OpenMP environment variables before torch is loaded.
"""
