"""KV-cache storage (continuum/models/hf/cache.py, the tensors a transformers state's TensorKV holds): in-place appends,
copy-on-write, row selection, shrinking."""

from __future__ import annotations

import torch

from continuum.models.hf import cache as kvcache
from continuum.models.hf import dynamic
from continuum.models.hf.cache import positions
from continuum.models.hf.tensorkv import TensorKV

from conftest import kv_layers


def _prefill(model, n: int, rows: int = 1, reserve: int = 0):
    ids = torch.randint(5, 200, (rows, n), generator=torch.Generator().manual_seed(n))
    mask = torch.ones_like(ids)
    _, kv = model.forward(ids, mask, positions(mask), None, logits="none", reserve=reserve)
    return ids, kv.tensors()


def _step(model, ids, kv, token: int, reserve: int = 0):
    new = torch.full((ids.shape[0], 1), token)
    ids = torch.cat([ids, new], 1)
    mask = torch.ones_like(ids)
    logits, kv = model.forward(new, mask, positions(mask)[:, -1:], TensorKV(kv), reserve=reserve)
    return ids, kv.tensors(), logits


def _fresh_logits(model, ids):
    mask = torch.ones_like(ids)
    with torch.no_grad():
        return model.model(input_ids=ids, attention_mask=mask, position_ids=positions(mask)).logits[:, -1].float()


def _storage(kv):
    return kv[0][0].untyped_storage().data_ptr()


def test_append_in_place_only_at_the_fill_mark(gpt2_model):
    ids, kv = _prefill(gpt2_model, 8, reserve=10)
    before = [t.clone() for pair in kv for t in pair]
    ids_a, kv_a, logits_a = _step(gpt2_model, ids, kv, 7)
    assert _storage(kv_a) == _storage(kv)  # wrote after kv's columns, no copy
    ids_b, kv_b, logits_b = _step(gpt2_model, ids, kv, 9)  # kv again: column 8 is taken by kv_a
    assert _storage(kv_b) != _storage(kv)
    assert all(torch.equal(a, b) for a, b in zip(before, [t for pair in kv for t in pair]))
    torch.testing.assert_close(logits_a, _fresh_logits(gpt2_model, ids_a), atol=1e-4, rtol=0)
    torch.testing.assert_close(logits_b, _fresh_logits(gpt2_model, ids_b), atol=1e-4, rtol=0)
    # kv_a's keys were not touched by kv_b's write
    _, _, again = _step(gpt2_model, ids_a, kv_a, 11)
    torch.testing.assert_close(again, _fresh_logits(gpt2_model, torch.cat([ids_a, torch.tensor([[11]])], 1)),
                               atol=1e-4, rtol=0)


def test_cropped_cache_copies_before_appending(llama_model):
    ids, kv = _prefill(llama_model, 10, reserve=10)
    cut = kvcache.crop(kv, 6)
    ids2, kv2, logits = _step(llama_model, ids[:, :6], cut, 13)
    assert _storage(kv2) != _storage(kv)
    torch.testing.assert_close(logits, _fresh_logits(llama_model, ids2), atol=1e-4, rtol=0)
    # the uncut cache can still append in place: nobody wrote past its columns
    _, kv3, _ = _step(llama_model, ids, kv, 13)
    assert _storage(kv3) == _storage(kv)


def test_select_rows_views_and_copies(gpt2_model):
    ids, kv = _prefill(gpt2_model, 5, rows=3, reserve=4)
    assert kvcache.select_rows(kv, torch.arange(3)) is kv
    fork = kvcache.select_rows(kvcache.select_rows(kv, torch.tensor([1])), torch.tensor([0, 0, 0, 0]))
    seen: set = set()
    kvcache.nbytes(kv, seen)
    assert kvcache.nbytes(fork, seen) == 0  # narrow + expand views of kv: no new storage
    order = torch.tensor([2, 0, 0])
    beams = kvcache.select_rows(kv, order)
    for (k, v), (k2, v2) in zip(kv, beams):
        assert torch.equal(k2, k[order]) and torch.equal(v2, v[order])
    _, kv_next, logits = _step(gpt2_model, ids[order], beams, 3)
    assert _storage(kv_next) == _storage(beams)  # the reordered copy has room to append
    torch.testing.assert_close(logits, _fresh_logits(gpt2_model, torch.cat([ids[order], torch.full((3, 1), 3)], 1)),
                               atol=1e-4, rtol=0)


def test_shrink_gives_back_unused_room(gpt2_model):
    _, kv = _prefill(gpt2_model, 6, reserve=1000)
    small = kvcache.shrink(kv)
    assert kvcache.nbytes(small) < kvcache.nbytes(kv) / 10
    assert all(torch.equal(a, b) for pa, pb in zip(kv, small) for a, b in zip(pa, pb))
    assert kvcache.shrink(small) is not None and _storage(kvcache.shrink(small)) == _storage(small)


def test_compact_copies_only_views_much_smaller_than_their_storage(gpt2_model):
    _, kv = _prefill(gpt2_model, 240, rows=3, reserve=8)
    assert kvcache.compact(kv) is kv
    assert _storage(kvcache.compact(kvcache.crop(kv, 230))) == _storage(kv)  # backing off a little: a view
    tiny = kvcache.compact(kvcache.crop(kv, 5))
    assert _storage(tiny) != _storage(kv) and kvcache.nbytes(tiny) * 50 < kvcache.nbytes(kv)  # 5 columns of 304
    assert all(torch.equal(a, b[:, :, :5]) for pa, pb in zip(tiny, kv) for a, b in zip(pa, pb))
    two_rows = kvcache.select_rows(kv, torch.tensor([0, 1]))
    assert kvcache.compact(two_rows) is two_rows  # most of the storage: copying would not pay
    one_row = kvcache.compact(kvcache.select_rows(kv, torch.tensor([2])))
    assert _storage(one_row) != _storage(kv) and all(torch.equal(a, b[2:]) for pa, pb in zip(one_row, kv) for a, b in zip(pa, pb))
    forked = kvcache.select_rows(tiny, torch.tensor([0, 0, 0]))
    assert kvcache.compact(forked) is forked  # expand views share by design


def _uncached(state):
    """The same tokens without a cache: continuing it recomputes everything."""
    from continuum import SequenceState

    return SequenceState(model=state.model, ids=state.token_ids, mask=state.attention_masks, logprobs=state.token_logprobs,
                         weights=state._weights, kv=None, batch=state.batch, samples=state.samples)


def _arena_storages(state):
    return {k.untyped_storage().data_ptr() for k, _ in kv_layers(state)}


def test_small_slices_and_single_samples_do_not_pin_big_caches(gpt2_model):
    """A state cut to a few tokens, or one sample of many, holds storage in proportion to itself,
    stays exact, and continues like a fresh prompt of its text."""
    import gc
    import weakref

    from continuum import continuous, generate, samplers

    from conftest import assert_reuse_exact

    greedy = continuous(generate.text(gpt2_model, samplers.greedy()))
    big = greedy("Once upon a time", max_tokens=200)
    tiny = big[:12]
    k0 = kv_layers(big)[0][0]
    per_column = kvcache.nbytes(kv_layers(big)) // k0.untyped_storage().nbytes() * k0[:, :, :1].numel() * 4
    del k0  # (it would keep big's storage alive)
    assert kvcache.nbytes(kv_layers(tiny)) == per_column * kvcache.length(kv_layers(tiny))
    big_storage = weakref.ref(kv_layers(big)[0][0].untyped_storage())
    backed_off = big[: len(str(big)) - 3]  # backing off a few characters stays a view
    assert _arena_storages(backed_off) == _arena_storages(big)
    del big, backed_off
    gc.collect()
    assert big_storage() is None, "the big cache must be freed once only a small slice of it is alive"
    assert_reuse_exact(tiny)
    assert list(greedy(tiny, max_tokens=6)) == list(greedy(_uncached(tiny), max_tokens=6))

    many = continuous(generate.text(gpt2_model, samplers.multinomial(8)))(
        "Once upon a time", max_tokens=60, rng=torch.Generator().manual_seed(0))
    one = many[0, 3, :]
    assert kvcache.nbytes(kv_layers(one)) * 4 < kvcache.nbytes(kv_layers(many))  # 1 row of 8
    assert_reuse_exact(one)
    assert list(greedy(one, max_tokens=4)) == list(greedy(_uncached(one), max_tokens=4))

    # a chain that keeps a tiny prefix of every turn holds memory in proportion to what it keeps
    s, kept = greedy("Once upon a time", max_tokens=4), []
    for _ in range(30):
        s = greedy(s + " more", max_tokens=4)
        kept.append(s[:3])
    seen: set = set()
    held = sum(kvcache.nbytes(kv_layers(k), seen) for k in kept)
    assert held * 2 < kvcache.nbytes(kv_layers(s)), (held, kvcache.nbytes(kv_layers(s)))  # was 2.5x before compaction
    late = kept[15:]  # made once the chain was long: each holds exactly its own columns
    assert [kvcache.nbytes(kv_layers(k)) for k in late] == [per_column * kvcache.length(kv_layers(k)) for k in late]


def test_forward_passes_the_cache_under_the_keyword_the_model_takes(gpt2_model, llama_model):
    """transformers 5.2x deprecates ``past_key_values`` for ``cache`` (removal in 5.40): the adapter uses the keyword the
    model's forward declares, so continuing a state warns about neither, and the cache is still extended."""
    import inspect
    import warnings

    from continuum import continuous, generate, samplers

    for model in (gpt2_model, llama_model):
        expected = "cache" if "cache" in inspect.signature(type(model.model).forward).parameters else "past_key_values"
        assert dynamic.cache_kwargs(model.model, None) == {expected: None}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            s = continuous(generate.text(model, samplers.greedy()))("Hello", max_tokens=3)
            continuous(generate.text(model, samplers.greedy()))(s + " there", max_tokens=2)
        assert not [w for w in caught if "past_key_values" in str(w.message)]
        assert s._kv.length() > 0


def test_the_transformers_adapter_implements_the_backend_protocol(gpt2_model, llama_model):
    """The loop reaches a model only through ``models.protocol.Backend`` and its KV only through ``models.kv``:
    the transformers adapter implements both (its KV is a handle, TensorKV, over tensor tuples), and ``models.kv``
    gives the same results as the transformers cache functions on those tensors."""
    from continuum import continuous, generate, samplers
    from continuum.models import kv
    from continuum.models.protocol import Backend

    for model in (gpt2_model, llama_model):
        assert isinstance(model, Backend)
        gen = continuous(generate.text(model, samplers.multinomial(3)))
        s = gen("Hello there", max_tokens=4, rng=torch.Generator().manual_seed(0))
        assert isinstance(s._kv, kv.KVHandle) and not kv.opaque(s._kv) and kv.tensors(s._kv) is kv_layers(s)
        assert kv.length(s._kv) == kvcache.length(kv_layers(s)) > 0
        assert kv.nbytes(s._kv) == kvcache.nbytes(kv_layers(s))
        rows = torch.tensor([2, 0])
        picked, ref = kv.select_rows(s._kv, rows), kvcache.select_rows(kv_layers(s), rows)
        assert all(torch.equal(a, b) for pa, pb in zip(kv.tensors(picked), ref) for a, b in zip(pa, pb))
        cropped = kv.crop(s._kv, 3)
        assert kv.length(cropped) == 3 and kv.length(kv.crop(s._kv, 0)) == 0
