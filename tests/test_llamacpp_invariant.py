"""The batch-invariant mode on the real model (Gemma 3 270M Q4_K_M): merged prefills of its quantized weights differ
from each alone (0.84 measured, B24h), so in this mode a prefill gets its own ``llama_decode`` and only one-token
steps are merged; short programs under ``run_batch`` then return exactly what they return alone, weights bit for
bit (longer ones drift: docs/llamacpp.md, "Exactness")."""

from __future__ import annotations

import torch

from continuum import continuous, generate, models, run_batch, samplers

from llamacpp_support import gemma_path


def test_gemma_short_programs_under_run_batch_equal_each_alone_exactly():
    model = models.llamacpp(gemma_path(), n_threads=2, batch_invariant=True)
    gen = continuous(generate.text(model, samplers.greedy()))
    prompts = ["The capital of France is", "Once upon a time, in a small village by the sea,", "def add(a, b):",
               "The three primary colors are"]
    alone = [gen(p, max_tokens=6) for p in prompts]
    together = run_batch(lambda p: gen(p, max_tokens=6), prompts)
    for a, b in zip(alone, together):
        assert str(a) == str(b) and torch.equal(a.weights, b.weights), (str(a), str(b), a.weights, b.weights)
