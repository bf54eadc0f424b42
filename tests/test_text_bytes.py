"""The text of a state is the text of its bytes (issue 37, part 3).

On every fixture tokenizer (byte-level BPE: gpt2, llama3, qwen2; SentencePiece with byte fallback:
Llama-2, stories260K, and a Gemma-3-style one), for states whose bytes end inside a UTF-8 character:

* ``str(state)`` is the tokens' bytes decoded with standard replacement (one U+FFFD for an incomplete
  sequence), computed here from the token strings, independently of continuum; on valid UTF-8 it is
  exactly Hugging Face's decoding (special tokens skipped, SentencePiece's first space dropped);
* ``str(state + x) == str(state) + x`` for any text ``x``;
* ``state[:k]`` reads ``str(state)[:k]``, and the token spans tile the text;
* the streaming detokenizer and ``stream()`` chunks agree with the final text, stop strings included.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from continuum import SequenceState, continuous, generate, models, samplers
from continuum.state.text import detokenizer, longest_token_prefix, token_char_spans

from conftest import GPT2_BYTES, fixture_path, make_gemma3_tokenizer, reference_row_text, tiny_llama

SETTINGS = dict(deadline=None, derandomize=True, database=None, max_examples=30,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

NAMES = ["gpt2", "llama2-sentencepiece", "llama3-bpe", "qwen2-bpe", "stories260K", "gemma3"]
STRIPS_FIRST_SPACE = {"llama2-sentencepiece", "stories260K"}  # their decoder ends with Strip(" ", 1, 0)
ALPHABET = "ab Ét\n.ß東京😀🤗👍🏽Ж\ufffd"
texts = st.text(alphabet=ALPHABET, max_size=6)


def _load(name: str):
    from transformers import AutoTokenizer

    if name == "gemma3":
        return make_gemma3_tokenizer()
    if name == "stories260K":
        return AutoTokenizer.from_pretrained(str(fixture_path("models", "stories260K")))
    return AutoTokenizer.from_pretrained(str(fixture_path("tokenizers", name)))


@pytest.fixture(scope="module", params=NAMES)
def tok_model(request):
    """(name, a tiny random Llama over the real tokenizer)."""
    hf = _load(request.param)
    llama = tiny_llama(len(hf), bos=hf.bos_token_id or 0, eos=hf.eos_token_id, max_positions=512)
    return request.param, models.Transformers(llama, hf)


def is_byte_level(hf) -> bool:
    return "ByteLevel" in repr(hf.backend_tokenizer.decoder)


def byte_token(hf, b: int) -> int:
    """The id of the token standing for the single byte ``b``."""
    if is_byte_level(hf):
        return hf.convert_tokens_to_ids(next(c for c, v in GPT2_BYTES.items() if v == b))
    return hf.convert_tokens_to_ids(f"<0x{b:02X}>")


def reference_text(name: str, hf, ids: list[int]) -> str:
    """The row's bytes (from the token strings) decoded with standard replacement, specials skipped."""
    assert ("Strip(" in repr(hf.backend_tokenizer.decoder)) == (name in STRIPS_FIRST_SPACE)
    return reference_row_text(hf, ids)


def dangling_state(model, text: str, char: str, nbytes: int) -> SequenceState:
    """The prompt ``text`` then the first ``nbytes`` bytes of ``char`` as single-byte tokens: a state whose
    text ends inside a character (nbytes in 1..len-1), as a random model or a byte-level cut leaves it."""
    hf = model.tokenizer.hf
    ids = model.tokenizer.encode_prompts([text])[0] + [byte_token(hf, b) for b in char.encode()[:nbytes]]
    return SequenceState._from_rows(model, [ids], [[math.nan] * len(ids)], torch.zeros(1), 1, 1, None)


def check_text(name: str, model, state: SequenceState) -> None:
    ids = state._real_rows()[0][0]
    hf = model.tokenizer.hf
    text = str(state)
    assert text == reference_text(name, hf, ids)
    if not reference_text(name, hf, ids).count("\ufffd"):  # valid UTF-8: Hugging Face decodes it alike
        assert text == hf.decode(ids, skip_special_tokens=True)
    spans = token_char_spans(model.tokenizer, ids)
    assert spans[-1][1] == len(text) if ids else True
    assert all(a <= b for a, b in spans) and all(x[0] <= y[0] for x, y in zip(spans, spans[1:]))


# ---------------------------------------------------------------------------------- the regression
def test_llama2_text_after_a_dangling_byte_keeps_the_added_emoji():
    """Found by a random-program test on the real Llama-2 tokenizer: a state reading '...État\\ufffd' plus '😀!'
    read '...État\\ufffd\\ufffd\\ufffd\\ufffd\\ufffd!' (Hugging Face's byte fallback: one U+FFFD per byte of an
    invalid run), losing the emoji whose bytes were in the tokens."""
    hf = _load("llama2-sentencepiece")
    model = models.Transformers(tiny_llama(len(hf), bos=hf.bos_token_id, eos=hf.eos_token_id), hf)
    s = dangling_state(model, "Il était une fois un État", "😀", 1)
    assert str(s) == "Il était une fois un État\ufffd"
    out = s + "😀!"
    ids = out._real_rows()[0][0]
    assert hf.convert_ids_to_tokens(ids[-6:]) == ["<0xF0>", "<0xF0>", "<0x9F>", "<0x98>", "<0x80>", "!"]
    assert hf.decode(ids, skip_special_tokens=True).endswith("État" + "\ufffd" * 5 + "!")  # what it read before
    assert str(out) == "Il était une fois un État\ufffd😀!"
    assert str(out[:len(str(s))]) == str(s) and str(out[:-1]) == str(s) + "😀"


def test_state_plus_state_reads_both_texts_where_the_normalizer_would_rewrite_one(tok_model):
    """Found by the stress driver (transformers, the qwen2 tokenizer): a random model spelled U+F92E (a CJK
    compatibility ideograph) in byte tokens; ``state + state`` re-encoded the other state's text and qwen2's NFC
    normalizer read it back as U+51B7, so ``str(a + b) != str(a) + str(b)``. Checked on every fixture tokenizer
    against the texts joined, ordinary text included (a SentencePiece continuation's leading space kept once)."""
    name, model = tok_model
    for char in ("\uf92e", "\u212b", "e\u0301"):  # NFC rewrites each: 冷 (compat), Å (Angstrom), é (combining)
        a = dangling_state(model, "Un café", "a", 0)
        b = dangling_state(model, " au lait", char, len(char.encode()))
        assert str(b).endswith(char)
        out = a + b
        assert str(out) == str(a) + str(b), (name, char)
        check_text(name, model, out)
        assert str(out + b) == str(a) + str(b) * 2
    a, b = dangling_state(model, "Crème", "a", 0), dangling_state(model, " brûlée", "a", 0)
    assert str(a + b) == str(a) + str(b)


# ---------------------------------------------------------------------------------- properties
@settings(**SETTINGS)
@given(data=st.data())
def test_text_of_a_byte_split_state_plus_text(tok_model, data):
    """``str(state + x) == str(state) + x`` and ``state[:k]`` reads ``str(state)[:k]``, for states ending inside
    (or after) a multi-byte character."""
    name, model = tok_model
    text = data.draw(texts, "text")
    char = data.draw(st.sampled_from(["é", "東", "😀", "Ж", "a"]), "char")
    nbytes = data.draw(st.integers(0, len(char.encode()) - 1), "bytes of it")
    s = dangling_state(model, text, char, nbytes)
    check_text(name, model, s)
    x = data.draw(texts, "added")
    out = s + x
    assert str(out) == str(s) + x
    check_text(name, model, out)
    y = data.draw(texts, "added again")
    assert str(out + y) == str(s) + x + y
    full = str(out)
    k = data.draw(st.integers(0, len(full)), "cut")
    cut = out[:k]
    assert str(cut) == full[:k]
    ids = out._real_rows()[0][0]
    kept, n = longest_token_prefix(model.tokenizer, ids, full[:k])
    assert n == len(reference_text(name, model.tokenizer.hf, ids[:kept])) and full[:k].startswith(
        reference_text(name, model.tokenizer.hf, ids[:kept]))
    assert all(not full[:k].startswith(reference_text(name, model.tokenizer.hf, ids[:j])) for j in range(kept + 1, len(ids) + 1))


@settings(**SETTINGS)
@given(data=st.data())
def test_detokenizer_agrees_with_the_final_text(tok_model, data):
    """Pushed one token at a time after any context, the detokenizer's text is what the tokens add to the
    row's text, and its stable part only grows and is a prefix of every later text."""
    name, model = tok_model
    tok = model.tokenizer
    context = dangling_state(model, data.draw(texts, "text"), "😀", data.draw(st.integers(0, 3)))._real_rows()[0][0]
    pieces = data.draw(st.lists(st.one_of(texts, st.binary(min_size=1, max_size=3)), max_size=4), "pushed")
    new: list[int] = []
    for p in pieces:  # text as continuation tokens, raw bytes as single-byte tokens
        new += tok.encode_continuation(p) if isinstance(p, str) else [byte_token(tok.hf, b) for b in p]
    d = detokenizer(tok, context)
    before = reference_text(name, tok.hf, context)
    stable = ""
    for k, t in enumerate(new):
        d.push(t)
        full = reference_text(name, tok.hf, context + new[:k + 1])
        assert full.startswith(before[:-1] if before.endswith("\ufffd") else before)
        assert d.text == full[len(before):]
        assert d.stable_text().startswith(stable) and d.text.startswith(d.stable_text())
        stable = d.stable_text()
    copy = d.copy()
    assert copy.text == d.text and copy.stable_text() == d.stable_text()


def test_detokenizer_shows_bytes_no_character_begins_with_as_the_final_text_does(tok_model):
    """Regression (randomized runs): pushed b"\\xed", b"\\xa0" (a surrogate's encoding, never valid UTF-8), the
    detokenizer showed one U+FFFD where the row's text has two (Python's incremental decoder still holds both bytes)."""
    name, model = tok_model
    tok = model.tokenizer
    context = tok.encode_prompts(["Hi"])[0]
    d = detokenizer(tok, context)
    before, new = reference_text(name, tok.hf, context), []
    for b in b"\xed\xa0\x80a\xe6\x9d\xb1":
        new.append(byte_token(tok.hf, b))
        d.push(new[-1])
        assert d.text == reference_text(name, tok.hf, context + new)[len(before):], bytes([b])


def test_stream_chunks_and_stop_strings_agree_with_the_final_text(tok_model):
    """A random model over the real tokenizer, continuing a state that ends inside a character: the streamed
    chunks join to the final text, and a stop string taken from that text ends the text at its first match."""
    name, model = tok_model
    gen = continuous(generate.text(model, samplers.greedy()))
    for nbytes in (0, 1, 2):
        s = dangling_state(model, "Le café 東", "😀", nbytes)
        stream = gen.stream(s, max_tokens=24)
        chunks = list(stream)
        final = str(stream.state)
        assert final == reference_text(name, model.tokenizer.hf, stream.state._real_rows()[0][0])
        assert "".join(chunks) == final[len(str(s)):]  # (a character the step completes shows as U+FFFD before)
        made = final[len(str(s)):]
        clean = [i for i in range(1, len(made)) if "\ufffd" not in made[max(0, i - 3):i]]
        for end in clean[::max(1, len(clean) // 3)]:
            stop = made[max(0, end - 3):end]
            cut = gen(s, max_tokens=24, stop_at=stop)
            want = final[:len(str(s)) + made.find(stop) + len(stop)]
            assert str(cut) == want, (name, nbytes, stop)


def test_served_token_texts_join_to_the_row_text(tok_model):
    """The server's per-token texts: an echoed prompt's tokens share its text exactly (SentencePiece's dropped first
    space and characters split over byte tokens included); a token's ``bytes`` are its own bytes (a ``<0xF0>``
    token's byte, not its U+FFFD's), and a later token's text keeps its leading space."""
    from continuum.serve.completions import _shares
    from continuum.serve.served import ServedModel

    name, model = tok_model
    tok, engine = model.tokenizer, ServedModel(model)
    s = dangling_state(model, "Once upon a time, État 東京", "😀", 2)
    ids = s._real_rows()[0][0]
    assert "".join(_shares(tok, ids)) == str(s) == reference_text(name, tok.hf, ids)
    special = {i for i, t in tok.hf.backend_tokenizer.get_added_tokens_decoder().items() if t.special}
    data = b"".join(bytes(engine.token_bytes(i)) for i in ids if i not in special)
    assert data == "Once upon a time, État 東京".encode() + "😀".encode()[:2] or (
        name in STRIPS_FIRST_SPACE and data == b" " + "Once upon a time, État 東京".encode() + "😀".encode()[:2])
    assert engine.token_bytes(byte_token(tok.hf, 0xF0)) == [0xF0] and engine.token_text(byte_token(tok.hf, 0xF0)) == "\ufffd"
    later = tok.encode_continuation(" upon")
    assert "".join(engine.token_text(i) for i in later) == " upon"
