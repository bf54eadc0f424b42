"""Hybrid and recurrent models on transformers (issue 44): LFM2 (short convolutions + attention, the ``lfm2-tiny``
fixture) and Mamba (a tiny random ``MambaConfig`` model built here), states by snapshots.

Every check compares against an independent reference: transformers' own ``generate``, or one full forward of the
model over a row's real token ids (no cache), never a recorded output.
"""

from __future__ import annotations

import pytest
import torch

from hybrid_support import LFM2, PROMPTS, assert_exact, hf_greedy, ids_of, reference_logits, scaled

pytestmark = pytest.mark.skipif(not (LFM2 / "config.json").exists(), reason="lfm2-tiny fixture absent")

from continuum import continuous, generate, run_batch, speculate
from continuum.errors import GeneratorArgumentError, RecurrentStateError
from continuum.models import Transformers
from continuum.models.hf.recurrent import HybridKV
from continuum.samplers import beam_search, greedy, multinomial
from continuum.state import SequenceState


@pytest.fixture(scope="module")
def lfm2() -> Transformers:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return Transformers(AutoModelForCausalLM.from_pretrained(LFM2), AutoTokenizer.from_pretrained(LFM2))


@pytest.fixture(scope="module")
def mamba() -> Transformers:
    from transformers import AutoTokenizer, MambaConfig, MambaForCausalLM

    tok = AutoTokenizer.from_pretrained(LFM2)  # stories260K's vocabulary (512 tokens)
    cfg = MambaConfig(vocab_size=512, hidden_size=32, state_size=8, num_hidden_layers=2, expand=2, conv_kernel=4,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    with torch.random.fork_rng():  # (a fixed initialisation without moving the global generator other tests draw from)
        torch.manual_seed(0)
        model = MambaForCausalLM(cfg)
    scaled(model, 0)
    with torch.no_grad():
        model.lm_head.weight[2] = 0  # no early </s>: greedy runs its whole length
    model.generation_config.eos_token_id = 2
    return Transformers(model.eval(), tok)


@pytest.fixture(params=["lfm2", "mamba"])
def model(request) -> Transformers:
    return request.getfixturevalue(request.param)


def test_is_hybrid(lfm2, mamba):
    assert lfm2.hybrid is not None and lfm2.hybrid.rec == (0, 2) and lfm2.hybrid.attn == (1, 3)
    assert mamba.hybrid is not None and mamba.hybrid.attn == () and not mamba.hybrid.chunked
    for m in (lfm2, mamba):  # every token depends on its context: the first token moves the last logits
        a, b = reference_logits(m, [1, 403, 407, 261, 378, 300])[-1], reference_logits(m, [1, 50, 407, 261, 378, 300])[-1]
        assert (a - b).abs().max() > 0.1


def test_greedy_equals_transformers_generate(model):
    """A batch of prompts of different lengths (left padding: rows run by padding pattern) equals transformers'
    generate on each prompt alone."""
    s = continuous(generate.text(model, greedy()))(PROMPTS, max_tokens=10)
    assert isinstance(s._kv, HybridKV)
    for r, p in enumerate(PROMPTS):
        prompt = model.tokenizer.encode_prompts([p])[0]
        assert ids_of(s, r) == hf_greedy(model, prompt, 10)


def test_continuing_computes_only_new_tokens(model):
    g = continuous(generate.text(model, greedy()))
    s = g(PROMPTS[0], max_tokens=6)
    before = model.tokens_computed
    s2 = g(s, max_tokens=5)
    assert model.tokens_computed - before == 5  # the last token (never cached) + 4 fed back
    prompt = model.tokenizer.encode_prompts([PROMPTS[0]])[0]
    assert ids_of(s2) == hf_greedy(model, prompt, 11)
    before = model.tokens_computed
    s3 = g(s2 + " and then", max_tokens=4)
    added = len(ids_of(s3)) - len(ids_of(s2)) - 4
    assert model.tokens_computed - before == added + 1 + 3  # the appended text, the last token, 3 fed back
    assert_exact(model, s3 + " more")


def test_slicing_back_to_a_call_end_recomputes_nothing(model):
    g = continuous(generate.text(model, greedy()))
    s1 = g(PROMPTS[0], max_tokens=6)
    s2 = g(s1, max_tokens=6)
    cut = s2[:len(list(s1)[0])]
    assert ids_of(cut) == ids_of(s1)
    assert cut.cached_tokens.tolist() == s1.cached_tokens.tolist() == [[len(ids_of(s1)) - 1]]
    before = model.tokens_computed
    again = g(cut, max_tokens=6)
    assert model.tokens_computed - before == 6
    assert ids_of(again) == ids_of(s2)


def test_slicing_anywhere_is_exact(model):
    g = continuous(generate.text(model, greedy()))
    s1 = g(PROMPTS[0], max_tokens=5)
    s = g(s1, max_tokens=7)
    text, end1 = list(s)[0], len(list(s1)[0])
    for k in (3, 9, end1 + 3, len(text) - 2):
        cut = s[:k]
        assert list(cut)[0] == text[:k]
        assert int(cut.cached_tokens) <= len(ids_of(cut)) - 1
        if k > end1:  # recomputed from the snapshot at the first call's end (or a later one), not from scratch
            assert int(cut.cached_tokens) >= len(ids_of(s1)) - 1
        assert_exact(model, cut)
        cont = g(cut, max_tokens=4)
        assert ids_of(cont) == hf_greedy(model, ids_of(cut), 4)


def test_batch_cut_at_different_places(model):
    """Rows cut at different columns: the summary goes back to a snapshot valid for every row (exact)."""
    g = continuous(generate.text(model, greedy()))
    s = g(g(PROMPTS, max_tokens=4), max_tokens=6)
    for k in (12, 20, 25):
        cut = s[:, :k]
        assert list(cut) == [t[:k] for t in s]
        assert_exact(model, cut)
        cont = g(cut, max_tokens=3)
        for r in range(2):
            assert ids_of(cont, r) == hf_greedy(model, ids_of(cut, r), 3)


def test_forked_samples_and_beams_continue_their_own_states(model):
    g = continuous(generate.text(model, greedy()))
    base = g(PROMPTS[0], max_tokens=4)
    rng = torch.Generator().manual_seed(3)
    forks = continuous(generate.text(model, multinomial(3)))(base, max_tokens=5, rng=rng)
    assert forks.shape == (1, 3)
    for r in range(3):  # each sample alone, continued from its own state
        one = forks[0, r, :]
        assert ids_of(one) == ids_of(forks, r)
        assert ids_of(g(one, max_tokens=4)) == hf_greedy(model, ids_of(forks, r), 4)
    cont = continuous(generate.text(model, multinomial(3)))(forks, max_tokens=3, rng=rng)  # all three at once
    assert_exact(model, cont + " x")
    beams = continuous(generate.text(model, beam_search(2)))(base, max_tokens=4)
    assert_exact(model, beams + " y")


def test_run_batch_equals_each_program_alone(model):
    g = continuous(generate.text(model, greedy()))

    def program(prompt):
        s = g(prompt, max_tokens=5)
        return ids_of(g(s + " then", max_tokens=4))

    alone = [program(p) for p in PROMPTS + ["A cat"]]
    assert run_batch(program, PROMPTS + ["A cat"], concurrency=3) == alone


def test_save_load_continues_exactly(model, tmp_path):
    g = continuous(generate.text(model, greedy()))
    s = g(PROMPTS[1], max_tokens=6)
    s.save(tmp_path / "s.safetensors")
    loaded = SequenceState.load(tmp_path / "s.safetensors", model)
    assert isinstance(loaded._kv, HybridKV) and loaded.cached_tokens.tolist() == s.cached_tokens.tolist()
    before = model.tokens_computed
    a = g(loaded, max_tokens=5)
    assert model.tokens_computed - before == 5
    assert ids_of(a) == ids_of(g(s, max_tokens=5))


def test_json_under_a_schema(model):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "maximum": 99}},
              "required": ["ok", "n"]}
    s = continuous(generate.json(model, schema, greedy()))(PROMPTS[0] + ": ", max_tokens=40)
    value = s.value
    assert set(value) == {"ok", "n"}
    assert_exact(model, s + " ok")


def test_refusals_are_clear(lfm2):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with pytest.raises(RecurrentStateError, match="prefix_cache"):
        Transformers(AutoModelForCausalLM.from_pretrained(LFM2), AutoTokenizer.from_pretrained(LFM2),
                     prefix_cache="1MiB")
    state = continuous(generate.text(lfm2, greedy()))(PROMPTS[0], max_tokens=3)
    kv, C = state._kv, state._kv.length()
    mask = state._mask.clone()
    mask[0, C - 2] = 0  # a cached token masked out behind the summary's back (what a rejected draft would do)
    with pytest.raises(RecurrentStateError, match="cannot forget a token"):
        lfm2.forward_now(state._ids[:, C:], mask, (mask.cumsum(1) - 1)[:, C:], kv)
    with pytest.raises(GeneratorArgumentError, match="recurrent"):  # (refused before any draft is rejected)
        continuous(generate.text(lfm2, greedy(), speculate=speculate.lookup()))(state, max_tokens=3)


def test_choice_scores_exactly(model):
    """Choice scoring's token tree runs level by level on a recurrent model: each option's score is its log-prob
    after the context in one fresh forward, greedy picks the best, beams the best pairs, and the chosen states
    continue exactly."""
    s = continuous(generate.text(model, greedy()))(PROMPTS, max_tokens=3)
    options = [" happy", " sad", " happy dog", " x"]
    scores = []
    for r in range(2):
        ctx, row = ids_of(s, r), []
        for o in options:
            ids = model.tokenizer.encode_continuation(o)
            lp = torch.log_softmax(reference_logits(model, ctx + ids), -1)
            row.append(sum(float(lp[len(ctx) - 1 + i, t]) for i, t in enumerate(ids)))
        scores.append(row)
    for sampler in (greedy(), beam_search(2)):
        out = continuous(generate.choice(model, options, sampler))(s)
        picked = [[options.index(list(out)[b * out.samples + i][len(list(s)[b]):]) for i in range(out.samples)]
                  for b in range(2)]
        for b in range(2):
            assert picked[b] == sorted(range(4), key=lambda k: -scores[b][k])[:out.samples]  # the best, best first
            for i, k in enumerate(picked[b]):
                gain = float(out.weights[b, i] - s.weights[b, 0])
                assert abs(gain - scores[b][k]) < 1e-3
        assert_exact(model, out + " z")


def test_chat_turns_compute_only_new_tokens(lfm2):
    """A chat re-renders its history every turn: the reply's end and the prompt's end are snapshots, so each turn
    computes its own tokens only, and the state stays exact."""
    from continuum.chat import Chat

    template = ("{% for message in messages %}{{ message['role'][0] + ':\\n' + message['content'] + '\\n' }}{% endfor %}"
                "{% if add_generation_prompt %}{{ 'a:\\n' }}{% endif %}")
    reply = generate.regex(lfm2, r"[a-z]{1,4}( [a-z]{1,4}){1,3}\.", greedy())
    chat = Chat(lfm2, template=template)
    length = 0
    for user in ("Tell me about the dog", "What did the cat say", "Where is the ship"):
        chat = chat.user(user)
        before = lfm2.tokens_computed
        chat = chat.reply(reply, max_tokens=16)
        total = len(ids_of(chat.state))
        # this turn's tokens, and the previous turn's last one (never cached, on any model): nothing before it
        assert lfm2.tokens_computed - before <= total - length + 1
        length = total
    assert_exact(lfm2, chat.state + "\nu:\nmore")


def test_other_state_operations_stay_exact(model):
    """stop strings, one row selected, state + state, text + state, CFG (stacked and narrowed KVs), token healing,
    stacking states, beams continued by beams: every result's KV reproduces a fresh forward."""
    g = continuous(generate.text(model, greedy()))
    s = g(PROMPTS, max_tokens=6)
    results = [g(s, max_tokens=10, stop_at=["a", "e"]), s[1, :], s[0, :] + s[1, :], "Hello " + s[0, :],
               continuous(generate.text(model, greedy(), guidance_scale=2.0, negative_prompt="bad"))(s, max_tokens=4),
               continuous(generate.text(model, greedy(), token_healing=True))(s + " the", max_tokens=4),
               SequenceState.stack([s[0, :], g(s[1, :], max_tokens=3)])]
    beams = continuous(generate.text(model, beam_search(3)))
    results.append(beams(beams(s, max_tokens=4), max_tokens=3))
    for r in results:
        assert_exact(model, r + " z")



def test_snapshot_interval(lfm2):
    """``model.snapshot_interval = N`` keeps a summary every N decoded columns: a cut in the middle of a long
    generation recomputes fewer than about N tokens, exactly."""
    g = continuous(generate.text(lfm2, greedy()))
    lfm2.snapshot_interval = 4
    try:
        s = g(PROMPTS[0], max_tokens=24)
    finally:
        lfm2.snapshot_interval = None
    columns = [snap.column for snap in s._kv.snaps if snap.every]
    assert len(columns) >= 4 and all(b - a >= 4 for a, b in zip(columns, columns[1:]))
    text = list(s)[0]
    for k in (len(text) // 2, len(text) * 2 // 3):
        cut = s[:k]
        kept = len(ids_of(cut))
        assert kept - 1 - int(cut.cached_tokens) <= 5  # at most the interval (+ the uncached last token) recomputed
        assert_exact(lfm2, cut)


def test_rows_that_finish_early_keep_their_states(model):
    """A row stopped early is fed pads while the others decode: it runs in the same forward (its summary put back
    after it), and every row ends as it would alone, exactly."""
    g = continuous(generate.text(model, greedy()))
    free = g(PROMPTS, max_tokens=10)
    text0, text1 = (t[len(p):] for t, p in zip(free, PROMPTS))
    stop = next(text0[i:i + 2] for i in range(2, len(text0) - 1) if text0[i:i + 2] not in text1)
    s = g(PROMPTS, max_tokens=10, stop_at=stop)
    assert list(s)[0].endswith(stop) and len(list(s)[0]) < len(list(free)[0]) and list(s)[1] == list(free)[1]
    for r, p in enumerate(PROMPTS):
        assert list(g(p, max_tokens=10, stop_at=stop))[0] == list(s)[r]
    assert_exact(model, s + " z")


def test_a_servers_store_keeps_a_hybrid_state_across_a_graceful_restart(model, tmp_path):
    """A hybrid's KV (recurrent snapshots) has no columns to cut into a stored part: the server's store keeps its
    tokens, and at shutdown saves the states in memory whole beside their parts (serve/sidecars.py). Opened again, the
    store gives the state back with its KV: continuing computes only the new tokens and equals the unsaved state's
    continuation."""
    from continuum.serve.store import Store

    g = continuous(generate.text(model, greedy()))
    s = g("Once upon a time", max_tokens=6)
    store = Store(tmp_path, model, memory_bytes=1 << 30, max_age=None, max_bytes=None)
    store.put("r1", "me", {"id": "r1", "object": "continuum.state", "created": 1.0}, [], s)
    assert store.save_resident() == 1
    store.close()
    again = Store(tmp_path, model, memory_bytes=1 << 30, max_age=None, max_bytes=None)
    back = again.state(again.get("r1", "me"))
    before = model.tokens_computed
    got = g(back, max_tokens=4)
    assert model.tokens_computed - before == 4  # (only the new tokens: a state from its parts computes all 4 + 6 + prompt)
    assert torch.equal(got.token_ids, g(s, max_tokens=4).token_ids)
    again.close()
