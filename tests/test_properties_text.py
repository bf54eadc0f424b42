"""Property tests of the ``SequenceState`` text algebra: slicing, adding and indexing act on each row's text.

For both tiny GPT-2 (byte-level BPE) and tiny Llama (SentencePiece with byte fallback):
``list(state[..., a:b]) == [t[a:b] ...]``, ``state + x``, ``state + [per batch row]``, ``x + state``, int indices
give characters, the allowed index arities and steps; a sliced or truncated state's ``weights`` are the log-probs
of the generated tokens whose characters it keeps whole (synthetic generated tokens that split multi-byte
characters, as tokenizers do), a row's cut never depends on the other rows'; and the regressions found on the way
(leading spaces, dangling byte tokens, special tokens' literals in added text).

Text is drawn from fragments and small alphabets with accents, CJK and emoji, so multi-byte
characters are split across byte-level BPE / byte-fallback tokens (and random models emit
incomplete UTF-8, decoded as U+FFFD). Random programs of every operation: ``test_properties_programs.py``.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from continuum import SequenceState, SlicingError, continuous, generate, samplers

from conftest import chars_key
from properties_support import (
    _BYTE_DECODER,
    SETTINGS,
    _one_thread,  # noqa: F401  (autouse: one intra-op thread for this module)
    added_text_ok,
    check_reuse,
    check_truncation_weight,
    expected_slice_weights,
    fragment,
    fresh_logits,
    greedy_c,
    is_spm,
    prompt_lists,
    slice_text_ok,
    texts,
)


# ---------------------------------------------------------------------------------- text regressions
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


# ---------------------------------------------------------------------------------- the text algebra
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
