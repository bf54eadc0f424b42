"""continuum benchmarks: every figure is a ratio against a baseline measured in the same run.

Run ``python -m benchmarks`` (or ``python benchmarks/run.py``); ``--quick`` for a ~2 minute pass,
``--smoke`` for every scenario once at toy size (what CI runs: ``tests/test_benchmarks_smoke.py``).
See ``docs/benchmarks.md``.

Benchmarks use continuum's public API only, plus one hook the tests use too: PyTorch forward hooks on
the wrapped Hugging Face module (``model.model.register_forward_hook``; ``counting.ForwardCounter`` and
``counting.KVPeak``). This package must not import torch at import time: the runner sets OpenMP
environment variables before torch is loaded.
"""
