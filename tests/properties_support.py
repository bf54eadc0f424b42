"""Shared pieces of the ``SequenceState`` property tests (``test_properties_programs.py``,
``test_properties_text.py``, ``test_properties_compute.py``): the hypothesis settings, the text strategies, the
one-thread fixture, and the checks of what a state holds and computes.

Text is drawn from fragments and small alphabets with accents, CJK and emoji, so multi-byte
characters are split across byte-level BPE / byte-fallback tokens (and random models emit
incomplete UTF-8, decoded as U+FFFD).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, event
from hypothesis import strategies as st

from continuum import SequenceState, continuous, generate, samplers
from continuum.models import kv as kvcache
from continuum.state.text import longest_token_prefix

from conftest import GPT2_BYTES

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
prompt_lists = st.lists(texts, min_size=1, max_size=3)


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

def check_suffix(state: SequenceState) -> None:
    """Invariant 3 (layout): the uncached suffix is exactly as wide as the longest per-row uncached run."""
    C = kvcache.length(state._kv)
    width = state._ids.shape[1] - C
    assert width == max(uncached(state)), (width, uncached(state), state.cached_tokens)
    assert min(uncached(state)) >= 1, f"a row has no uncached token: {uncached(state)}"

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
