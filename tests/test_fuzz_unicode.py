"""Fuzzing the state algebra against a pure-Python model of the texts (issue 11), on real tokenizers.

Random programs of indexing (every shorthand, negative indices, ``...``, character slices from the
start and not, character ints), adding (``state + text``, ``text + state``, ``state + state``, per
batch row lists), stacking, forking (``multinomial(n)``) and continuing (greedy, a few tokens) run on
a tiny random Llama over each real tokenizer of ``../shared/fixtures/tokenizers`` (GPT-2, Llama-2
SentencePiece, Llama-3 and Qwen2 byte-level BPE). :class:`TextModel` predicts ``list(state)`` from
plain ``str`` operations and the documented rules (docs/state.md), with no call into continuum:

* a prompt, a re-segmented slice (``start`` after the first character) and ``text + state`` are fresh
  prompts: their text is the tokenizer's own round trip of the string (SentencePiece drops a leading
  space, Qwen2 normalizes to NFC), except that a SentencePiece slice keeps its leading space;
* ``state[..., :n]`` is exactly ``t[:n]``; ``state + x`` is ``t + x`` (``x`` normalized by the
  tokenizer's normalizer, NFC for Qwen2); ``state + other`` appends other's text; stacking
  concatenates rows; row selection picks rows;
* generated text is read from the result (the model cannot predict a random model's tokens) and must
  extend the row's text: the text already there never changes, except a trailing U+FFFD that the new
  bytes complete (rows decode by their bytes, SentencePiece byte fallback included).

Texts mix combining marks, emoji ZWJ sequences and skin tones, flags, CJK, Hangul, Arabic and Hebrew
(right-to-left, with bidi controls), Devanagari and ASCII. Every step also checks that reusing the
cache gives the logits of a fresh pass (``assert_reuse_exact``) and that no earlier state changed.

``CONTINUUM_FUZZ_EXAMPLES=200 pytest tests/test_fuzz_unicode.py`` runs longer (default: a ~60 s run).
"""

from __future__ import annotations

import os
import unicodedata

import pytest
import torch
from hypothesis import HealthCheck, event, given, note, settings
from hypothesis import strategies as st

from continuum import SequenceState, continuous, generate, samplers
from continuum.errors import GeneratorArgumentError

from conftest import assert_reuse_exact, check_unchanged, snapshot

EXAMPLES = int(os.environ.get("CONTINUUM_FUZZ_EXAMPLES", "20"))  # per tokenizer
SETTINGS = dict(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large])
MAX_ROWS = 6
MAX_TOKENS = 180  # of any row: far from the tiny model's 256 positions, and fast

FRAGMENTS = [
    "e\u0301", "a\u0308\u0304", "n\u0303o", "\u0915\u094d\u0937", "Z\u0351\u0352\u0353",  # combining marks
    "\U0001f469\u200d\U0001f469\u200d\U0001f467", "\U0001f468\u200d\U0001f4bb", "\U0001f3f3\ufe0f\u200d\U0001f308",  # ZWJ
    "\U0001f44d\U0001f3fd", "\U0001f44b\U0001f3ff", "\U0001f1ef\U0001f1f5", "\u2764\ufe0f",  # skin tones, flag, VS16
    "東京", "漢字テスト", "한국어", "こんにちは世界",  # CJK, Hangul
    "مرحبا بالعالم", "שָׁלוֹם", "\u202bעברית\u202c", "abc مرحبا 123", "Hello世界",  # RTL, bidi, mixed
    "नमस्ते", "สวัสดี", "\u00a0nbsp", "\u3000全角", "\r\n", "zero\u200bwidth",  # Indic, Thai, odd spaces
    "Once upon a time", " the", " naïve café", "  ", "\n", "\t", " ", ".", "42",
]
ALPHABET = "ab é\u0301\u0308\u200d\ufe0f東한ع\u05e9\U0001f469\U0001f3fd😀\n."
fragment = st.one_of(st.sampled_from(FRAGMENTS), st.text(alphabet=ALPHABET, min_size=1, max_size=4))
texts = st.lists(fragment, min_size=1, max_size=3).map("".join)


class TextModel:
    """What ``list(state)`` must be, computed from ``str`` operations and the tokenizer's documented rules."""

    def __init__(self, hf_tokenizer):
        self.hf = hf_tokenizer
        norm = hf_tokenizer.backend_tokenizer.normalizer
        self.nfc = norm is not None and "NFC" in repr(norm)
        self.spm = "ByteFallback" in repr(hf_tokenizer.backend_tokenizer.decoder)

    def norm(self, text: str) -> str:
        """Text as the tokenizer's normalizer leaves it (Qwen2: NFC)."""
        return unicodedata.normalize("NFC", text) if self.nfc else text

    def prompt(self, text: str) -> str:
        """The text of ``text`` tokenized as a fresh prompt: the tokenizer's own round trip."""
        ids = self.hf(text, add_special_tokens=True)["input_ids"]
        return self.hf.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def slice(self, rows: list[str], start, stop) -> list[str]:
        bounds = [slice(start, stop).indices(len(t))[:2] for t in rows]
        if all(s == 0 for s, _ in bounds):  # truncation: exactly the kept characters
            return [t[:max(e, 0)] for t, (_, e) in zip(rows, bounds)]
        return [self.cut(t[s:max(e, s)]) for t, (s, e) in zip(rows, bounds)]  # re-segmented: fresh prompts

    def cut(self, text: str) -> str:
        """A re-segmented cut: a fresh prompt's round trip, but a SentencePiece cut keeps the leading space that
        the prompt's round trip drops (docs/state.md)."""
        trip = self.prompt(text)
        return text if self.spm and text.startswith(" ") and trip == text[1:] else trip


def extends(old: str, new: str) -> bool:
    """``new`` continues ``old``: ``old`` is kept, but for a trailing U+FFFD the new bytes may complete."""
    return new.startswith(old) or (old.endswith("\ufffd") and new.startswith(old.rstrip("\ufffd")))


class Program:
    """A random program over one model: the state, the modelled texts, and every state made so far."""

    def __init__(self, model, data):
        self.model, self.data = model, data
        self.text = TextModel(model.tokenizer.hf)
        self.history: list[tuple[SequenceState, dict]] = []

    def draw(self, strategy, label=None):
        return self.data.draw(strategy, label=label)

    def expect(self, state: SequenceState, want: list[str], shape: tuple[int, int], what: str) -> None:
        note(f"{what} -> {state!r}")
        event(what.split("(")[0].split("[")[0])
        assert state.shape == shape, (what, state.shape, shape)
        assert list(state) == want, f"{what}: {list(state)!r} != model {want!r}"

    def check(self, state: SequenceState) -> None:
        if min(state._mask.sum(1).tolist()) > 0:  # an empty row has no next-token logits
            assert_reuse_exact(state)
        self.history.append((state, snapshot(state)))
        for old, snap in self.history[-4:]:
            check_unchanged(old, snap)

    def usable(self, state: SequenceState) -> bool:
        n = state._mask.sum(1)
        return state.rows <= MAX_ROWS and int(n.max()) <= MAX_TOKENS and int(n.min()) > 0

    # ------------------------------------------------------------------ operations
    def index(self, s: SequenceState, want: list[str]):
        """Row selection and character cuts through every index form the shape allows."""
        B, S = s.shape
        axis = lambda n: st.one_of(st.integers(-n, n - 1), st.just(slice(None)),  # noqa: E731
                                   st.sampled_from([k for k in (slice(None, None, -1), slice(-1, None), slice(None, -1),
                                                                slice(1, None), slice(None, None, 2), slice(-1, None, -2))
                                                    if list(range(n))[k]]),
                                   st.lists(st.integers(-n, n - 1), min_size=1, max_size=3))
        form = self.draw(st.sampled_from(["full", "ellipsis", "short"]), "form")  # short: both axes whole
        bkey, skey = ((slice(None), slice(None)) if form == "short"
                      else (self.draw(axis(B), "batch key"), self.draw(axis(S), "sample key")))
        pick = lambda key, n: [key % n] if isinstance(key, int) else (  # noqa: E731
            list(range(n))[key] if isinstance(key, slice) else [k % n for k in key])
        bsel, ssel = pick(bkey, B), pick(skey, S)
        rows = [b * S + j for b in bsel for j in ssel]
        longest = max(len(want[r]) for r in rows)
        kind = self.draw(st.sampled_from(["all", "truncate", "slice", "char"]), "chars")
        if kind == "all":
            ckey = slice(None)
        elif kind == "truncate":
            stop = st.one_of(st.just(0), st.integers(-longest - 1, longest + 1))  # 0: empty rows, then add to them
            ckey = slice(self.draw(st.sampled_from([None, 0, -longest - 3])), self.draw(stop))
        elif kind == "slice":
            ckey = slice(self.draw(st.integers(-longest - 1, longest + 1)),
                         self.draw(st.none() | st.integers(-longest - 1, longest + 1)))
        else:
            ckey = self.draw(st.integers(-longest - 1, longest))
        # the key, in a form the shape allows: full, `...`, or the shorthand for the shape
        if form == "full":
            key = (bkey, skey, ckey)
        elif form == "ellipsis":
            key = (bkey, skey, ckey) if (bkey, skey) != (slice(None), slice(None)) else (Ellipsis, ckey)
        else:
            key = ckey if B == S == 1 else ((slice(None), ckey) if (B == 1) != (S == 1) else (slice(None), slice(None), ckey))
        picked = [want[r] for r in rows]
        what = f"index_{kind}_{form}{key!r}"
        if isinstance(ckey, int):
            event(what.split("(")[0].split("[")[0])
            if all(-len(t) <= ckey < len(t) for t in picked):
                chars = [t[ckey] for t in picked]
                assert s[key] == (chars[0] if len(chars) == 1 else chars), what
            else:
                with pytest.raises(IndexError):
                    s[key]
            return None
        new = s[key]
        self.expect(new, self.text.slice(picked, ckey.start, ckey.stop), (len(bsel), len(ssel)), what)
        return new, list(new)

    def add(self, s: SequenceState, want: list[str]):
        B, S = s.shape
        op = self.draw(st.sampled_from(["text", "list", "radd", "radd_list", "state"]), "add")
        if op == "text":
            x = self.draw(texts, "text")
            new, model = s + x, [t + self.text.norm(x) for t in want]
        elif op == "list":
            xs = self.draw(st.lists(texts, min_size=B, max_size=B), "texts")
            new, model = s + xs, [t + self.text.norm(xs[r // S]) for r, t in enumerate(want)]
        elif op == "radd":
            x = self.draw(texts, "prefix")
            new, model = x + s, [self.text.prompt(x + t) for t in want]
        elif op == "radd_list":
            xs = self.draw(st.lists(texts, min_size=B, max_size=B), "prefixes")
            new, model = xs + s, [self.text.prompt(xs[r // S] + t) for r, t in enumerate(want)]
        else:  # another state of the same shape: itself, a truncation of it, or its rows reversed
            form = self.draw(st.sampled_from(["self", "head", "reversed"]), "other")
            if form == "self":
                other = s
            elif form == "head":
                other = s[..., :self.draw(st.integers(0, max(len(t) for t in want)))]
            else:
                other = s[::-1, ::-1, :]
            new, model = s + other, [t + o for t, o in zip(want, other)]
        what = f"add_{op}"
        self.expect(new, model, (B, S), what)
        return new, model

    def stack(self, s: SequenceState, want: list[str]):
        S = s.samples
        if S == 1 and self.draw(st.booleans(), "fresh"):
            prompts = self.draw(st.lists(texts, min_size=1, max_size=2), "prompts")
            other, other_want = SequenceState.from_prompts(self.model, prompts), [self.text.prompt(p) for p in prompts]
        else:
            other, other_want = s[::-1, :, :], [want[b * S + j] for b in reversed(range(s.batch)) for j in range(S)]
        self.expect(other, other_want, other.shape, "stack operand")
        if self.draw(st.booleans(), "continue the list"):  # a generator stacks a list of states itself
            return self.generate([s, other], want + other_want, fork=False)
        new = SequenceState.stack([s, other])
        self.expect(new, want + other_want, (s.batch + other.batch, S), "stack")
        return new, want + other_want

    def generate(self, s, want: list[str], fork: bool):
        """Continue ``s`` (a state, or a list of states to stack) or fork it; the new text is read from the result."""
        batch, samples = (s.batch, s.samples) if isinstance(s, SequenceState) else (sum(x.batch for x in s), s[0].samples)
        n = self.draw(st.integers(2, 3), "n") if fork else samples
        sampler = samplers.multinomial(n) if n > 1 else samplers.greedy()
        k = self.draw(st.integers(0 if not fork else 1, 3), "max_tokens")
        new = continuous(generate.text(self.model, sampler))(s, max_tokens=k, rng=torch.Generator().manual_seed(k))
        parents = [want[r // n] for r in range(batch * n)] if fork else want
        got = list(new)
        for p, g in zip(parents, got):
            assert extends(p, g), f"generated text rewrote the row: {p!r} -> {g!r}"
        what = "fork" if fork else ("continue" if isinstance(s, SequenceState) else "continue_list")
        self.expect(new, got, (batch, n), f"{what}({sampler!r}, max_tokens={k})")
        return new, got

    def run(self, steps: int) -> None:
        prompts = self.draw(st.lists(texts, min_size=1, max_size=3), "prompts")
        s, want = SequenceState.from_prompts(self.model, prompts), [self.text.prompt(p) for p in prompts]
        self.expect(s, want, (len(prompts), 1), f"from_prompts({prompts!r})")
        self.check(s)
        for _ in range(steps):
            ops = (["index", "index", "add", "add", "continue"] + (["fork"] if s.samples == 1 else [])
                   + (["stack"] if s.batch <= 2 else []))
            op = self.draw(st.sampled_from(ops), "op")
            if op in ("continue", "fork") and int(s._mask.sum(1).min()) == 0:
                with pytest.raises(GeneratorArgumentError):  # an empty row cannot be continued
                    continuous(generate.text(self.model, samplers.greedy()))(s, max_tokens=1)
                continue
            out = {"index": self.index, "add": self.add, "stack": self.stack}[op](s, want) if op not in ("continue", "fork") \
                else self.generate(s, want, fork=op == "fork")
            if out is None:
                continue
            new, new_want = out
            self.check(new)
            if self.usable(new):
                s, want = new, new_want
        for old, snap in self.history:  # immutability: every state made by the program still reads the same
            check_unchanged(old, snap)


@settings(**SETTINGS)
@given(data=st.data())
def test_random_unicode_programs_match_the_text_model(real_tokenizer_model, data):
    torch.set_num_threads(1)
    Program(real_tokenizer_model, data).run(data.draw(st.integers(3, 8), "steps"))


def test_text_model_examples(real_tokenizer_model):
    """The model's documented rules on fixed examples (what a failing program would be compared with)."""
    text = TextModel(real_tokenizer_model.tokenizer.hf)
    s = SequenceState.from_prompts(real_tokenizer_model, ["👩‍👩‍👧 שלום e\u0301"])
    assert list(s) == [text.prompt("👩‍👩‍👧 שלום e\u0301")]
    t = list(s)[0]
    assert list(s[:3]) == [t[:3]] and list(s[..., :-2]) == [t[:-2]]
    assert list(s + " 東京🇯🇵") == [t + text.norm(" 東京🇯🇵")]
    assert list(s[2:]) == [text.cut(t[2:])]
    empty = s[:0]  # regression: SentencePiece dropped the leading space of text added to an empty row
    assert list(empty + " cd") == [" cd"] and list(empty + "  cd") == ["  cd"] and list((empty + " ") + "x") == [" x"]


def test_sentencepiece_byte_group_across_the_boundary(real_tokenizer_model):
    """Regression: on a SentencePiece row ending in ``<0xNN>`` tokens (an emoji), one more byte token (as a random
    model may generate) made the run invalid UTF-8, and Hugging Face's ByteFallback decoder read every byte of it
    as U+FFFD, the complete emoji included. Rows decode by their bytes: only the incomplete character is U+FFFD."""
    hf = real_tokenizer_model.tokenizer.hf
    s = SequenceState.from_prompts(real_tokenizer_model, ["\U0001f3fd"])
    ids = s._real_rows()[0][0]
    f0 = hf.convert_tokens_to_ids("<0xF0>" if "ByteFallback" in repr(hf.backend_tokenizer.decoder) else "\u00f0")
    longer = ids + [f0]
    state = SequenceState._from_rows(real_tokenizer_model, [longer], [[float("nan")] * len(longer)], torch.zeros(1), 1, 1, None)
    assert list(state) == ["\U0001f3fd\ufffd"] and extends("\U0001f3fd", list(state)[0])
    assert list(state + "\U0001f600") == ["\U0001f3fd\ufffd\U0001f600"]
