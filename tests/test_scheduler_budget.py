"""A KV budget on transformers (``models.transformers(..., kv_budget=...)``, continuum/loop/scheduler.py, room.py): calls
beyond it wait or run in parts, never fail, and only what can never fit is refused; the budget counts the step as it is
laid out; guidance calls go through the same admission. References as in tests/test_scheduler.py: each call alone.
"""

from __future__ import annotations

import threading

import pytest
import torch
from test_scheduler import PROMPTS, solo_and_concurrent

from continuum import continuous, generate, samplers
from continuum.errors import KVCacheFullError


def test_a_kv_budget_on_transformers_bounds_the_running_calls_and_refuses_only_what_never_fits(gpt2_model):
    """``models.transformers(..., kv_budget=...)``: run_batch beyond the budget completes, each program equal to
    itself alone, the running calls' KV (each at its longest) never above the budget; a call that alone would
    exceed it is refused before anything runs, and the model works after."""
    from continuum import models, run_batch
    from continuum.errors import KVCacheFullError
    from continuum.models.memory import kv_bytes

    one = kv_bytes(gpt2_model, len(gpt2_model.tokenizer.encode_prompts([PROMPTS[0]])[0]) + 8)
    budget = int(2.5 * one)
    model = models.Transformers(gpt2_model.model, gpt2_model.tokenizer, kv_budget=budget)
    assert model.engine.max_kv_bytes == budget
    gen = generate.text(model, samplers.greedy())
    alone = [gen(p, max_tokens=8) for p in PROMPTS]
    model.engine.reset_stats()
    assert run_batch(lambda p: gen(p, max_tokens=8), PROMPTS * 2) == alone * 2
    assert 0 < model.engine.stats()["peak_running_kv_bytes"] <= budget
    with pytest.raises(KVCacheFullError, match="kv_budget"):
        gen(PROMPTS[0], max_tokens=500)
    assert gen(PROMPTS[0], max_tokens=8) == alone[0] and model.engine.stats()["running_kv_bytes"] == 0
    with pytest.raises(ValueError, match="kv_budget"):
        models.Transformers(gpt2_model.model, gpt2_model.tokenizer, kv_budget="lots")



def test_a_list_call_beyond_the_kv_budget_runs_in_parts_and_only_beams_that_never_fit_are_refused(gpt2_model):
    """Nothing refused that fits: six prompts on a budget of 2.5 rows were refused as one list call
    (``KVCacheFullError``) while run_batch of the same programs ran. Now the prompts run in parts (each equal to the
    prompt alone, the running KV within the budget), a fresh ``multinomial(6)`` draws its samples in groups (each
    sample's weight the log-prob a fresh forward gives its tokens), and only a prompt's beams, which advance together,
    are refused."""
    from continuum import models
    from continuum.models.memory import kv_bytes

    tok = gpt2_model.tokenizer
    one = kv_bytes(gpt2_model, max(len(ids) for ids in tok.encode_prompts(PROMPTS)) + 8)
    model = models.Transformers(gpt2_model.model, tok, kv_budget=int(2.5 * one))
    text = continuous(generate.text(model, samplers.greedy()))
    alone = [text(p, max_tokens=8) for p in PROMPTS]
    model.engine.reset_stats()
    together = text(PROMPTS, max_tokens=8)
    assert list(together) == [str(a) for a in alone]
    for b, a in enumerate(alone):
        assert abs(float(together.weights[b, 0]) - float(a.weights[0, 0])) < 1e-4
    assert 0 < model.engine.stats()["peak_running_kv_bytes"] <= model.kv_budget
    draws = continuous(generate.text(model, samplers.multinomial(6)))(PROMPTS[0], max_tokens=8,
                                                                     rng=torch.Generator().manual_seed(0))
    assert draws.samples == 6
    n = len(tok.encode_prompts([PROMPTS[0]])[0])
    for i in range(6):
        ids = draws.token_ids[i][draws.attention_masks[i].bool()]
        with torch.no_grad():
            lp = torch.log_softmax(gpt2_model.model(ids[None]).logits[0].float(), -1)
        ref = sum(float(lp[j - 1, ids[j]]) for j in range(n, len(ids)))
        assert abs(float(draws.weights[0, i]) - ref) < 1e-4
    with pytest.raises(KVCacheFullError, match="beams"):
        generate.text(model, samplers.beam_search(4))(PROMPTS[0], max_tokens=8)
    assert text(PROMPTS[0], max_tokens=8).value == alone[0].value


def test_a_kv_budget_counts_the_step_as_it_is_laid_out(gpt2_model):
    """One long document decoding, then ten short calls: each short call at its own length fits the budget beside it,
    but the decode step holds every row as long as the longest (one slab). Before, all ten joined the long call (11
    rows as long as the document: ~3.7x the budget); now at most two do while it runs (the slab, rows x the longest,
    fits). Results equal each call alone."""
    import time

    from continuum import models
    from continuum.models.memory import kv_bytes

    tok = gpt2_model.tokenizer
    long_doc = " ".join(f"w{i}" for i in range(25))  # (the tiny model has 256 positions)
    short = [f"Hi {i}" for i in range(10)]
    budget = 3 * kv_bytes(gpt2_model, len(tok.encode_prompts([long_doc])[0]) + 150)  # the long call and two short ones
    model = models.Transformers(gpt2_model.model, gpt2_model.tokenizer, kv_budget=budget)
    gen = generate.text(model, samplers.greedy())
    alone = [gen(long_doc, max_tokens=150)] + [gen(p, max_tokens=4) for p in short]
    model.engine.reset_stats()
    out: dict[int, str] = {}

    def run(i: int):
        out[i] = gen(long_doc, max_tokens=150) if i == 0 else gen(short[i - 1], max_tokens=4)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(11)]
    threads[0].start()
    while not model.engine.stats()["running_calls"]:  # (the long call decodes; the short ones arrive beside it)
        time.sleep(0.001)
    for t in threads[1:]:
        t.start()
    for t in threads:
        t.join(60)
    assert [out[i] for i in range(11)] == alone
    stats = model.engine.stats()
    assert stats["peak_rows"] <= 3 and stats["peak_running_kv_bytes"] <= budget, stats


def test_a_slab_is_laid_out_again_when_its_long_call_leaves():
    """models/hf/merge.plan: a slab keeps the width of the longest call that was in it; when that call leaves (one dead
    row among eight live ones: few enough to keep the slab), the short calls still decoding in it are laid out again at
    their own width, else every row pays the long call's columns, which the kv_budget's count (Scheduler.slab_bytes)
    prices at the live calls' width. The layout is checked on merge.plan itself: which slab, how many columns."""
    from continuum.models.hf import merge
    from continuum.models.hf.slab import Slab, SlabView
    from continuum.models.hf.tensorkv import TensorKV
    from continuum.models.request import Request

    slab = Slab(layers=1, rows_cap=12, cols_cap=400)
    slab.keys[0], slab.values[0] = torch.zeros(12, 1, 400, 2), torch.zeros(12, 1, 400, 2)
    slab.end, slab.rows_used = 300, 9  # row 0: the long call (300 columns), gone; rows 1-8: calls of 10 columns

    def short(row: int, width: int) -> Request:
        return Request(ids=torch.ones(1, 1, dtype=torch.long), mask=torch.ones(1, width + 1, dtype=torch.long),
                       pos=torch.full((1, 1), width), kv=TensorKV(SlabView((slab, row, 1, slab.end - width), width)))

    p = merge.plan([short(r, 10) for r in range(1, 9)], layers=1)
    assert p.slab is not slab and p.fresh and p.cached == 10  # laid out again at the calls' own width
    p = merge.plan([short(r, 250) for r in range(1, 9)], layers=1)
    assert p.slab is slab and not p.fresh and p.cached == 300  # (a slab about as wide as its calls is kept: no copy)


@pytest.mark.parametrize("mode", ["batched", "sequential"])
def test_guidance_calls_go_through_admission(gpt2_model, mode):
    """Issue 56: classifier-free guidance's loop ran in its caller's thread, its forwards one-off requests, so its
    call was never admitted: three CFG calls on a 2-row bound ran all at once (6 rows in one forward). Now both
    branches' forwards are the call's own requests: a call of 1 prompt counts 2 rows, so they run one at a time
    (no forward holds more than 2 rows), each result as alone."""
    sched = gpt2_model.scheduler
    old = sched.max_rows
    gen = generate.text(gpt2_model, samplers.greedy(), guidance_scale=2.0, negative_prompt="The cat", cfg_mode=mode)
    jobs = [lambda p=p: gen(p, max_tokens=6) for p in PROMPTS[:3]]
    sizes: list[int] = []
    real_run = gpt2_model._run

    def spy(ids, mask, pos, past, logits, allowed=None, outputs=None):
        sizes.append(ids.shape[0])
        return real_run(ids, mask, pos, past, logits, allowed, outputs)

    sched.max_rows = 2
    gpt2_model._run = spy
    try:
        solo, together, _ = solo_and_concurrent(gpt2_model, jobs)
    finally:
        sched.max_rows = old
        del gpt2_model._run
    assert together == solo
    assert max(sizes) <= 2, sizes
