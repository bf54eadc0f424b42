"""Sliding-window states are recomputed, never refused (issue 56: ``continuum serve gemma.gguf --speculate lookup``
answered 2 of 8 conversations with 400 ``StaleWindowError``).

Gemma 3 has a 512-token window. A spilled sequence's bytes hold only the window behind the sequence's end, so after a
restore a view cut back behind that end cannot be extended (``models/llamacpp/window.py``). Two fixes, one test each;
both failed before (``StaleWindowError``):

* a spill first cuts the dead tail no live view reaches (rejected drafts, a slice whose parent is gone), so the
  longest live view keeps its window: continuing it computes only its own suffix (counted);
* a slice behind a restored window is recomputed from its tokens at the call's setup.

Reference: llama-cpp-python's own evaluation of the result's ids, greedy compared where its top-2 margin exceeds the
stated Gemma tolerance (``check_greedy_path``).
"""

from __future__ import annotations

import gc

import pytest

pytest.importorskip("llama_cpp")

from continuum import continuous, generate, models, samplers

from llamacpp_support import check_greedy_path, gemma_path

STORY = ("Once upon a time, in a village by the sea, a girl named Mira kept a notebook of every ship that passed. "
         "Ship {i} was painted {c} and carried {n} barrels of apples to the northern islands. ")
COLORS = ["red", "blue", "green", "yellow", "white", "black"]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gemma():
    model = models.llamacpp(str(gemma_path()), n_ctx=4096, n_threads=2, flash_attn=False)
    assert model.llama.n_swa == 512
    return model


def _long_prompt() -> str:
    return "".join(STORY.format(i=i, c=COLORS[i % 6], n=10 + i) for i in range(22))  # ~700 tokens: past the window


def _ids(state) -> list[int]:
    return [i for i, m in zip(state._ids[0].tolist(), state._mask[0].tolist()) if m]


def test_a_spill_keeps_the_longest_live_view_extendable(gemma):
    text = continuous(generate.text(gemma, samplers.greedy()))
    s = text(_long_prompt(), max_tokens=8)
    t = s[:len(str(s)) - 40]  # its parent dropped below: the tail past t is dead
    assert len(_ids(t)) > 600
    del s
    gc.collect()
    assert gemma.pool.spill_idle() >= 1
    before = gemma.tokens_computed
    out = text(t, max_tokens=6)
    assert gemma.tokens_computed - before < 40, "t's cache was kept: only its suffix and the new tokens computed"
    check_greedy_path(_ids(out), len(_ids(t)), kind="gemma", flash_attn=False)


def test_a_slice_behind_a_restored_window_is_recomputed(gemma):
    text = continuous(generate.text(gemma, samplers.greedy()))
    s = text(_long_prompt(), max_tokens=4)
    assert gemma.pool.spill_idle() >= 1
    t = s[:len(str(s)) - 300]  # ~70 tokens behind the end the spilled bytes' window ends at
    out = text(t, max_tokens=6)
    check_greedy_path(_ids(out), len(_ids(t)), kind="gemma", flash_attn=False)
    again = text(s, max_tokens=2)  # the longer state is still fine
    check_greedy_path(_ids(again), len(_ids(s)), kind="gemma", flash_attn=False)


def test_a_row_found_stale_at_its_first_forward_is_recomputed(gemma, monkeypatch):
    """The race the setup check cannot see: a call checked while its sequence was resident, spilled (beside a longer
    view) while the call waited for admission. Its first forward finds the window gone; every row is computed again
    from the start (``CallLoop.run``), not refused. (The server saw it: 1 of 8 agent conversations, 400.)"""
    from continuum.loop import setup

    monkeypatch.setattr(setup, "recompute_stale", lambda state: state)  # as if the spill came after the setup
    text = continuous(generate.text(gemma, samplers.greedy()))
    s = text(_long_prompt(), max_tokens=4)
    assert gemma.pool.spill_idle() >= 1
    t = s[:len(str(s)) - 300]
    before = gemma.tokens_computed
    out = text(t, max_tokens=6)
    assert gemma.tokens_computed - before > len(_ids(t)), "recomputed from the start"
    check_greedy_path(_ids(out), len(_ids(t)), kind="gemma", flash_attn=False)
