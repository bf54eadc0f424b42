"""The batch-invariant mode on the real model (Gemma 3 270M Q4_K_M). Contract: a program under ``run_batch`` returns
exactly what it returns alone, weights bit for bit. Two llama.cpp kernel choices had to be pinned for it: merged
prefills of quantized weights differ from each alone (0.84 measured, B24h), so in this mode a prefill gets its own
``llama_decode`` and only one-token steps are merged; and K-quant matmuls of 8+ rows take a tiled kernel that rounds
otherwise (5 of 8 texts equal, weights 3.1 apart, measured with it on), so the mode turns it off
(``GGML_CPU_TILED_MM=0``) before llama.cpp computes anything. ggml reads that variable once per process: the test
process sets it in ``conftest.py`` (tests run in any order); fresh processes below check that the mode sets it itself
and warns when it is too late."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from continuum import continuous, generate, models, run_batch, samplers

from llamacpp_support import gemma_path, gguf


def test_gemma_programs_under_run_batch_equal_each_alone_exactly():
    model = models.llamacpp(gemma_path(), n_threads=2, batch_invariant=True)
    assert model.llama.pinned_kernels
    gen = continuous(generate.text(model, samplers.greedy()))
    prompts = ["The capital of France is", "Once upon a time, in a small village by the sea,", "def add(a, b):",
               "The three primary colors are", "My favourite animal is", "In 1969, the first", "Dear diary, today",
               "The recipe needs"]  # (8 rows: the tiled kernel's threshold)
    alone = [gen(p, max_tokens=12) for p in prompts]
    together = run_batch(lambda p: gen(p, max_tokens=12), prompts, concurrency=8)
    for a, b in zip(alone, together):
        assert str(a) == str(b) and torch.equal(a.weights, b.weights), (str(a), str(b), a.weights, b.weights)


_PROBE = """
import json, sys, warnings
from continuum import generate, models, samplers
path, first = sys.argv[1], sys.argv[2]
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    if first == "default":  # a default-mode model decodes first: ggml reads the variable at that first matmul
        generate.text(models.llamacpp(path, n_threads=1), samplers.greedy())("Once", max_tokens=2)
    m = models.llamacpp(path, n_threads=1, batch_invariant=True)
    generate.text(m, samplers.greedy())("Once", max_tokens=2)
import os
print(json.dumps({"pinned": m.llama.pinned_kernels, "env": os.environ.get("GGML_CPU_TILED_MM"),
                  "warned": [str(w.message) for w in seen if issubclass(w.category, RuntimeWarning)], "repr": repr(m.llama)}))
"""


def _probe(first: str, env: dict) -> dict:
    out = subprocess.run([sys.executable, "-c", _PROBE, str(gguf("f32")), first], env=env, capture_output=True, text=True,
                         timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_mode_pins_the_kernel_before_anything_computes_and_warns_when_too_late():
    env = {k: v for k, v in os.environ.items() if k != "GGML_CPU_TILED_MM"}
    fresh = _probe("invariant", env)
    assert fresh["pinned"] and fresh["env"] == "0" and not fresh["warned"]
    late = _probe("default", env)
    assert not late["pinned"] and late["env"] is None and "already decoded" in late["warned"][0]
    assert "tiled K-quant matmul on" in late["repr"]
    chosen = _probe("invariant", {**env, "GGML_CPU_TILED_MM": "1"})  # the user's own setting is kept, and named
    assert not chosen["pinned"] and chosen["env"] == "1" and "GGML_CPU_TILED_MM=1 is set" in chosen["warned"][0]


def _continued_after_a_hole(invariant: bool):
    """A state whose cells come after another state's, that other state released (a hole below it), then continued
    20 tokens: the new tokens' cells go where llama.cpp's search finds free cells first."""
    import gc

    m = models.llamacpp(gguf("f32"), batch_invariant=invariant, n_threads=1, n_ctx=512)
    gen = continuous(generate.text(m, samplers.greedy()))
    below = gen("The little dog ran to the park and played with a ball all day long", max_tokens=1)
    state = gen("Once upon a time", max_tokens=1)
    del below
    gc.collect()  # (the released state's cells are freed at the pool's next call: a hole below `state`'s)
    return gen(state, max_tokens=20)


def test_cells_out_of_position_order_change_the_sums_and_the_invariant_mode_keeps_them_in_order():
    """The cause, directly (issue 49): attention sums a sequence's cells in cell order. A state continued after a
    hole opened below its cells puts its new tokens in that hole, out of position order, and its weights differ in
    the last bits from the same ids decoded alone. The batch-invariant mode keeps released cells (held by a spare
    sequence id) until room is needed, and then packs the pool, so no hole is ever below a live cell: bit-exact."""
    alone = {}
    for invariant in (False, True):
        m = models.llamacpp(gguf("f32"), batch_invariant=invariant, n_threads=1, n_ctx=512)
        gen = continuous(generate.text(m, samplers.greedy()))
        alone[invariant] = gen(gen("Once upon a time", max_tokens=1), max_tokens=20)
    holed = _continued_after_a_hole(False)
    assert list(holed) == list(alone[False])  # (the same tokens: the difference is in the sums' last bits)
    assert not torch.equal(holed.token_logprobs.nan_to_num(), alone[False].token_logprobs.nan_to_num())
    kept = _continued_after_a_hole(True)
    assert torch.equal(kept.token_logprobs.nan_to_num(), alone[True].token_logprobs.nan_to_num())
