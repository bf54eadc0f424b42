"""Choice scoring as a token tree: every option of a row in ONE row after its context.

Reference: a plain Hugging Face forward over the full token ids of each (row, option) pair (the
row's real tokens, then the option tokenized as ``state + option`` would be), no padding, no cache.
Checked: scores (hence choices and weights) alone and batched, rows of different lengths, holes from
slicing, options of different lengths and sharing prefixes, samples, beams, the prefix cache,
sliding-window models; the result's cache reused equals a fresh forward; the input state is unchanged;
the tree forward holds context + tree columns per row, not options x context.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from continuum import continuous, generate, models, samplers
from continuum.models import kv as kvcache
from continuum.models import token_tree

from conftest import CORPUS, assert_reuse_exact, check_unchanged, snapshot

OPTIONS = ["yes", "yes sir", "yes sir!", " no", "東京 🤗 and a much longer option", "a"]  # shared prefixes, lengths 1..10
PROMPTS = ["Q: is it?\nA:", "x", "Le café est très bon à Paris; naïve façade. Answer:"]  # different lengths: left padding


@torch.no_grad()
def reference_score(model, row_ids: list[int], option: str) -> float:
    """Sum of the option tokens' log-probs after ``row_ids``, from one plain HF forward."""
    opt = model.tokenizer.encode_continuation(option)
    ids = torch.tensor([row_ids + opt])
    lp = torch.log_softmax(model.model(input_ids=ids).logits[0].float(), -1)
    L = ids.shape[1]
    return sum(float(lp[c - 1, ids[0, c]]) for c in range(L - len(opt), L))


def real_rows(state) -> list[list[int]]:
    return [ids for ids, _ in state._real_rows()]


def all_scores(model, state, options) -> list[list[float]]:
    return [[reference_score(model, ids, o) for o in options] for ids in real_rows(state)]


def check_ranked(state, out, options, scores) -> None:
    """``out`` (beam_search(len(options)) over a 1-sample ``state``): every option, best first, weights = scores."""
    K = len(options)
    for b in range(state.batch):
        want = sorted(range(K), key=lambda k: -scores[b][k])
        got = out.value[b]
        assert sorted(got) == sorted(options)
        w = out.weights[b].tolist()
        for o, wt in zip(got, w):
            assert abs(wt - float(state.weights[b, 0]) - scores[b][options.index(o)]) < 1e-4, (o, wt)
        assert [scores[b][options.index(o)] for o in got] == pytest.approx([scores[b][k] for k in want], abs=1e-4)


def test_scores_equal_per_pair_forward_alone_and_batched(model):
    K = len(OPTIONS)
    gen = continuous(generate.choice(model, OPTIONS, samplers.beam_search(K)))
    batched_in = continuous(generate.text(model, samplers.greedy()))(PROMPTS, max_tokens=0)
    scores = all_scores(model, batched_in, OPTIONS)
    batched = gen(PROMPTS)
    check_ranked(batched_in, batched, OPTIONS, scores)
    for b, p in enumerate(PROMPTS):
        alone = gen(p)
        assert alone.value == batched.value[b]
        torch.testing.assert_close(alone.weights[0], batched.weights[b], atol=1e-4, rtol=0)
    greedy = generate.choice(model, OPTIONS, samplers.greedy())
    assert greedy(PROMPTS) == [OPTIONS[max(range(K), key=lambda k: s[k])] for s in scores]
    mean = generate.choice(model, OPTIONS, samplers.greedy(), method="mean")
    lengths = [len(model.tokenizer.encode_continuation(o)) for o in OPTIONS]
    assert mean(PROMPTS) == [OPTIONS[max(range(K), key=lambda k: s[k] / lengths[k])] for s in scores]


def test_holes_from_slicing_and_states_unchanged(model):
    g = continuous(generate.text(model, samplers.greedy()))
    s = g([CORPUS[0][:40], CORPUS[2][:25]], max_tokens=8)
    cut = s[:, :30] + [" and", " or"]  # rows cut at different token counts: holes in the cached layout
    assert bool((cut._mask[:, :kvcache.length(cut._kv)] == 0).any())
    snap = snapshot(cut)
    options = [" cat", " dog and more", " dog", "!"]
    out = continuous(generate.choice(model, options, samplers.beam_search(4)))(cut)
    check_ranked(cut, out, options, all_scores(model, cut, options))
    check_unchanged(cut, snap)  # the input state and its cache: untouched
    assert_reuse_exact(cut)
    for b in range(out.batch):
        for i in range(out.samples):  # each (row, option) pair's own cache equals a fresh forward
            assert_reuse_exact(out[b, i, :])
    assert_reuse_exact(out)


def test_result_state_continues_exactly(model):
    base = continuous(generate.text(model, samplers.greedy()))(PROMPTS, max_tokens=0)
    chosen = continuous(generate.choice(model, OPTIONS, samplers.greedy()))(base)
    assert_reuse_exact(chosen)
    assert chosen._kv is not None and kvcache.length(chosen._kv) == chosen._ids.shape[1] - 1
    text = continuous(generate.text(model, samplers.greedy()))
    more = text(chosen, max_tokens=5)
    fresh = text(list(chosen), max_tokens=5)  # the same texts from scratch
    assert more.last_text == fresh.last_text
    assert_reuse_exact(more)
    again = continuous(generate.choice(model, ["!", "?"], samplers.greedy()))(chosen)  # a second choice on top
    assert all(t.endswith(("!", "?")) for t in again)
    assert_reuse_exact(again)


def test_samples_and_beams(model):
    options = ["red", "green", "blue", "re"]
    rng = torch.Generator().manual_seed(0)
    forked = continuous(generate.text(model, samplers.multinomial(3)))(PROMPTS[:2], max_tokens=3, rng=rng)
    scores = all_scores(model, forked, options)
    snap = snapshot(forked)
    drawn = continuous(generate.choice(model, options, samplers.multinomial(3)))(forked, rng=torch.Generator().manual_seed(1))
    check_unchanged(forked, snap)
    for r in range(drawn.rows):  # each sample row drew its own option; the weight adds that option's score
        b, i = divmod(r, 3)
        o = drawn.value[b][i]
        assert abs(float(drawn.weights[b, i]) - float(forked.weights[b, i]) - scores[r][options.index(o)]) < 1e-4
    assert_reuse_exact(drawn)

    beams = continuous(generate.text(model, samplers.beam_search(3)))(PROMPTS[:2], max_tokens=2)
    scores = all_scores(model, beams, options)
    out = continuous(generate.choice(model, options, samplers.beam_search(3)))(beams)
    for b in range(beams.batch):  # the 3 best (beam, option) pairs of 3 x 4, best first
        totals = sorted(((float(beams.weights[b, i]) + scores[b * 3 + i][k], list(beams)[b * 3 + i] + options[k])
                         for i, k in itertools.product(range(3), range(len(options)))), reverse=True)[:3]
        torch.testing.assert_close(out.weights[b], torch.tensor([t for t, _ in totals]), atol=1e-4, rtol=0)
        assert list(out)[b * 3:b * 3 + 3] == [text for _, text in totals]
    assert_reuse_exact(out)


def test_prefix_cache(model):
    twin = models.Transformers(model.model, model.tokenizer, prefix_cache="4MiB")
    prefix = " ".join(CORPUS[:2]) + "\n"
    prompts = [prefix + "Question: yes or no?\nAnswer:", prefix + "Q2:"]
    options = [" yes", " no", " yes indeed", " maybe"]
    ours_gen = continuous(generate.choice(twin, options, samplers.beam_search(4)))
    ours_gen(prefix + "warm")  # the prefix blocks are cached
    reused = twin.prefix_cache.stats()["tokens_reused"]
    ours = ours_gen(prompts)
    assert twin.prefix_cache.stats()["tokens_reused"] > reused
    theirs = continuous(generate.choice(model, options, samplers.beam_search(4)))(prompts)
    assert ours.value == theirs.value
    torch.testing.assert_close(ours.weights, theirs.weights, atol=1e-4, rtol=0)
    base = continuous(generate.text(model, samplers.greedy()))(prompts, max_tokens=0)
    check_ranked(base, ours, options, all_scores(model, base, options))
    assert_reuse_exact(ours)


def test_tree_forward_holds_context_plus_options_once(model):
    """One forward of R rows (not R x K) whose new columns are the root plus the options' trie, and each
    result row's cache is the row's context plus its own option only."""
    base = continuous(generate.text(model, samplers.greedy()))(PROMPTS, max_tokens=0)
    seen = []
    forward = model.forward

    def spy(ids, mask, pos, cache, **kw):
        seen.append((tuple(ids.shape), kvcache.length(cache), kw.get("allowed") is not None))
        return forward(ids, mask, pos, cache, **kw)

    model.forward = spy
    try:
        out = continuous(generate.choice(model, OPTIONS, samplers.greedy()))(base)
    finally:
        del model.forward
    trie = len({tuple(model.tokenizer.encode_continuation(o)[:i + 1]) for o in OPTIONS
                for i in range(len(model.tokenizer.encode_continuation(o)))})
    assert seen == [((3, 1 + trie), kvcache.length(base._kv), True)]
    n = len(model.tokenizer.encode_continuation(out.value[0]))
    lead = int(base._mask[0].bool().long().argmax())
    assert kvcache.length(out[0, :]._kv) == kvcache.length(base._kv) - lead + n  # context + root + option - last token


def test_an_uncached_suffix_is_the_trees_trunk_in_the_same_forward(model):
    """``state + text`` then a choice: ONE forward (no prefill before the tree), holding each row's uncached suffix
    (its last generated token and the new text, rows of different lengths) and its options' trie; the scores equal
    the plain forward over each (row, option) pair, the chosen rows' caches a fresh forward's."""
    gen = continuous(generate.text(model, samplers.greedy()))(PROMPTS, max_tokens=3)
    cut = gen + [" Answer:", " So", " And then, the answer is"]  # different suffix lengths per row
    options = [" yes", " yes sir", " no"]
    seen = []
    forward = model.forward

    def spy(ids, mask, pos, cache, **kw):
        seen.append((kvcache.length(cache), kw.get("allowed") is not None))
        return forward(ids, mask, pos, cache, **kw)

    model.forward = spy
    try:
        out = continuous(generate.choice(model, options, samplers.beam_search(3)))(cut)
    finally:
        del model.forward
    assert seen == [(kvcache.length(cut._kv), True)]  # one forward, on the state's own cache: a token tree
    check_ranked(cut, out, options, all_scores(model, cut, options))
    for b in range(out.batch):
        assert_reuse_exact(out[b, :, :])


def test_a_tree_forward_projects_only_the_nodes_its_owner_reads(model):
    """``outputs`` (the trunk's end and the options' inner nodes): those columns' logits equal the forward that
    projects every column, the others are NaN (not computed), and the KV is the same."""
    gen = continuous(generate.text(model, samplers.greedy()))(PROMPTS, max_tokens=2) + " Answer:"
    tok, C = model.tokenizer, kvcache.length(gen._kv)
    suffix = [gen._ids[r, C:][gen._mask[r, C:].bool()].tolist() for r in range(gen.rows)]
    tree = token_tree.build([s[0] for s in suffix], gen._mask[:, :C].sum(1).tolist(),
                            [[tok.encode_continuation(o) for o in OPTIONS]] * gen.rows, gen._mask[:, :C], tok.pad_token_id,
                            trunks=[s[1:] for s in suffix])
    mask = torch.cat([gen._mask[:, :C], tree.real], 1)
    every, kv_all = model.forward(tree.ids, mask, tree.positions, gen._kv, logits="all", allowed=tree.allowed)
    some, kv_some = model.forward(tree.ids, mask, tree.positions, gen._kv, logits="all", allowed=tree.allowed,
                                  outputs=tree.outputs)
    read = tree.outputs
    assert 0 < int(read.sum()) < int(tree.real.sum())  # (the trunk and the leaves are not read)
    torch.testing.assert_close(some[read], every[read], atol=1e-5, rtol=0)
    cols = read.any(0)
    assert bool(some[:, ~cols].isnan().all())
    for (k1, v1), (k2, v2) in zip(kvcache.tensors(kv_all), kvcache.tensors(kv_some)):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)
    # logits="outputs": only the nodes read, row-major (what choice scoring normalises in place)
    compact, _ = model.forward(tree.ids, mask, tree.positions, gen._kv, logits="outputs", allowed=tree.allowed,
                               outputs=tree.outputs)
    assert compact.shape == (int(read.sum()), every.shape[-1])
    torch.testing.assert_close(compact, every[read], atol=1e-5, rtol=0)


def test_sliding_window_models(spm_tokenizer):
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = {"vocab_size": len(spm_tokenizer), "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256, "sliding_window": 4,
              "bos_token_id": spm_tokenizer.bos_token_id, "eos_token_id": spm_tokenizer.eos_token_id}
    torch.manual_seed(0)
    for hf in (MistralForCausalLM(MistralConfig(**common)),
               Qwen2ForCausalLM(Qwen2Config(use_sliding_window=True, max_window_layers=1, **common))):
        m = models.Transformers(hf.eval(), spm_tokenizer)
        base = continuous(generate.text(m, samplers.greedy()))(PROMPTS, max_tokens=0)
        out = continuous(generate.choice(m, OPTIONS, samplers.beam_search(len(OPTIONS))))(base)
        check_ranked(base, out, OPTIONS, all_scores(m, base, OPTIONS))  # options longer than the window
        assert_reuse_exact(out)
