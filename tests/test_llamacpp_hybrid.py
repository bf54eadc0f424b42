"""A hybrid GGUF (LFM2: short convolutions + attention) on llama.cpp: states continue, fork, slice and save exactly.

The reference is llama.cpp's own evaluation (llama-cpp-python's ``Llama`` over the same ids, one prefill, every
position's logits), within ``TOL`` (llama.cpp's logits depend on how tokens were batched); greedy paths are
compared where the reference's top-2 margin is clear of it. The fixture's weights are random (the text is noise):
exactness is the point, never quality."""

from __future__ import annotations

import jsonschema
import numpy as np
import pytest
import torch

from continuum import SequenceState, continuous, generate, models, run_batch, samplers, speculate
from continuum.errors import GeneratorArgumentError, ModelLoadError
from continuum.models import kv as kvcache

from conftest import FIXTURES

GGUF = FIXTURES / "models" / "lfm2-tiny-gguf" / "lfm2-tiny-f32.gguf"
TOL = 2e-3  # f32 weights and KV: one prefill vs the same tokens decoded in steps (measured below 1e-4)
PROMPT = "Once upon a time"

pytestmark = pytest.mark.skipif(not GGUF.exists(), reason=f"fixture {GGUF} not available")


@pytest.fixture(scope="module")
def lfm():
    return models.llamacpp(str(GGUF), n_threads=2, n_ctx=2048, n_seq_max=32)


@pytest.fixture(scope="module")
def ref():
    from continuum.models.llamacpp.amx import guarded_llama

    return guarded_llama(GGUF, 2, n_ctx=512, n_batch=512, logits_all=True, verbose=False)


def _logprobs(ref, ids: list[int]) -> np.ndarray:
    """llama.cpp's log-probs at every position of ``ids`` (row t: the distribution of token t + 1)."""
    ref.reset()
    ref.eval(ids)
    x = np.array(ref.scores[:len(ids)], dtype=np.float64)
    return x - np.log(np.exp(x - x.max(1, keepdims=True)).sum(1, keepdims=True)) - x.max(1, keepdims=True)


def _check_row(ref, state: SequenceState, row: int = 0, greedy: bool | int = True) -> int:
    """Every generated token's weight in ``state`` equals llama.cpp's log-prob of it after the ids before it, and
    (greedy: all, or the last ``greedy`` tokens) it is llama.cpp's argmax wherever the margin is clear. Returns the
    tokens checked."""
    mask = state._mask[row].bool()
    ids = state._ids[row][mask].tolist()
    lps = state._logprobs[row][mask]
    gen = (~lps.isnan()).nonzero().flatten().tolist()
    assert gen, "no generated tokens to check"
    ref_lp = _logprobs(ref, ids)
    argmax = set(gen if greedy is True else gen[-greedy:] if greedy else [])  # (tokens a greedy step chose)
    for t in gen:
        assert abs(float(lps[t]) - ref_lp[t - 1, ids[t]]) < TOL, f"token {t}: weight {float(lps[t])} vs {ref_lp[t - 1, ids[t]]}"
        top2 = np.sort(ref_lp[t - 1])[-2:]
        if t in argmax and top2[1] - top2[0] > TOL:
            assert ids[t] == int(ref_lp[t - 1].argmax())
    return len(gen)


def test_greedy_equals_transformers_generate_and_llama_cpps_evaluation(lfm, ref):
    from transformers import AutoModelForCausalLM

    out = continuous(generate.text(lfm, samplers.greedy()))(PROMPT, max_tokens=24)
    assert _check_row(ref, out) == 24
    hf = AutoModelForCausalLM.from_pretrained(str(FIXTURES / "models" / "lfm2-tiny"))
    prompt = torch.tensor([lfm.tokenizer.encode_prompts([PROMPT])[0]])
    want = hf.generate(prompt, max_new_tokens=24, do_sample=False)[0].tolist()
    assert out._ids[0][out._mask[0].bool()].tolist() == want


def test_continuing_computes_only_the_new_tokens_and_equals_one_call(lfm, ref):
    gen = continuous(generate.text(lfm, samplers.greedy()))
    one = gen(PROMPT, max_tokens=24)
    first = gen(PROMPT, max_tokens=12)
    before = lfm.tokens_computed
    second = gen(first, max_tokens=12)
    assert lfm.tokens_computed - before == 12  # the first call's last token, then 11 decoded steps
    assert list(second) == list(one)
    _check_row(ref, second)


def test_rolling_back_to_a_call_end_reuses_its_snapshot(lfm, ref):
    """Two continuations of one state: the second finds the sequence moved on, and restores the summary kept at
    the state's end (no recomputation of the history)."""
    gen = continuous(generate.text(lfm, samplers.greedy()))
    base = gen(PROMPT, max_tokens=10)
    a = gen(base + " The dog", max_tokens=8)
    restores, before = lfm.pool.restores_recurrent, lfm.tokens_computed
    b = gen(base + " A cat", max_tokens=8)
    assert lfm.pool.restores_recurrent > restores
    snaps = base._kv.views[0].seq.snaps
    assert snaps and kvcache.nbytes(base._kv) >= sum(map(len, snaps.values()))  # (its bytes count its snapshots)
    added = b._mask[0].sum().item() - base._mask[0].sum().item() - 8
    assert lfm.tokens_computed - before == added + 8  # base's last token, the added text, 7 more steps
    for s in (a, b, gen(base + " The dog", max_tokens=8)):
        _check_row(ref, s)
    assert list(gen(base + " The dog", max_tokens=8)) == list(a)


@pytest.mark.parametrize("cut", [3, 17, 30])
def test_slicing_anywhere_is_exact(lfm, ref, cut):
    gen = continuous(generate.text(lfm, samplers.greedy()))
    long = gen(PROMPT, max_tokens=30)
    text = str(long)
    back = long[:len(text) - cut]
    again = gen(back, max_tokens=10)  # (cut inside the call: recomputed from the last usable summary)
    _check_row(ref, again)  # every weight and greedy token: llama.cpp's over the sliced state's own ids


def test_a_cut_inside_a_later_call_recomputes_from_the_snapshot_before_it(lfm, ref):
    """The state after call 1 keeps a snapshot; call 2 extends its sequence; a cut inside call 2's tokens resumes
    from call 1's end: only the tokens after it are computed again."""
    gen = continuous(generate.text(lfm, samplers.greedy()))
    base = gen(PROMPT, max_tokens=10)
    long = gen(base, max_tokens=20)
    cut = long[:len(str(base)) + 4]  # (a few characters into call 2)
    before = lfm.tokens_computed
    again = gen(cut, max_tokens=5)
    kept = int(base._mask[0].sum()) - 1  # base's cached positions (its last token is never cached)
    real = int(cut._mask[0].sum())
    assert lfm.tokens_computed - before == (real - kept) + 4  # from base's end to the cut, then 4 steps
    _check_row(ref, again)


def test_forked_samples_and_beams_continue_their_own_states(lfm, ref):
    sampled = continuous(generate.text(lfm, samplers.multinomial(3)))(PROMPT, max_tokens=12,
                                                                      rng=torch.Generator().manual_seed(0))
    assert len(set(sampled)) > 1
    for r in range(3):
        _check_row(ref, sampled, r, greedy=False)
    beams = continuous(generate.text(lfm, samplers.beam_search(3)))(PROMPT, max_tokens=8)
    for r in range(3):
        _check_row(ref, beams, r, greedy=False)
    more = continuous(generate.text(lfm, samplers.beam_search(3)))(beams, max_tokens=6)
    on = continuous(generate.text(lfm, samplers.multinomial(3)))(sampled, max_tokens=6,
                                                                rng=torch.Generator().manual_seed(1))
    for r in range(3):
        _check_row(ref, more, r, greedy=False)
        _check_row(ref, on, r, greedy=False)


def test_run_batch_equals_each_program_alone(lfm):
    gen = continuous(generate.text(lfm, samplers.greedy()))
    prompts = [PROMPT, "The little dog", "One day"]
    together = run_batch(lambda p: gen(gen(p, max_tokens=6) + " and", max_tokens=6), prompts)
    for p, got in zip(prompts, together):
        assert list(got) == list(gen(gen(p, max_tokens=6) + " and", max_tokens=6))


def test_save_and_load_continue_exactly(lfm, ref, tmp_path):
    gen = continuous(generate.text(lfm, samplers.greedy()))
    s = gen(PROMPT, max_tokens=10)
    s.save(tmp_path / "s.safetensors")
    back = SequenceState.load(tmp_path / "s.safetensors", lfm)
    before = lfm.tokens_computed
    out = gen(back, max_tokens=8)
    assert lfm.tokens_computed - before == 8
    assert list(out) == list(gen(s, max_tokens=8))
    _check_row(ref, out)


@pytest.mark.parametrize("how", ["resident", "spilled"])
def test_a_loaded_state_continued_twice_is_exact(lfm, ref, tmp_path, how):
    """Found by the oracle on this GGUF: a loaded state (its sequence ends where it does, no snapshot kept) continued
    once was extended in place, and continuing it again raised BackendError "no recurrent snapshot at position 8"
    (``continuum serve`` loads every stored state). Now a call's setup snapshots each view that ends its sequence
    (``recurrent.stale``), and a restored sequence extended in place is snapshotted at its end first."""
    gen = continuous(generate.text(lfm, samplers.greedy()))
    s = gen(PROMPT, max_tokens=4)
    s.save(tmp_path / "s.safetensors")
    s = SequenceState.load(tmp_path / "s.safetensors", lfm)
    if how == "spilled":  # (then restored by the first call's decode, which extends it in place)
        with lfm.llama.lock:
            lfm.pool.spill(s._kv.views[0].seq)
    a = gen(s, max_tokens=3)
    b = gen(s + " and", max_tokens=3)
    before = lfm.tokens_computed
    c = gen(s, max_tokens=5)
    assert lfm.tokens_computed - before == 5  # (its summary kept: nothing recomputed)
    for out in (a, b, c):
        _check_row(ref, out)
    assert list(c)[0].startswith(list(a)[0])


def test_json_under_a_schema_and_choice(lfm, ref):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 8}},
              "required": ["a", "b"]}
    out = continuous(generate.json(lfm, schema, samplers.greedy()))(PROMPT + " JSON: ", max_tokens=60)
    jsonschema.validate(out.value, schema)
    # options sharing tokens: a tree node of several sequences (llama.cpp gives them one summary, copied where the
    options = [" the cat", " the dog", " the cat sat", " a"]  # paths diverge)
    ids = lfm.tokenizer.encode_prompts([PROMPT])[0]
    totals = []
    for o in options:
        cont = lfm.tokenizer.encode_continuation(o)
        lp = _logprobs(ref, ids + cont)
        totals.append(sum(lp[len(ids) - 1 + i, t] for i, t in enumerate(cont)))
    picked = continuous(generate.choice(lfm, options, samplers.greedy()))(PROMPT)
    assert picked.value == options[int(np.argmax(totals))]
    assert abs(float(picked.weights[0, 0]) - max(totals)) < TOL
    beams = continuous(generate.choice(lfm, options, samplers.beam_search(3)))(PROMPT)
    best = sorted(totals, reverse=True)
    assert all(abs(float(beams.weights[0, i]) - best[i]) < TOL for i in range(3))
    _check_row(ref, continuous(generate.text(lfm, samplers.greedy()))(picked, max_tokens=5), greedy=5)


def test_what_a_recurrent_layer_cannot_do_is_refused_clearly(lfm):
    with pytest.raises(GeneratorArgumentError, match="recurrent"):
        generate.text(lfm, samplers.greedy(), speculate=speculate.lookup())
    with pytest.raises(ModelLoadError, match="prefix_cache"):
        models.llamacpp(str(GGUF), n_threads=2, prefix_cache="16MB")


def test_recurrent_snapshots_stay_bounded_over_a_long_chain_of_calls(lfm):
    """Before: a snapshot per call end, unbounded (a long chat of many calls grew without end). Now at most
    ``MAX_SNAPSHOTS`` per sequence (as transformers keeps), and the state in hand still continues from its own end."""
    from continuum.models.llamacpp.recurrent import MAX_SNAPSHOTS

    gen = continuous(generate.text(lfm, samplers.greedy()))
    state = gen("a b c", max_tokens=2)
    for _ in range(MAX_SNAPSHOTS + 8):
        state = gen(state, max_tokens=2)
    seq = state._kv.views[0].seq
    assert len(seq.snaps) <= MAX_SNAPSHOTS
    assert gen(state, max_tokens=3)._ids.shape[1] == state._ids.shape[1] + 3


def test_under_pressure_each_program_is_what_llama_cpp_computes_alone(ref):
    """Before: a step whose later chunk found no room undid the rows an earlier chunk had committed, and on a hybrid
    that wiped their recurrent summaries (no snapshot mid-call). Now the scheduler plans each step within the pool,
    room is made before the decode, and a row about to be decoded in a multi-chunk step keeps a snapshot at its end:
    every program on a 256-cell pool (programs need ~880) gets llama.cpp's own log-probs, token by token."""
    small = models.llamacpp(str(GGUF), n_threads=2, n_ctx=256, n_seq_max=32)
    gen = continuous(generate.text(small, samplers.greedy()))
    prompts = [" ".join(f"w{i}{j}" for j in range(24)) for i in range(8)]  # (~70 tokens each: one chunk per prefill)
    got = run_batch(lambda p: gen(p, max_tokens=40), prompts)
    for state in got:
        assert _check_row(ref, state) == 40
    assert small.engine.stats()["no_room"] == 0
