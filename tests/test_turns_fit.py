"""Nothing refused that fits (issue 56): calls too wide for one step or one pool run in parts, not fail.

Each test failed before its fix, on llama.cpp (the f32 fixture, small pools):
* a choice of 24 prompts x 10 labels needed 264 sequence ids at once (``SequencesExhaustedError``): choice scoring
  now splits into parts by ids, cells and ``max_rows``, and each pick is llama.cpp's own best option;
* 2 prompts x ``multinomial(8)`` x 100 tokens on 1,024 cells (``KVCacheFullError`` after the work): a prompt's
  samples are priced as the prompt once plus samples x new tokens, so the two prompts run as two parts;
* a call wider than the engine's ``max_rows`` ran only alone, holding later calls behind all of it: its parts are
  submitted as earlier ones end, so later calls are admitted between them.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

pytest.importorskip("llama_cpp")
import numpy as np

from continuum import continuous, generate, models, samplers

from llamacpp_support import CROSS_TOL, DECODE_TOL, check_greedy_path, gguf, reference_logits


def _model(**options):
    return models.llamacpp(str(gguf("f32")), n_threads=2, **options)


def _ids(state, r: int) -> list[int]:
    return [i for i, m in zip(state._ids[r].tolist(), state._mask[r].tolist()) if m]


def test_a_choice_wider_than_the_sequence_ids_scores_in_parts_and_picks_the_best():
    model = _model(n_ctx=1024)
    labels = [f" label{i}" for i in range(10)]  # 24 rows x (1 + 10 leaves) > 256 sequence ids
    prompts = [f"Prompt number {i} is here:" for i in range(24)]
    out = continuous(generate.choice(model, labels))(prompts)
    assert out.batch == 24
    checked = 0
    for r, prompt in enumerate(prompts):
        base = continuous(generate.text(model))(prompt, max_tokens=0)  # the prompt's ids, as the choice saw them
        scores = []
        for label in labels:
            full = _ids(base + label, 0)
            n = len(_ids(base, 0))
            logits = reference_logits("f32", full)
            lp = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)
            scores.append(sum(float(lp[c - 1, full[c]]) for c in range(n, len(full))))
        ranked = sorted(scores, reverse=True)
        if ranked[0] - ranked[1] > 10 * CROSS_TOL:  # llama.cpp's logits depend on the batch's composition
            assert out.value[r] == labels[int(np.argmax(scores))], (r, out.value[r], scores)
            checked += 1
    assert checked >= 12


def test_samples_of_two_prompts_are_priced_by_the_prompt_once():
    model = _model(n_ctx=1024)  # each prompt + 8 samples x 100 tokens fits (~810 cells); both at once do not
    gen = continuous(generate.text(model, samplers.multinomial(8)))
    prompts = ["Once upon a time there was", "A dog and a cat went"]
    a = gen(prompts, max_tokens=100, rng=torch.Generator().manual_seed(1))
    assert a.batch == 2 and a.samples == 8
    b = gen(prompts, max_tokens=100, rng=torch.Generator().manual_seed(1))
    assert torch.equal(a._ids, b._ids), "a seeded call in parts is reproducible (each part seeded from the caller's rng)"


def test_a_call_wider_than_max_rows_lets_later_calls_in_between_its_parts():
    model = _model(n_ctx=2048)
    model.engine.max_rows = 8
    big_gen, small_gen = generate.text(model, samplers.greedy()), generate.text(model, samplers.greedy())
    ended: dict[str, float] = {}

    def big():
        out = big_gen([f"Story {i}: once" for i in range(24)], max_tokens=60)  # 24 rows: 3 parts of 8, one at a time
        ended["big"] = time.perf_counter()
        assert len(out) == 24

    def small(i: int):
        small_gen(f"Tiny {i}:", max_tokens=4)
        ended[f"small{i}"] = time.perf_counter()

    threads = [threading.Thread(target=big)] + [threading.Thread(target=small, args=(i,)) for i in range(2)]
    threads[0].start()
    deadline = time.time() + 60
    while not model.engine.stats()["running_calls"] and time.time() < deadline:  # (sent while the first part runs)
        time.sleep(0.001)
    for t in threads[1:]:
        t.start()
    for t in threads:
        t.join(120)
    assert len(ended) == 3
    assert ended["small0"] < ended["big"] and ended["small1"] < ended["big"], ended


def test_setups_that_arrive_together_on_a_small_pool_take_turns():
    """Six prefills of ~100 tokens arriving together on 256 cells, nothing else running: before, every one-off request
    of the step was let in 'alone' at once (600 tokens in 256 cells: "no free KV cell"). Now the first runs, the
    others wait for room (earlier results, idle, are spilled); each state then continues as llama.cpp says."""
    model = _model(n_ctx=256)
    gen = continuous(generate.text(model, samplers.greedy()))
    prompts = [" ".join(f"word{i}x{j}" for j in range(15)) for i in range(6)]
    barrier, out, errors = threading.Barrier(6), {}, []

    def setup(i: int):
        barrier.wait()
        try:
            out[i] = gen(prompts[i], max_tokens=0)
        except Exception as exc:  # noqa: BLE001  (collected: the assertion names it)
            errors.append(exc)

    threads = [threading.Thread(target=setup, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors[0]
    for i in range(6):
        n = len(_ids(out[i], 0))
        assert 80 < n < 128
        check_greedy_path(_ids(gen(out[i], max_tokens=3), 0), n)


def test_programs_on_a_small_pool_all_complete():
    """text -> choice -> JSON programs on 512 cells (384 asked: llama.cpp rounds up), 64 at once: before, 10 of 128
    failed with "llama.cpp has no free KV cell" in one run of four (the step's one-offs let in together, the test
    above, deterministic); now all complete, every run."""
    import continuum

    model = _model(n_ctx=384)
    text = continuous(generate.text(model, samplers.greedy()))
    pick = continuous(generate.choice(model, [" happy", " sad", " brave"]))
    card = continuous(generate.json(model, {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 5}, "age": {"type": "integer", "maximum": 99}},
        "required": ["name", "age"]}, samplers.greedy()))

    def program(i: int):
        s = text(f"Story {i}: Once upon a time, a child named", max_tokens=24)
        c = pick(s + " The child felt")
        return c.value, card(c + ". As JSON:", max_tokens=80).value

    out = continuum.run_batch(program, list(range(128)), concurrency=64, return_exceptions=True)
    errors = [r for r in out if isinstance(r, BaseException)]
    assert not errors, f"{len(errors)} of 128 failed, e.g. {errors[0]!r}"
    assert all(v in (" happy", " sad", " brave") and set(j) == {"name", "age"} for v, j in out)


def test_samples_with_cells_of_their_own_run_as_parts_on_a_small_pool():
    """(Found by the long oracle.) 2 prompts x 3 samples, each sample holding ~45 cells of its own after the shared
    prompt (``state + state`` appends to every row; the rows' tokens are the same, their cells are not): priced as
    one prompt's width plus the new tokens they ran as one call on a 256-cell pool, needed ~258 cells and failed
    with ``KVCacheFullError``. Priced by their tokens, the prompts run as parts; every row continues its own input,
    each new token's log-prob what llama.cpp gives for that row alone."""
    model = _model(n_ctx=256)
    gen = continuous(generate.text(model, samplers.multinomial(3)))
    s = gen(["item 3: once upon a time", "Once upon a time"], max_tokens=0, rng=torch.Generator().manual_seed(0))
    assert (s.batch, s.samples) == (2, 3)
    s = s + s + s + s + s[..., :24]
    inp = s + " ok?"
    cells = inp._mask.sum(1).view(2, 3).sum(1).tolist()  # (each row's cells its own but the prompt's)
    assert sum(cells) + 6 * 6 > 256 and max(cells) + 3 * 6 < 256  # one call cannot fit, each prompt's part can
    out = gen(inp, max_tokens=6, rng=torch.Generator().manual_seed(94))
    assert (out.batch, out.samples) == (2, 3)
    for r in range(out.rows):
        before, after = _ids(inp, r), _ids(out, r)
        assert after[:len(before)] == before and len(after) > len(before)
        logits = reference_logits("f32", after)
        lp = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)
        got = out.token_logprobs[r][out._mask[r].bool()][len(before):]
        want = [float(lp[c - 1, after[c]]) for c in range(len(before), len(after))]
        np.testing.assert_allclose(got.numpy(), want, atol=DECODE_TOL["f32"])


def test_a_choice_on_samples_of_several_prompts_scores_in_parts():
    """A choice on 2 prompts x 3 samples whose trees do not fit a 256-cell pool together scores the prompts as parts
    (each part sliced ``state[b, :, :]``: a multi-sample state takes three indices, the two-index form raised
    SlicingError); a row's draw is one of the options, and the weights are llama.cpp's own log-probs of it."""
    model = _model(n_ctx=256)
    s = continuous(generate.text(model, samplers.multinomial(3)))(["The cat", "Once upon a time"], max_tokens=4,
                                                                   rng=torch.Generator().manual_seed(3))
    labels = [f" label number {i}" for i in range(8)]
    out = continuous(generate.choice(model, labels, samplers.multinomial(3)))(s + " is", rng=torch.Generator().manual_seed(0))
    assert (out.batch, out.samples) == (2, 3)
    checked = 0
    for r in range(out.rows):
        base = _ids(s + " is", r)
        scores = []
        for label in labels:
            full = _ids((s + " is" + label), r)
            logits = reference_logits("f32", full)
            lp = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)
            scores.append(sum(float(lp[c - 1, full[c]]) for c in range(len(base), len(full))))
        picked = out.value[r // 3][r % 3]
        gain = float(out.weights.flatten()[r] - s.weights.flatten()[r])
        assert abs(gain - scores[labels.index(picked)]) <= 4 * DECODE_TOL["f32"]
        checked += 1
    assert checked == 6


def test_beam_calls_on_several_prompts_run_in_parts_of_whole_prompts():
    """6 prompts x beam_search(4) on a 15-id pool: refused before (``SequencesExhaustedError``: beam calls were never
    split), now in parts of whole prompts (a prompt's beams advance together). In the batch-invariant mode each
    prompt's beams equal its beams alone, and each beam's weight is the log-prob llama-cpp-python gives its tokens."""
    model = _model(n_ctx=1024, n_seq_max=16, batch_invariant=True)
    prompts = [f"Story {i}: once upon a time" for i in range(6)]
    beams = continuous(generate.text(model, samplers.beam_search(4)))
    together = beams(prompts, max_tokens=6)
    assert together.batch == 6 and together.samples == 4
    for b, prompt in enumerate(prompts):
        alone = beams(prompt, max_tokens=6)
        n = len(model.tokenizer.encode_prompts([prompt])[0])
        for i in range(4):
            row = b * 4 + i
            assert _ids(together, row) == _ids(alone, i)
            assert float(together.weights[b, i]) == float(alone.weights[0, i])
            ids = _ids(alone, i)
            logits = reference_logits("f32", ids)
            lp = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)
            ref = sum(float(lp[c - 1, ids[c]]) for c in range(n, len(ids)))
            assert abs(float(alone.weights[0, i]) - ref) < DECODE_TOL["f32"]


def test_choice_trees_that_hold_every_sequence_id_together_run_one_at_a_time():
    """8 choices at once, each on a 2-row state, on a pool of 16 sequence ids: the 16 rows hold every id, so no tree
    could fork its leaves beside the others, and every step failed them all and put them back: a hang (seen on the
    LFM2 GGUF, ~1 run in 8, when a split choice's parts met in one step). Now one-offs that find no room together
    run one at a time (``loop/room.py``), each pick llama.cpp's best option."""
    model = _model(n_ctx=1024, n_seq_max=16)
    text = continuous(generate.text(model, samplers.greedy()))
    states = [text([f"Story {i}: once upon a time", f"Tale {i}: the dog"], max_tokens=4) for i in range(8)]
    options = [" a", " b", " c", " d", " e"]
    pick = continuous(generate.choice(model, options))
    barrier, results, errors = threading.Barrier(8), [None] * 8, []
    forward, meet = model.engine.forward, threading.Barrier(8)

    def together(ids, mask, pos, kv, logits, reserve, allowed=None, outputs=None):
        if allowed is not None:  # (the eight trees reach the engine's inbox at once: one step, as the race had it)
            meet.wait(timeout=30)
        return forward(ids, mask, pos, kv, logits, reserve, allowed, outputs)

    model.engine.forward = together

    def run(i: int) -> None:
        barrier.wait(timeout=30)
        try:
            results[i] = pick(states[i])
        except BaseException as exc:  # noqa: BLE001  (re-raised below)
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(8)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    for t in threads:
        t.join(timeout=max(0.1, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), "the choices hung"
    assert not errors, errors
    for state, out in zip(states, results):
        for r in range(2):
            base = _ids(state, r)
            scores = []
            for o in options:
                full = _ids(state + o, r)
                logits = reference_logits("f32", full)
                lp = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)
                scores.append(sum(float(lp[c - 1, full[c]]) for c in range(len(base), len(full))))
            ranked = sorted(scores, reverse=True)
            if ranked[0] - ranked[1] > 10 * CROSS_TOL:
                assert out.value[r] == options[int(np.argmax(scores))]
