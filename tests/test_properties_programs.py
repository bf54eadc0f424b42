"""Property tests of the ``SequenceState`` algebra and the non-negotiable invariants (issue 3): random programs.

For both tiny GPT-2 (absolute positions, byte-level BPE) and tiny Llama (RoPE, SentencePiece with
byte fallback), random programs of generate / slice / add text / add states / prepend / select rows /
fork / continue check after every step that

1. reuse never changes results: the next-token logits computed through the state's KV cache equal a
   fresh, cache-less forward pass over ``state.token_ids`` (1e-4, fp32);
2. immutability: no operation changes the tensors (ids, mask, log-probs, weights, every KV tensor)
   of any state built before it, and continuing the same state twice gives the same result;
3. only the uncached suffix is computed: the suffix is exactly as wide as the longest per-row
   uncached run, generated states cache all but their last token, and a continuation computes
   ``rows x suffix`` positions for the prefill plus one column per further step;
4. ``weights`` equal the sum of the raw log-probs of the generated tokens, recomputed by a fresh
   forward pass (1e-3), for states built by generating, forking, continuing, slicing and ``+ text``;
   after ``state + state`` / ``"text" + state`` the operands' weights are carried on top.

Text is drawn from fragments and small alphabets with accents, CJK and emoji, so multi-byte
characters are split across byte-level BPE / byte-fallback tokens (and random models emit
incomplete UTF-8, decoded as U+FFFD). The text algebra on its own: ``test_properties_text.py``; what a
continuation computes, with explicit counts: ``test_properties_compute.py``; shared pieces: ``properties_support.py``.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import event, given, note, settings
from hypothesis import strategies as st

import continuum
from continuum import SequenceState, continuous, generate, samplers
from continuum.errors import ContextLengthError, GeneratorArgumentError
from continuum.models import kv as kvcache
from continuum.state.text import longest_token_prefix

from conftest import chars_key, check_unchanged, count_forward_tokens, snapshot
from properties_support import (
    SETTINGS,
    _one_thread,  # noqa: F401  (autouse: one intra-op thread for this module)
    added_text_ok,
    check_reuse,
    check_suffix,
    check_truncation_weight,
    expected_slice_weights,
    fresh_logits,
    greedy_c,
    row_lengths,
    slice_text_ok,
    texts,
    token_char_spans,
    uncached,
)


# ---------------------------------------------------------------------------------- checks
def check_views(state: SequenceState) -> None:
    """A state's per-row views (real tokens and log-probs, texts, cached counts: memoised, and handed on from a call's
    finish and a joint call's result to its callers) are what its own tensors say, decoded by the tokenizer."""
    ids, mask, lps = state._ids.tolist(), state._mask.tolist(), state._logprobs.tolist()
    C = kvcache.length(state._kv)
    for r, ((got_ids, got_lps), text, cached) in enumerate(zip(state._real_rows(), state.texts, state._cached_real())):
        want = [i for i, m in zip(ids[r], mask[r]) if m]
        assert got_ids == want, f"row {r}: real tokens {got_ids} but the tensors hold {want}"
        assert [x if x == x else None for x in got_lps] == [x if x == x else None for x, m in zip(lps[r], mask[r]) if m]
        assert text == state._model.tokenizer.decode(want), f"row {r}: text {text!r} is not its tokens decoded"
        assert cached == sum(mask[r][:C]), f"row {r}: {cached} cached tokens, the mask says {sum(mask[r][:C])}"


def recomputed_logprobs(state: SequenceState, fresh: torch.Tensor) -> torch.Tensor:
    """Per row, the sum of fresh raw log-probs of the tokens whose ``token_logprobs`` is not NaN
    (also checks each stored log-prob against its recomputation)."""
    lsm = torch.log_softmax(fresh, dim=-1)
    ids, mask, tl = state.token_ids, state.attention_masks, state.token_logprobs
    sums = []
    for r in range(state.rows):
        total = 0.0
        for j in range(ids.shape[1]):
            if math.isnan(tl[r, j].item()):
                continue
            assert j > 0 and mask[r, j - 1] == 1 and mask[r, j] == 1, f"row {r}: log-prob on a token with no context"
            x = lsm[r, j - 1, ids[r, j]].item()
            assert abs(x - tl[r, j].item()) < 1e-3, f"row {r} col {j}: stored log-prob {tl[r, j].item()} != fresh {x}"
            total += x
        sums.append(total)
    return torch.tensor(sums, dtype=torch.float64)


def check_weights(state: SequenceState, fresh: torch.Tensor, offset: torch.Tensor | None) -> None:
    """Invariant 4: weights == recomputed log-probs of the generated tokens (+ carried offset)."""
    rec = recomputed_logprobs(state, fresh)
    if offset is None:
        return
    w = state.weights.flatten().double()
    want = rec + offset
    known = ~torch.isnan(offset)  # NaN: that row's carried weight is unspecified (see uncut_rows_after)
    assert torch.allclose(w[known], want[known], atol=1e-3), f"weights {w.tolist()} != recomputed {want.tolist()}"


def uncut_rows_after(offset: torch.Tensor | None, cut: list[bool]) -> torch.Tensor | None:
    """The carried weights after ``state[..., :n]``: cut rows keep only the log-probs of their kept tokens (0);
    uncut rows keep their weight whatever happens to the other rows."""
    if offset is None or not any(cut):
        return offset
    return torch.tensor([0.0 if c else o for c, o in zip(cut, offset.tolist())], dtype=torch.float64)


# ---------------------------------------------------------------------------------- programs
class Program:
    """A random program of state operations, checking every invariant after each step."""

    def __init__(self, model, data):
        self.model, self.data = model, data
        self.history: list[tuple[SequenceState, dict]] = []

    def draw(self, strategy, label=None):
        return self.data.draw(strategy, label=label)

    def record(self, state: SequenceState, offset, what: str) -> SequenceState:
        note(f"{what} -> {state!r}")
        event(what.split("(")[0].split("[")[0])
        fresh = fresh_logits(state)
        check_reuse(state, fresh)
        check_suffix(state)
        check_views(state)
        check_weights(state, fresh, offset)
        self.history.append((state, snapshot(state)))
        for old, snap in self.history:
            check_unchanged(old, snap)
        return state

    def sampler(self, state: SequenceState):
        n = state.samples
        if n == 1:
            kind = self.draw(st.sampled_from(["greedy", "multinomial", "beam"]))
        else:
            kind = self.draw(st.sampled_from(["multinomial", "beam"]))
        return {"greedy": samplers.greedy(), "multinomial": samplers.multinomial(n), "beam": samplers.beam_search(n)}[kind], kind

    def generate(self, state, sampler, k, seed):
        """Run a continuation, checking what the model computed (invariant 3)."""
        C, W = kvcache.length(state._kv), state._ids.shape[1]
        before = row_lengths(state)
        counter, handle = count_forward_tokens(self.model)
        try:
            out = continuous(generate.text(self.model, sampler))(state, max_tokens=k, rng=torch.Generator().manual_seed(seed))
        finally:
            handle.remove()
        R, n = state.rows, sampler.samples
        rows_after = state.batch * n
        if k == 0:
            assert counter["tokens"] == R * max(W - 1 - C, 0), (counter, R, W, C)
            assert counter["calls"] == (1 if W - 1 > C else 0)
        else:
            assert counter["tokens"] == R * (W - C) + (counter["calls"] - 1) * rows_after, (counter, R, W, C)
            longest = max(row_lengths(out)) - max(before)
            if longest == k:  # no early stop everywhere: every step ran
                assert counter["calls"] == k, (counter, k)
            assert counter["calls"] <= k
        assert uncached(out) == [1] * out.rows, f"a generated state must cache all but its last token: {uncached(out)}"
        assert out.shape == (state.batch, n)
        return out

    def run(self, steps: int):
        model = self.model
        batch = self.draw(st.integers(1, 3), "batch")
        prompts = self.draw(st.lists(texts, min_size=batch, max_size=batch), "prompts")
        state = SequenceState.from_prompts(model, prompts)
        offset = torch.zeros(state.rows, dtype=torch.float64)
        self.record(state, offset, f"from_prompts({prompts!r})")
        for _ in range(steps):
            prev_offset = offset
            ops = ["gen", "gen", "slice", "add_text", "add_list", "add_state", "radd", "select"]
            if state.samples == 1:
                ops += ["fork", "fork", "joint"]
            if state.batch <= 2:
                ops += ["stack"]
            op = self.draw(st.sampled_from(ops), "op")
            if op == "gen":
                sampler, kind = self.sampler(state)
                k = self.draw(st.integers(0, 4), "k")
                new = self.generate(state, sampler, k, self.draw(st.integers(0, 2**16)))
                if sampler.is_beam_search and offset is not None:
                    # beams are reordered (best first) within a batch item: offsets follow only if equal there
                    groups = offset.reshape(state.batch, state.samples)
                    offset = offset if bool((groups == groups[:, :1]).all()) else None
                what = f"gen({kind}{state.samples}, max_tokens={k})"
            elif op == "joint":
                # each batch row a run_batch program of its own (and row 0 twice, so there are always two): their
                # greedy calls run as ONE joint call, whose rows come back as lazy views of its cache, short
                # callers' copied out together (loop/coalesce._split); then stacked again, or one caller kept
                k = self.draw(st.integers(1, 3), "k")
                parts = [state[b, :, :] for b in range(state.batch)] + [state[0, :, :]]
                gen = continuous(generate.text(model, samplers.greedy()))
                outs = continuum.run_batch(lambda s, k=k, gen=gen: gen(s, max_tokens=k), parts, concurrency=len(parts))
                keep = self.draw(st.sampled_from(["stack", "first", "last", "all", "sums"]), "keep")
                if keep == "stack":
                    new = SequenceState.stack(outs[:state.batch])
                elif keep in ("all", "sums"):
                    # every caller in order: the joint result itself, or (text added to each: built when read,
                    # state/deferred.py) ONE sum on it; the drawn order may also be shuffled: each built and stacked
                    order = self.draw(st.permutations(range(len(outs))), "order")
                    extra = self.draw(st.lists(texts, min_size=len(outs), max_size=len(outs)), "texts") \
                        if keep == "sums" else [""] * len(outs)
                    ins = [outs[i] + extra[i] if extra[i] else outs[i] for i in order]
                    new = SequenceState.stack(ins)
                    assert all(added_text_ok(model, ids, t, x, got) for (ids, _), t, x, got
                               in zip([r for i in order for r in outs[i]._real_rows()], [list(outs[i])[0] for i in order],
                                      [extra[i] for i in order], new)), list(new)
                    assert new.cached_tokens.flatten().tolist() == [c for i in order
                                                                    for c in outs[i].cached_tokens.flatten().tolist()]
                    if offset is not None:
                        offset = torch.cat([offset, offset[:1]])[list(order)]
                else:
                    new = outs[0] if keep == "first" else outs[-1]
                    offset = offset[:1] if offset is not None else None
                assert list(outs[-1]) == list(outs[0])  # (row 0 twice: the same rows of the joint call)
                for out in outs:  # (each caller's views came from the joint result's rows: its own, not another's)
                    check_views(out)
                what = f"joint(max_tokens={k}, {keep}{', ' + str(list(order)) if keep in ('all', 'sums') else ''})"
            elif op == "fork":
                n = self.draw(st.integers(2, 3), "n")
                beam = self.draw(st.booleans(), "beam")
                sampler = samplers.beam_search(n) if beam else samplers.multinomial(n)
                k = self.draw(st.integers(0, 3), "k")
                new = self.generate(state, sampler, k, self.draw(st.integers(0, 2**16)))
                offset = offset.repeat_interleave(n) if offset is not None else None
                what = f"fork({'beam' if beam else 'multinomial'}({n}), max_tokens={k})"
            elif op == "slice":
                longest = max(len(t) for t in state)
                start = self.draw(st.one_of(st.none(), st.just(0), st.integers(-longest - 1, longest + 1)), "start")
                stop = self.draw(st.one_of(st.none(), st.integers(-longest - 1, longest + 1)), "stop")
                sl = slice(start, stop)
                new = state[chars_key(state, sl, self.draw(st.booleans()))]
                assert [slice_text_ok(model, t[sl], got, sl) for t, got in zip(state, new)] == [True] * state.rows, (
                    list(new), [t[sl] for t in state])
                if any(n == 0 for n in row_lengths(new)):
                    with pytest.raises(GeneratorArgumentError):
                        continuous(generate.text(model, samplers.multinomial(new.samples)))(new, max_tokens=1)
                    note(f"slice[{sl}] -> an empty row: continuing raises; dropped")
                    continue
                truncate = all(sl.indices(len(t))[0] == 0 for t in state)
                tok = model.tokenizer
                rows_info = zip(state._real_rows(), state, state.cached_tokens.flatten().tolist(),
                                new.cached_tokens.flatten().tolist(), new.weights.flatten().tolist())
                for r, ((ids, lps), t, c_old, c_new, w_new) in enumerate(rows_info):
                    if truncate:
                        target = t[sl]
                        K = max(k for k in range(len(ids) + 1) if target.startswith(tok.decode(ids[:k])))
                        if longest_token_prefix(tok, ids, target)[0] == K:
                            # the kept cache: every cached token of the longest kept token prefix (but the last)
                            assert c_new >= min(K, c_old) - 1, f"row {r}: slicing dropped reusable cache: {c_new} of {c_old}"
                        if offset is not None and bool((offset == 0).all()) and len(target) < len(t):
                            check_truncation_weight(model, ids, lps, t, sl, w_new)
                    elif offset is not None and bool((offset == 0).all()):
                        spans = token_char_spans(model, ids, t)
                        if spans is not None:
                            want = expected_slice_weights(model, state[r // state.samples, r % state.samples, :], sl)[0]
                            if want is not None:
                                assert abs(w_new - want) < 1e-4, f"{t!r}[{sl}]: weights {w_new} != {want}"
                if truncate:
                    offset = uncut_rows_after(offset, [len(t[sl]) < len(t) for t in state])
                else:
                    assert int(new.cached_tokens.sum()) == 0
                    # rows cut from their own start keep their tokens and log-probs as a cut from the start does
                    # (uncut_rows_after); the others are fresh prompts, their whole weights carried
                    kept = uncut_rows_after(offset, [len(t[sl]) < len(t) for t in state])
                    offset = torch.tensor([w if sl.indices(len(t))[0] else math.nan if kept is None else float(kept[r])
                                           for r, (t, w) in enumerate(zip(state, new.weights.flatten().tolist()))],
                                          dtype=torch.float64)
                what = f"slice[{sl}]"
            elif op in ("add_text", "add_list"):
                if op == "add_text":
                    extra = self.draw(texts, "text")
                    new = state + extra
                    per_row = [extra] * state.rows
                else:
                    extra = self.draw(st.lists(texts, min_size=state.batch, max_size=state.batch), "texts")
                    new = state + extra
                    per_row = [extra[r // state.samples] for r in range(state.rows)]
                assert all(added_text_ok(model, ids, t, x, got) for (ids, _), t, x, got
                           in zip(state._real_rows(), state, per_row, new)), (list(new), [t + x for t, x in zip(state, per_row)])
                assert new.cached_tokens.tolist() == state.cached_tokens.tolist()
                tok = model.tokenizer
                # (a row with no text yet may take one more space piece: SentencePiece drops a row's first space)
                assert all(n - u in (len(tok.encode_continuation(x)), len(tok.encode_continuation(" " + x)) if t == "" else -1)
                           for n, u, x, t in zip(uncached(new), uncached(state), per_row, state)), (uncached(new), per_row)
                what = f"{op}({extra!r})"
            elif op == "add_state":
                form = self.draw(st.sampled_from(["self", "head", "tail"]), "other")
                if form == "self":
                    other = state
                else:
                    cut = self.draw(st.integers(0, max(len(t) for t in state)))
                    other = state[chars_key(state, slice(None, cut) if form == "head" else slice(cut, None))]
                new = state + other
                assert all(added_text_ok(model, ids, t, o, got) for (ids, _), t, o, got
                           in zip(state._real_rows(), state, other, new)), (list(new), [t + o for t, o in zip(state, other)])
                assert new.cached_tokens.tolist() == state.cached_tokens.tolist()
                assert torch.allclose(new.weights, state.weights + other.weights)
                if offset is not None:
                    offset = offset + other.weights.flatten().double()
                what = f"add_state({form})"
            elif op == "radd":
                prefix = self.draw(texts, "prefix")
                new = prefix + state
                want = [prefix + t for t in state]
                # like HF prompts: a SentencePiece tokenizer drops the leading space of a prompt
                assert list(new) == list(SequenceState.from_prompts(model, want))
                assert all(a == b for a, b in zip(new, want) if not b.startswith(" "))
                assert torch.equal(new.weights, state.weights)
                offset = new.weights.flatten().double()
                what = f"radd({prefix!r})"
            elif op == "stack":
                form = self.draw(st.sampled_from(["self", "head", "fresh"] if state.samples == 1 else ["self", "head"]), "other")
                if form == "self":
                    other, other_offset = state, offset
                elif form == "head":
                    cut = self.draw(st.integers(0, max(len(t) for t in state)))
                    other = state[chars_key(state, slice(None, cut))]
                    if any(n == 0 for n in row_lengths(other)):
                        continue
                    other_offset = uncut_rows_after(offset, [len(t[:cut]) < len(t) for t in state])
                else:
                    prompts = self.draw(st.lists(texts, min_size=1, max_size=2), "prompts")
                    other = greedy_c(model)(prompts, max_tokens=self.draw(st.integers(0, 3)))
                    other_offset = torch.zeros(other.rows, dtype=torch.float64)
                new = SequenceState.stack([state, other])
                assert list(new) == list(state) + list(other)
                assert new.shape == (state.batch + other.batch, state.samples)
                assert torch.equal(new.weights, torch.cat([state.weights, other.weights]))
                assert new.cached_tokens.tolist() == state.cached_tokens.tolist() + other.cached_tokens.tolist()
                offset = None if offset is None or other_offset is None else torch.cat([offset, other_offset])
                what = f"stack({form})"
            else:  # select rows
                bkey = self.draw(st.one_of(st.just(slice(None)), st.just(slice(None, None, -1)),
                                           st.integers(0, state.batch - 1),
                                           st.lists(st.integers(0, state.batch - 1), min_size=1, max_size=3)), "bkey")
                skey = self.draw(st.one_of(st.just(slice(None)), st.just(slice(None, None, -1)),
                                           st.integers(0, state.samples - 1),
                                           st.lists(st.integers(0, state.samples - 1), min_size=1, max_size=3)), "skey")
                new = state[bkey, skey, :]
                b = list(range(state.batch))[bkey] if isinstance(bkey, slice) else ([bkey] if isinstance(bkey, int) else bkey)
                s = list(range(state.samples))[skey] if isinstance(skey, slice) else ([skey] if isinstance(skey, int) else skey)
                rows = [i * state.samples + j for i in b for j in s]
                assert new.shape == (len(b), len(s))
                assert list(new) == [list(state)[r] for r in rows]
                if offset is not None:
                    offset = offset[rows]
                what = f"select[{bkey}, {skey}]"
            ctx = model.context_length
            if ctx is not None and max(row_lengths(new)) > ctx:  # too long to continue (or to check): dropped
                with pytest.raises(ContextLengthError):
                    continuous(generate.text(model, samplers.multinomial(new.samples)))(new, max_tokens=1)
                note(f"{what} -> longer than the context ({max(row_lengths(new))} > {ctx}): continuing raises; dropped")
                offset = prev_offset
                continue
            state = self.record(new, offset, what)
        return state


@settings(max_examples=100, **SETTINGS)
@given(data=st.data())
def test_random_programs_keep_every_invariant(model, data):
    prog = Program(model, data)
    steps = data.draw(st.integers(2, 8), "steps")
    state = prog.run(steps)
    # continuing the same state twice gives identical results
    if min(row_lengths(state)) > 0:
        sampler = samplers.greedy() if state.samples == 1 else samplers.multinomial(state.samples)
        gen = continuous(generate.text(model, sampler))
        a = gen(state, max_tokens=3, rng=torch.Generator().manual_seed(7))
        prog.history.append((a, snapshot(a)))  # b must not write where a looks (a appended in place)
        b = gen(state, max_tokens=3, rng=torch.Generator().manual_seed(7))
        assert torch.equal(a.token_ids, b.token_ids) and torch.equal(a.weights, b.weights) and list(a) == list(b)
        for old, snap in prog.history:
            check_unchanged(old, snap)
