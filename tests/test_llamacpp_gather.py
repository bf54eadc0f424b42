"""One engine step of mixed requests on llama.cpp (``LlamaCpp.run_step`` through ``gather.py``): each request's
log-probs / logits and top tokens against llama-cpp-python's own prefill of the same ids (tolerances:
tests/llamacpp_support.py), whatever the others in the step (a left-padded batch, an "all" request between two
normalized ones, so that the normalized rows are not consecutive in the decode's output)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from continuum import continuous, generate, models, samplers
from continuum.errors import ContextLengthError, StaleWindowError
from continuum.models import kv, token_tree
from continuum.models.llamacpp import window
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


def _next_request(state) -> Request:
    """The request a call's loop makes first on ``state``: its uncached suffix after its KV (``decoding.forward``)."""
    C = kv.length(state._kv)
    return Request(state._ids[:, C:], state._mask, kv.positions(state._mask)[:, C:], state._kv, normalize=True)


def _counters() -> dict:
    return {"forward_s": 0.0, "merged_forwards": 0, "requests_merged": 0, "fallbacks": 0}


def test_a_request_over_the_context_fails_alone_and_its_neighbours_get_their_alone_results():
    """One step: two prompts and a prompt longer than the context (n_ctx=256), all in one decode (the default mode
    merges prefills). The long one gets its ContextLengthError; each other request gets exactly its alone result."""
    model = models.llamacpp(gguf("f32"), n_ctx=256, n_threads=2, flash_attn=True)
    tok = model.tokenizer
    good_ids = [tok.encode_prompts([p]) for p in PROMPTS[:2]]
    long_ids = tok.encode_prompts(["Once upon a time, there was a little girl named Lily. " * 24])
    assert len(long_ids[0]) > model.context_length == 256
    alone = []
    for ids in good_ids:
        r = _request(ids, normalize=True)
        model.run_step([r], _counters())
        alone.append(r.log_probs().clone())
        del r
    good = [_request(ids, normalize=True) for ids in good_ids]
    bad = _request(long_ids, normalize=True)
    model.run_step([good[0], bad, good[1]], _counters())
    for r, want in zip(good, alone):
        assert r.error is None
        torch.testing.assert_close(r.log_probs(), want, rtol=0, atol=0)
        assert r.top[0] == want.argmax(-1).tolist()
    assert isinstance(bad.error, ContextLengthError) and "row 0" in str(bad.error)  # (its own row, not the step's)


def test_a_stale_window_row_fails_its_own_request_and_the_others_decode_without_it(monkeypatch):
    """One step of three one-token requests (merged, and exact, in the batch-invariant mode) where one state's
    window cells are reported gone (Gemma's condition, injected: stories260K has no sliding window). That request
    gets StaleWindowError naming its own row; the two others are decoded together and get exactly their alone
    results."""
    model = models.llamacpp(gguf("f32"), batch_invariant=True, n_threads=2)
    gen = continuous(generate.text(model, samplers.greedy()))
    states = [gen(p, max_tokens=4) for p in PROMPTS]
    alone = []
    for s in states:
        r = _next_request(s)
        model.run_step([r], _counters())
        alone.append(r.log_probs().clone())
        del r
    reqs = [_next_request(s) for s in states]
    stale = reqs[1].kv.views[0].seq_id
    fits = window.fits
    monkeypatch.setattr(window, "fits", lambda pool, seq_id, n: seq_id != stale and fits(pool, seq_id, n))
    stats = _counters()
    model.run_step(reqs, stats)
    for i in (0, 2):
        assert reqs[i].error is None
        torch.testing.assert_close(reqs[i].log_probs(), alone[i], rtol=0, atol=0)
    assert isinstance(reqs[1].error, StaleWindowError) and reqs[1].error.rows == [0]  # (its own row, not the step's)
    assert stats["fallbacks"] == 1


def test_ctrl_c_during_a_decode_propagates_instead_of_becoming_each_request_s_error(monkeypatch):
    """A KeyboardInterrupt inside the decode (injected) leaves run_step: it is not a request's error to hand back."""
    from continuum.models.llamacpp import backend

    model = models.llamacpp(gguf("f32"), batch_invariant=True, n_threads=2)
    r = _request(model.tokenizer.encode_prompts(PROMPTS[:1]), normalize=True)

    def interrupted(pool, rows):
        raise KeyboardInterrupt

    monkeypatch.setattr(backend, "decode", interrupted)
    with pytest.raises(KeyboardInterrupt):
        model.run_step([r], _counters())


def _tree_request(state, options: list[str]) -> Request:
    """Choice scoring's token-tree request on ``state`` (as ``loop/scoring.py`` builds it)."""
    tok, C = state._model.tokenizer, kv.length(state._kv)
    tree = token_tree.build(state._ids[:, C].tolist(), (state._mask.sum(1) - 1).tolist(),
                            [[tok.encode_continuation(o) for o in options]] * state.rows, state._mask[:, :C], tok.pad_token_id)
    return Request(tree.ids, torch.cat([state._mask[:, :C], tree.real], 1), tree.positions, state._kv, logits="all",
                   allowed=tree.allowed)


def test_a_stale_window_row_in_a_token_tree_fails_its_own_request_only(monkeypatch):
    """Two choice-scoring trees in one step (one decode), one state's window cells reported gone (injected): that
    request gets StaleWindowError, the other exactly its alone logits."""
    model = models.llamacpp(gguf("f32"), batch_invariant=True, n_threads=2)
    gen = continuous(generate.text(model, samplers.greedy()))
    states = [gen(p, max_tokens=4) for p in PROMPTS[:2]]
    options = [" cat", " dog", " big dog"]
    alone = _tree_request(states[0], options)
    model.run_step([alone], _counters())
    want = alone.result[0].clone()
    del alone
    reqs = [_tree_request(s, options) for s in states]
    stale = reqs[1].kv.views[0].seq_id
    fits = window.fits
    monkeypatch.setattr(window, "fits", lambda pool, seq_id, n: seq_id != stale and fits(pool, seq_id, n))
    model.run_step(reqs, _counters())
    assert reqs[0].error is None
    torch.testing.assert_close(reqs[0].result[0], want, rtol=0, atol=0, equal_nan=True)  # (NaN: leaves, not computed)
    assert isinstance(reqs[1].error, StaleWindowError)


def test_a_token_trees_logits_are_nan_wherever_the_tree_reads_nothing():
    """A token tree's result: finite logits at the nodes choice scoring reads (``tree.outputs``), NaN everywhere else
    (leaves, and the padding of a row whose options make a smaller trie): never a value nobody computed."""
    model = models.llamacpp(gguf("f32"), n_threads=2)
    state = continuous(generate.text(model, samplers.greedy()))(PROMPTS[:2], max_tokens=3)
    tok, C = model.tokenizer, kv.length(state._kv)
    options = [[tok.encode_continuation(o) for o in (" cat", " dog")],
               [tok.encode_continuation(o) for o in (" big dog", " small cat", " a")]]
    tree = token_tree.build(state._ids[:, C].tolist(), (state._mask.sum(1) - 1).tolist(), options,
                            state._mask[:, :C], tok.pad_token_id)
    assert not bool(tree.real.all())  # (the first row's trie is smaller: padded)
    r = Request(tree.ids, torch.cat([state._mask[:, :C], tree.real], 1), tree.positions, state._kv, logits="all",
                allowed=tree.allowed, outputs=tree.outputs)
    model.run_step([r], _counters())
    assert r.error is None
    lg, reads = r.result[0], tree.outputs
    assert bool(torch.isfinite(lg[reads]).all()) and bool(torch.isnan(lg[~reads]).all())
    # logits="outputs" (choice scoring's): only the nodes read, row-major, for each of two requests sharing a decode
    other = token_tree.build(state._ids[:, C].tolist(), (state._mask.sum(1) - 1).tolist(), options[::-1],
                             state._mask[:, :C], tok.pad_token_id)
    trees = [tree, other]
    dense = []
    for t in trees:
        alone = Request(t.ids, torch.cat([state._mask[:, :C], t.real], 1), t.positions, state._kv, logits="all",
                        allowed=t.allowed, outputs=t.outputs)
        model.run_step([alone], _counters())
        dense.append(alone.result[0][t.outputs])
    both = [Request(t.ids, torch.cat([state._mask[:, :C], t.real], 1), t.positions, state._kv, logits="outputs",
                    allowed=t.allowed, outputs=t.outputs) for t in trees]
    calls = model.forward_calls
    model.run_step(both, _counters())
    assert model.forward_calls == calls + 1  # (one decode for both trees)
    for r, want in zip(both, dense):
        assert r.error is None and r.result[0].shape == want.shape
        torch.testing.assert_close(r.result[0], want, rtol=0, atol=DECODE_TOL["f32"])
