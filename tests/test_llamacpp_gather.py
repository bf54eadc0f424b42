"""One engine step of mixed requests on llama.cpp (``LlamaCpp.run_step`` through ``gather.py``): each request's
log-probs / logits and top tokens against llama-cpp-python's own prefill of the same ids (tolerances:
tests/llamacpp_support.py), whatever the others in the step (a left-padded batch, an "all" request between two
normalized ones, so that the normalized rows are not consecutive in the decode's output)."""

from __future__ import annotations

import numpy as np
import torch

from continuum import models
from continuum.models.request import Request

from llamacpp_support import DECODE_TOL, gguf, reference_logits

PROMPTS = ["Once upon a time", "The little dog ran to the park and", "Lily"]


def _request(ids_rows: list[list[int]], **kw) -> Request:
    width = max(map(len, ids_rows))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in ids_rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in ids_rows])
    return Request(ids, mask, (mask.cumsum(1) - 1).clamp(min=0), None, **kw)


def _lsm(x: np.ndarray) -> np.ndarray:
    return torch.log_softmax(torch.from_numpy(x), -1).numpy()


def test_a_mixed_step_gives_each_request_its_own_rows():
    model = models.llamacpp(gguf("f32"), n_threads=2)
    tok = model.tokenizer
    a_ids, b_ids, c_ids = tok.encode_prompts(PROMPTS[:2]), tok.encode_prompts(PROMPTS[1:2]), tok.encode_prompts(PROMPTS[2:])
    a = _request(a_ids, normalize=True)  # two rows, the first left-padded
    b = _request(b_ids, logits="all")
    c = _request(c_ids, normalize=True)
    stats = {"forward_s": 0.0, "merged_forwards": 0, "requests_merged": 0}
    model.run_step([a, b, c], stats)
    assert stats["requests_merged"] == 3 and all(r.error is None for r in (a, b, c))
    tol = DECODE_TOL["f32"]
    for r, rows in ((a, a_ids), (c, c_ids)):
        assert r.result[0] is None and r.log_probs().shape == (len(rows), model.vocab_size)
        top, best = r.top
        for i, ids in enumerate(rows):
            want = _lsm(reference_logits("f32", ids)[-1])
            got = r.log_probs()[i].numpy()
            assert np.abs(got - want).max() <= tol
            assert top[i] == int(got.argmax()) and abs(best[i] - float(got.max())) < 1e-6
            assert kv_length(r, i) == len(ids)
    logits = b.result[0]
    assert logits.shape == (1, len(b_ids[0]), model.vocab_size)
    assert np.abs(logits[0].numpy() - reference_logits("f32", b_ids[0])).max() <= tol
    # a request's logits are its own tensor (its loop may write to them), not a view of the step's log-probs
    assert logits.untyped_storage().data_ptr() != a.log_probs().untyped_storage().data_ptr()


def kv_length(r: Request, row: int) -> int:
    """The real tokens a result's KV covers in ``row``."""
    return int(r.result[1].cols[row].sum())
