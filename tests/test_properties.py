"""Property tests of the ``SequenceState`` algebra and the non-negotiable invariants (issue 3).

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
incomplete UTF-8, decoded as U+FFFD).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, assume, event, example, given, note, settings
from hypothesis import strategies as st

import continuum
from continuum import SequenceState, SlicingError, continuous, generate, samplers
from continuum.errors import ContextLengthError, GeneratorArgumentError
from continuum.models import kv as kvcache
from continuum.state.text import longest_token_prefix

from conftest import GPT2_BYTES, chars_key, check_unchanged, count_forward_tokens, snapshot

SETTINGS = dict(deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large])

FRAGMENTS = [
    "Once upon a time", " there was", " the", "café", " naïve", "crème brûlée", "東京", "こんにちは世界", "🤗", "👍🏽",
    "🦙", "😀", "👩\u200d💻", "e\u0301", "Ñandú", " Straße", "Ελληνικά", "Русский", "  ", "\n", "\t", '{"a": 1}',
    "42", ".", "¿Qué?", "“hi”", "a",
]
ALPHABET = "ab é東京🤗😀\n.ßЖ"
fragment = st.one_of(st.sampled_from(FRAGMENTS), st.text(alphabet=ALPHABET, min_size=1, max_size=3))
texts = st.lists(fragment, min_size=1, max_size=3).map("".join)


# ---------------------------------------------------------------------------------- helpers
@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """The tiny models gain nothing from intra-op threads, and OpenMP spin-waits badly on a loaded
    2-core machine (a 32x96 matmul took 8 ms with 2 threads vs 10 us with 1): use one thread here."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def greedy_c(model):
    return continuous(generate.text(model, samplers.greedy()))


def fresh_logits(state: SequenceState) -> torch.Tensor:
    """Logits of every position of a cache-less HF forward over the public (left-padded) view."""
    ids, mask = state.token_ids, state.attention_masks
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    with torch.inference_mode():
        out = state.model.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False)
    return out.logits.float()


def cached_next_logits(state: SequenceState) -> torch.Tensor:
    """Next-token logits through the state's cache, exactly as ``decoding.decode`` prefills them."""
    ids, mask, kv = state._ids, state._mask, state._kv
    C = kvcache.length(kv)
    assert ids.shape[1] > C, "the last column must never be cached"
    pos = (mask.cumsum(1) - 1).clamp(min=0)[:, C:]
    logits, _ = state.model.forward(ids[:, C:], mask, pos, kv)
    return logits


def row_lengths(state: SequenceState) -> list[int]:
    return state._mask.sum(1).tolist()


def uncached(state: SequenceState) -> list[int]:
    return [n - c for n, c in zip(row_lengths(state), state.cached_tokens.flatten().tolist())]


def check_reuse(state: SequenceState, fresh: torch.Tensor) -> None:
    """Invariant 1: cached next-token logits == fresh last-column logits, per row."""
    got = cached_next_logits(state)
    want = fresh[:, -1, :]
    for r in range(state.rows):
        diff = (got[r] - want[r]).abs().max().item()
        assert diff < 1e-4, f"row {r}: cached next-token logits differ from a fresh forward by {diff}\n{state!r}"


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


def check_suffix(state: SequenceState) -> None:
    """Invariant 3 (layout): the uncached suffix is exactly as wide as the longest per-row uncached run."""
    C = kvcache.length(state._kv)
    width = state._ids.shape[1] - C
    assert width == max(uncached(state)), (width, uncached(state), state.cached_tokens)
    assert min(uncached(state)) >= 1, f"a row has no uncached token: {uncached(state)}"


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


_BYTE_DECODER = GPT2_BYTES  # GPT-2's printable-unicode -> byte map (byte-level BPE token strings)


def raw_token_bytes(model, ids: list[int]) -> list[bytes]:
    """The bytes each token stands for (special tokens: none), computed independently of continuum."""
    tok = model.tokenizer
    out = []
    for i, t in zip(ids, tok.hf.convert_ids_to_tokens(ids)):
        if i in tok.special_ids:
            out.append(b"")
        elif not is_spm(model):
            out.append(bytes(_BYTE_DECODER[c] for c in t))
        elif t.startswith("<0x") and t.endswith(">") and len(t) == 6:
            out.append(bytes([int(t[3:5], 16)]))
        else:
            out.append(t.replace("\u2581", " ").encode())
    return out


def token_char_spans(model, ids: list[int], text: str) -> list[tuple[int, int] | None] | None:
    """Character span ``[first char, last char + 1)`` of each token's bytes in ``text``; ``None`` for a token
    with no bytes. ``None`` overall when the row is not valid UTF-8 (its U+FFFD characters have no
    well-defined owner) or does not decode to ``text``."""
    parts = raw_token_bytes(model, ids)
    data = b"".join(parts)
    try:
        full = data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    if full == text:
        shift = 0
    elif full.startswith(" ") and full[1:] == text:  # SentencePiece decoding drops the first leading space
        shift = 1
    else:
        return None
    lead = [0]
    for byte in data:
        lead.append(lead[-1] + (not 0x80 <= byte < 0xC0))  # characters started before each byte offset
    spans, pos = [], 0
    for p in parts:
        a, b = pos, pos + len(p)
        pos = b
        spans.append(None if a == b else (max(lead[a + 1] - 1 - shift, 0), max(lead[b] - shift, 0)))
    return spans


def expected_slice_weights(model, state: SequenceState, sl: slice) -> list[float | None]:
    """Per row, the sum of the log-probs of the generated tokens whose characters lie wholly inside the slice
    (``None`` when that is ill-defined: invalid UTF-8 in the row, or a generated token with no bytes)."""
    out = []
    for (ids, lps), text in zip(state._real_rows(), state.texts):
        s, e = sl.indices(len(text))[:2]
        e = max(e, s)
        spans = token_char_spans(model, ids, text)
        if spans is None or any(sp is None and lp == lp for sp, lp in zip(spans, lps)):
            out.append(None)
            continue
        out.append(math.fsum(lp for lp, sp in zip(lps, spans) if lp == lp and s <= sp[0] and sp[1] <= e))
    return out


def splits_characters(spans) -> bool:
    """Whether two tokens share a character (a multi-byte character split across tokens)."""
    real = [sp for sp in spans if sp is not None and sp[1] > sp[0]]
    return any(b[0] < a[1] for a, b in zip(real, real[1:]))


def check_truncation_weight(model, ids: list[int], lps: list[float], text: str, sl: slice, got: float) -> None:
    """``state[..., :n]``'s weight is the sum of the log-probs of the generated tokens whose characters are wholly
    kept (by the tokens' bytes); where that is ill-defined (invalid UTF-8, a generated token with no bytes), of the
    longest token prefix whose text begins the kept text."""
    tok = model.tokenizer
    target = text[sl]
    K = max(k for k in range(len(ids) + 1) if target.startswith(tok.decode(ids[:k])))
    assert longest_token_prefix(tok, ids, target)[0] == K, (text, sl)
    spans = token_char_spans(model, ids, text)
    if spans is None or any(sp is None and lp == lp for sp, lp in zip(spans, lps)):
        kept = math.fsum(x for x in lps[:K] if x == x)
        assert abs(got - kept) < 1e-4, f"{text!r}[{sl}]: weights {got} != log-probs of the kept token prefix {kept}"
        return
    e = max(sl.indices(len(text))[1], 0)
    whole = math.fsum(lp for lp, sp in zip(lps, spans) if lp == lp and sp[1] <= e)
    if abs(whole - got) > 1e-4:
        kept = math.fsum(x for x in lps[:K] if x == x)
        assert abs(got - kept) < 1e-4, f"{text!r}[{sl}]: weights {got} != whole tokens' {whole} (or prefix's {kept})"
        event("a cut backed off a token it could have kept")  # (the re-encoding merged with a kept byte token)


def uncut_rows_after(offset: torch.Tensor | None, cut: list[bool]) -> torch.Tensor | None:
    """The carried weights after ``state[..., :n]``: cut rows keep only the log-probs of their kept tokens (0);
    uncut rows keep their weight whatever happens to the other rows."""
    if offset is None or not any(cut):
        return offset
    return torch.tensor([0.0 if c else o for c, o in zip(cut, offset.tolist())], dtype=torch.float64)


def is_byte_token(model, token_id: int) -> bool:
    t = model.tokenizer.hf.convert_ids_to_tokens([token_id])[0]
    return is_spm(model) and t.startswith("<0x") and t.endswith(">")


def added_text_ok(model, ids: list[int], text: str, added: str, got: str) -> bool:
    """``state + added`` has the text ``text + added`` (rows decode by their bytes: a row ending inside a
    character keeps its U+FFFD and the added text, test_add_text_after_dangling_byte)."""
    return got == text + added


def is_spm(model) -> bool:
    return not model.tokenizer.is_byte_level


def slice_text_ok(model, want: str, got: str, sl: slice) -> bool:
    """``state[..., sl]`` has the text ``t[sl]`` (a SentencePiece cut starting at a space keeps it:
    test_slice_with_start_keeps_leading_space)."""
    return got == want


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
                keep = self.draw(st.sampled_from(["stack", "first", "last"]), "keep")
                if keep == "stack":
                    new = SequenceState.stack(outs[:state.batch])
                else:
                    new = outs[0] if keep == "first" else outs[-1]
                    offset = offset[:1] if offset is not None else None
                assert list(outs[-1]) == list(outs[0])  # (row 0 twice: the same rows of the joint call)
                for out in outs:  # (each caller's views came from the joint result's rows: its own, not another's)
                    check_views(out)
                what = f"joint(max_tokens={k}, {keep})"
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


def test_selecting_rows_drops_padding_columns(model):
    s = SequenceState.from_prompts(model, ["a", "a much longer prompt here"])
    one = s[0, :]
    n = len(model.tokenizer.encode_prompts(["a"])[0])
    counter, handle = count_forward_tokens(model)
    try:
        greedy_c(model)(one, max_tokens=1)
    finally:
        handle.remove()
    assert counter["tokens"] == n


def test_slice_with_start_keeps_leading_space(llama_model):
    """Regression: a cut with start > 0 is re-tokenized as a prompt, and a SentencePiece prompt drops its text's
    first leading space (list(from_prompts(['ab\\n cd'])[3:]) was ['cd'])."""
    s = SequenceState.from_prompts(llama_model, ["ab\n cd", "x  y"])
    assert list(s[..., 3:]) == [" cd", "y"] and list(s[..., 2:]) == ["\n cd", " y"]
    assert list(s[..., 1:]) == ["b\n cd", "  y"]


def test_add_text_to_empty_row_keeps_leading_space(llama_model):
    """Regression: the SentencePiece decoder strips the first '\u2581' of a row, so text appended to a row whose
    text is empty lost its leading space (list(from_prompts(['ab'])[:0] + ' cd') was ['cd'])."""
    s = SequenceState.from_prompts(llama_model, ["ab"])[:0]
    assert list(s) == [""]
    assert list(s + " cd") == [" cd"]
    assert list(s + "  cd") == ["  cd"] and list((s + " ") + "x") == [" x"]
    assert list(s + (s + " cd")) == [" cd"]  # state + state appends the other's text the same way


def test_uncut_row_weights_do_not_depend_on_other_rows(model):
    g = greedy_c(model)(["ab", "abcdefgh"], max_tokens=2)
    p = "x" + g
    t = list(p)
    n = len(t[0])
    assert len(t[1]) > n and p.weights[0, 0].item() != 0.0
    alone = p[0, :][:n]
    assert alone.weights.item() == p.weights[0, 0].item()
    assert p[:, :n].weights[0, 0].item() == alone.weights.item()


def test_beam_fork_prefill_only(model):
    out = continuous(generate.text(model, samplers.beam_search(2)))("Hi", max_tokens=0)
    assert out.shape == (1, 2) and list(out) == ["Hi", "Hi"]


def test_truncate_keeps_longest_token_prefix(llama_model):
    s = greedy_c(llama_model)("\U0001f469\u200d\U0001f4bb", max_tokens=0)
    cut = s[:1]
    assert list(cut) == ["\U0001f469"]
    assert cut.cached_tokens.item() == 5


def test_add_text_after_dangling_byte(llama_model):
    """Regression: Hugging Face's byte-fallback decoder renders an invalid run of <0xNN> tokens as one U+FFFD per
    byte, so the text appended after a dangling byte token (as random models generate) read as U+FFFDs too: a row
    <s> \u2581a <0xCD> plus '\u0416' (tokens <0xD0><0x96>) read 'a\ufffd\ufffd\ufffd'. Rows decode by their bytes."""
    ids = llama_model.tokenizer.hf.convert_tokens_to_ids(["<s>", "\u2581a", "<0xCD>"])
    s = SequenceState._from_rows(llama_model, [ids], [[math.nan, math.nan, -1.0]], torch.tensor([-1.0]), 1, 1, None)
    assert list(s) == ["a\ufffd"]
    assert list(s + "\u0416") == ["a\ufffd\u0416"]


def test_truncation_after_invalid_bytes(llama_model):
    ids = llama_model.tokenizer.hf.convert_tokens_to_ids(["<s>", "\u2581", "<0xD0>", "<0x96>", "<0xEB>"])
    s = SequenceState._from_rows(llama_model, [ids], [[math.nan] * 4 + [-1.0]], torch.tensor([-1.0]), 1, 1, None)
    assert list(s) == ["\u0416\ufffd"]  # one U+FFFD for the incomplete character (Hugging Face: three)
    assert list(s[:1]) == ["\u0416"] and list(s[:1] + "\ufffd") == ["\u0416\ufffd"]
    assert list(s + "x") == ["\u0416\ufffdx"] and list((s + "x")[:2]) == ["\u0416\ufffd"]


# ---------------------------------------------------------------------------------- slicing weights
def synthetic_state(model, rows: list[tuple[str, int]], seed: int) -> SequenceState:
    """Rows tokenized as prompts whose tokens from index ``first_generated`` on carry (synthetic) generated
    log-probs: generated tokens then split multi-byte characters the way tokenizers do, which random tiny
    models almost never produce."""
    gen = torch.Generator().manual_seed(seed)
    ids_rows, lp_rows = [], []
    for text, first in rows:
        ids = model.tokenizer.encode_prompts([text])[0]
        first = min(max(first, 1), len(ids))
        lps = (-torch.rand(len(ids), generator=gen, dtype=torch.float64) * 5 - 0.01).tolist()
        ids_rows.append(ids)
        lp_rows.append([math.nan] * first + lps[first:])
    weights = torch.tensor([math.fsum(x for x in lp if x == x) for lp in lp_rows])
    return SequenceState._from_rows(model, ids_rows, lp_rows, weights, len(rows), 1, None)


long_texts = st.lists(fragment, min_size=2, max_size=6).map("".join)
synthetic_rows = st.lists(st.tuples(long_texts, st.integers(1, 6)), min_size=1, max_size=2)


@settings(max_examples=150, **SETTINGS)
@given(rows=synthetic_rows, seed=st.integers(0, 1000), stop=st.integers(-12, 40), data=st.data())
def test_truncation_weights_keep_whole_tokens(model, rows, seed, stop, data):
    """``state[..., :n]``: weights = log-probs of the generated tokens whose characters are all kept."""
    state = synthetic_state(model, rows, seed)
    sl = slice(data.draw(st.sampled_from([None, 0])), stop)
    new = state[chars_key(state, sl)]
    assert list(new) == [t[sl] for t in state]
    for (ids, lps), t, got in zip(state._real_rows(), state, new.weights.flatten().tolist()):
        check_truncation_weight(model, ids, lps, t, sl, got)  # uncut rows too: they must keep every token


def test_truncation_keeps_tokens_of_kept_characters(gpt2_model):
    """Regression: state[:n] keeps a generated token whose characters are all kept when the next token straddles
    the cut, and completes the split character with byte tokens (row 'a' + '\u00ce' (0xCE), '\u00bb\u00ce'
    (0xBB 0xCE), '\u00bb' (0xBB) = 'a\u03bb\u03bb', log-probs -1, -2, -4: state[:2] had weights 0, not -1)."""
    tok = gpt2_model.tokenizer
    ids = tok.hf.convert_tokens_to_ids(["a", "\u00ce", "\u00bb\u00ce", "\u00bb"])
    state = SequenceState._from_rows(gpt2_model, [ids], [[math.nan, -1.0, -2.0, -4.0]], torch.tensor([-7.0]), 1, 1, None)
    assert list(state) == ["a\u03bb\u03bb"]
    cut = state[:2]  # (was 0: the first \u03bb re-encoded, dropping token 0xCE that lies wholly in it)
    assert list(cut) == ["a\u03bb"] and cut.weights.item() == -1.0
    assert cut._real_rows()[0][0] == ids[:2] + tok.hf.convert_tokens_to_ids(["\u00bb"])


@settings(max_examples=150, **SETTINGS)
@given(rows=synthetic_rows, seed=st.integers(0, 1000), start=st.integers(-12, 40), stop=st.integers(-12, 40))
def test_slice_weights_keep_whole_tokens(model, rows, seed, start, stop):
    """``state[..., a:b]``: weights = log-probs of the generated tokens whose characters are all kept."""
    state = synthetic_state(model, rows, seed)
    sl = slice(start, stop)
    new = state[chars_key(state, sl)]
    want = expected_slice_weights(model, state, sl)
    for r, (t, w, got) in enumerate(zip(state, want, new.weights.flatten().tolist())):
        assert w is not None
        assert abs(got - w) < 1e-4, f"row {r} {t!r}[{sl}]: weights {got} != {w}"


@settings(max_examples=100, **SETTINGS)
@given(rows=st.lists(st.tuples(long_texts, st.integers(1, 6)), min_size=2, max_size=3), seed=st.integers(0, 1000),
       start=st.integers(-12, 40), stop=st.integers(-12, 40))
@example(rows=[("Once upon a timeOnce upon a time", 1), (".\U0001f917", 1)], seed=0, start=-2, stop=0)
def test_a_rows_cut_is_the_same_cut_of_that_row_alone(model, rows, seed, start, stop):
    """``state[..., a:b]`` cuts each row as the same cut of a state of that row alone: its tokens, their log-probs,
    its weight and text never depend on the other rows' cuts (regression: a row cut from its start was re-tokenized,
    and a SentencePiece row's leading "▁" dropped from it and its weight, when another row's cut started later)."""
    state = synthetic_state(model, rows, seed)
    sl = slice(start, stop)
    cut = state[chars_key(state, sl)]
    for r, ((ids, lps), weight) in enumerate(zip(state._real_rows(), state.weights.flatten().tolist())):
        alone = SequenceState._from_rows(model, [list(ids)], [list(lps)], torch.tensor([weight]), 1, 1, None)[sl]
        (got_ids, got_lps), (want_ids, want_lps) = cut._real_rows()[r], alone._real_rows()[0]
        assert (cut.texts[r], got_ids) == (alone.texts[0], want_ids), f"row {r}"
        assert all(a == b or (a != a and b != b) for a, b in zip(got_lps, want_lps)), f"row {r}"
        assert abs(cut.weights.flatten()[r].item() - alone.weights.item()) < 1e-6, f"row {r}"


def test_slice_weights_drop_tokens_of_cut_characters(model):
    tok = model.tokenizer
    if is_spm(model):
        ids = tok.hf.convert_tokens_to_ids(["<s>", "\u2581a", "<0xE6>", "<0x9D>", "<0xB1>", "b"])
    else:
        enc = {b: c for c, b in _BYTE_DECODER.items()}
        ids = tok.hf.convert_tokens_to_ids(["a", enc[0xE6], enc[0x9D], enc[0xB1], "b"])
    lps = [math.nan] * (len(ids) - 4) + [-1.0, -2.0, -4.0, -8.0]
    state = SequenceState._from_rows(model, [ids], [lps], torch.tensor([-15.0]), 1, 1, None)
    assert list(state) == ["a\u6771b"]
    assert state[2:].weights.item() == -8.0
    assert state[1:2].weights.item() == -7.0


# ---------------------------------------------------------------------------------- standalone invariants
prompt_lists = st.lists(texts, min_size=1, max_size=3)


def no_early_stop(state: SequenceState, prompt_state: SequenceState, k: int) -> bool:
    return all(a == b + k for a, b in zip(row_lengths(state), row_lengths(prompt_state)))


@settings(max_examples=40, **SETTINGS)
@given(prompts=prompt_lists, a=st.integers(0, 5), b=st.integers(0, 5))
def test_greedy_split_equals_one_call(model, prompts, a, b):
    """Greedy ``max_tokens=a`` then ``max_tokens=b`` == one greedy call with ``a + b``, token for token."""
    g = greedy_c(model)
    one = g(prompts, max_tokens=a + b)
    assume(no_early_stop(one, SequenceState.from_prompts(model, prompts), a + b))  # EOS ends a row for good
    first = g(prompts, max_tokens=a)
    two = g(first, max_tokens=b)
    assert torch.equal(two.token_ids, one.token_ids)
    assert list(two) == list(one)
    assert torch.allclose(two.weights, one.weights, atol=1e-4)
    nan = torch.isnan(one.token_logprobs)
    assert torch.equal(torch.isnan(two.token_logprobs), nan)
    assert torch.allclose(two.token_logprobs[~nan], one.token_logprobs[~nan], atol=1e-4)


def counted(model, fn):
    counter, handle = count_forward_tokens(model)
    try:
        out = fn()
    finally:
        handle.remove()
    return out, counter["tokens"], counter["calls"]


@settings(max_examples=30, **SETTINGS)
@given(prompts=prompt_lists, k=st.integers(0, 3), m=st.integers(1, 4), extra=texts, n=st.integers(2, 3))
def test_only_the_uncached_suffix_is_computed(model, prompts, k, m, extra, n):
    """Invariant 3 with explicit counts: continuing computes (uncached suffix) x rows, then one column per step."""
    g = greedy_c(model)
    prompt = SequenceState.from_prompts(model, prompts)
    rows = prompt.rows
    s, tokens, _ = counted(model, lambda: g(prompt, max_tokens=k))
    width = max(row_lengths(prompt))
    # a fresh prompt: prefill everything (but the last token when max_tokens=0), then one column per step
    assert tokens == (rows * (width - 1) if k == 0 else rows * width + rows * (k - 1)) or not no_early_stop(s, prompt, k)
    assert uncached(s) == [1] * rows, "a generated state caches all but its last token"

    # continuing a generated state: one position per row, then one per step
    out, tokens, calls = counted(model, lambda: g(s, max_tokens=m))
    if no_early_stop(out, s, m):
        assert (tokens, calls) == (rows * m, m)
    # max_tokens=0 on a generated state computes nothing
    same, tokens, calls = counted(model, lambda: g(s, max_tokens=0))
    assert (tokens, calls) == (0, 0) and list(same) == list(s)

    # after `+ text`: the appended tokens + the one uncached token, then one column per step
    t = s + extra
    appended = [a - b for a, b in zip(row_lengths(t), row_lengths(s))]
    assert appended == [len(model.tokenizer.encode_continuation(extra))] * rows
    out, tokens, calls = counted(model, lambda: g(t, max_tokens=m))
    if no_early_stop(out, t, m):
        assert (tokens, calls) == (rows * (appended[0] + 1) + rows * (m - 1), m)
    # prefill only (max_tokens=0) computes the appended tokens; continuing then computes one position per row
    u, tokens, calls = counted(model, lambda: g(t, max_tokens=0))
    assert tokens == rows * appended[0] and uncached(u) == [1] * rows
    check_reuse(u, fresh_logits(u))
    out, tokens, calls = counted(model, lambda: g(u, max_tokens=m))
    if no_early_stop(out, u, m):
        assert (tokens, calls) == (rows * m, m)

    # forking into n samples: the suffix is computed once per batch row, then n columns per row per step
    fork = continuous(generate.text(model, samplers.multinomial(n)))
    out, tokens, calls = counted(model, lambda: fork(s, max_tokens=m, rng=torch.Generator().manual_seed(0)))
    assert tokens == rows * 1 + (calls - 1) * rows * n
    if max(row_lengths(out)) == max(row_lengths(s)) + m:
        assert calls == m
    # a truncated state keeps the cache of its kept token prefix: only the rest is recomputed
    cut = max(1, min(len(x) for x in s) - 2)
    c = s[chars_key(s, slice(None, cut))]
    check_suffix(c)
    out, tokens, calls = counted(model, lambda: g(c, max_tokens=1))
    assert tokens == rows * max(uncached(c))


def forked_state(model, prompts, k, samples, seed=0) -> SequenceState:
    s = greedy_c(model)(prompts, max_tokens=k)
    if samples > 1:
        fork = continuous(generate.text(model, samplers.multinomial(samples)))
        s = fork(s, max_tokens=1, rng=torch.Generator().manual_seed(seed))
    return s


@settings(max_examples=40, **SETTINGS)
@given(prompts=prompt_lists, k=st.integers(0, 4), samples=st.integers(1, 3), data=st.data())
def test_text_algebra(model, prompts, k, samples, data):
    """Slicing and adding act on each row's text: ``list(state[..., a:b]) == [t[a:b] ...]``, ``state + x``,
    ``state + [per batch row]``, ``x + state``; int indices give characters."""
    s = forked_state(model, prompts, k, samples)
    rows, batch = s.rows, s.batch
    full = list(s)
    assert len(full) == rows and s.shape == (len(prompts), samples)
    longest = max(len(t) for t in full)
    ints = st.integers(-longest - 2, longest + 2)
    for _ in range(3):
        n = data.draw(ints)
        for full_form in (False, True):
            got = list(s[chars_key(s, slice(None, n), full_form)])
            assert all(slice_text_ok(model, t[:n], x, slice(None, n)) for t, x in zip(full, got)), (got, [t[:n] for t in full])
        a, b = data.draw(st.one_of(st.none(), ints)), data.draw(st.one_of(st.none(), ints))
        sl = slice(a, b)
        got = list(s[chars_key(s, sl)])
        assert all(slice_text_ok(model, t[sl], x, sl) for t, x in zip(full, got)), (got, [t[sl] for t in full])
    x = data.draw(texts)
    assert all(added_text_ok(model, ids, t, x, got) for (ids, _), t, got in zip(s._real_rows(), full, s + x))
    per_batch = data.draw(st.lists(texts, min_size=batch, max_size=batch))
    want = [per_batch[r // samples] for r in range(rows)]
    assert all(added_text_ok(model, ids, t, w, got) for (ids, _), t, w, got in zip(s._real_rows(), full, want, s + per_batch))
    p = data.draw(texts)
    pre = list(p + s)
    assert pre == list(SequenceState.from_prompts(model, [p + t for t in full]))
    assert all(got == p + t for got, t in zip(pre, full) if not (p + t).startswith(" "))
    assert list(s + s) == [t + t for t in full]
    i = data.draw(ints)
    if all(-len(t) <= i < len(t) for t in full):
        chars = [t[i] for t in full]
        assert s[chars_key(s, i)] == (chars[0] if rows == 1 else chars)
    elif any(not -len(t) <= i < len(t) for t in full):
        with pytest.raises(IndexError):
            s[chars_key(s, i)]


@settings(max_examples=20, **SETTINGS)
@given(batch=st.integers(1, 3), samples=st.integers(1, 3), step=st.sampled_from([2, -1, 3, 0]))
def test_indexing_arity_and_steps(model, batch, samples, step):
    """Allowed arities: 3 always; 1 iff batch == samples == 1; 2 iff exactly one of them is 1. Others raise
    IndexError. The chars axis needs step 1 (SlicingError, an IndexError); batch/sample axes take any step."""
    s = forked_state(model, ["Once upon a time"] * batch, 1, samples)
    allowed = {3} | ({1} if batch == samples == 1 else set()) | ({2} if (batch == 1) != (samples == 1) else set())
    for arity in (1, 2, 3, 4):
        key = tuple([slice(None)] * arity)
        if arity in allowed:
            assert list(s[key if arity > 1 else key[0]]) == list(s)
        else:
            with pytest.raises(IndexError):
                s[key if arity > 1 else key[0]]
    for arity in allowed:
        bad = tuple([slice(None)] * (arity - 1)) + (slice(None, None, step),)
        with pytest.raises(SlicingError):
            s[bad if arity > 1 else bad[0]]
        ok = tuple([slice(None)] * (arity - 1)) + (slice(None, None, 1),)
        assert list(s[ok if arity > 1 else ok[0]]) == list(s)
    if step != 0:
        sel = s[::step, ::step, :]
        b, m = list(range(batch))[::step], list(range(samples))[::step]
        assert sel.shape == (len(b), len(m))
        assert list(sel) == [list(s)[i * samples + j] for i in b for j in m]
        check_reuse(sel, fresh_logits(sel))


def test_add_text_with_special_token_literal(model):
    """Regression: a special token's literal in added text stays text, as llama.cpp encodes it (was: the EOS token
    mid-row, skipped when decoding: list(from_prompts(llama, ['Hi']) + 'a</s>b') == ['Hi ab']; GPT-2 'Hiab')."""
    tok = model.tokenizer
    special = tok.hf.eos_token
    s = SequenceState.from_prompts(model, ["Hi"])
    added = s + f"a{special}b"
    assert list(added) == [f"Hia{special}b"]
    assert tok.eos_token_id not in added._real_rows()[0][0][len(s._real_rows()[0][0]):]
    assert list(s + [f"{special}"]) == [f"Hi{special}"]  # (the batched encoding too)
