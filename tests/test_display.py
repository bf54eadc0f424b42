"""The HTML view of states and chats (``continuum.display``): well-formed, complete, escaped, small.

References: the texts are checked against the Hugging Face tokenizer's own decoding of the state's
token ids, the shading against the state's log-probs, forced tokens against the schema's literals.
"""

from __future__ import annotations

import math
import re
from html.parser import HTMLParser

import pytest
import torch

from continuum import SequenceState, continuous, generate, samplers
from continuum.display import HEAD, TAIL, chat_to_html
from continuum.errors import BatchMismatch, ContinuumTypeError

from conftest import reference_row_text

VOID = {"br", "img", "hr", "meta", "input", "wbr"}
HOSTILE = '<script>alert(1)</script> & "quoted" <img src=x onerror=alert(2)>'


class View(HTMLParser):
    """Parses the HTML strictly (every tag closed in order) and collects, per row, its tokens."""

    def __init__(self, markup: str):
        super().__init__(convert_charrefs=True)
        self.stack: list[tuple[str, dict]] = []
        self.rows: dict[int, list[tuple[int, str, str]]] = {}  # row -> [(token index, text, style)]
        self.order: list[int] = []
        self.tags: set[str] = set()
        self.headers: dict[int, str] = {}
        self.feed(markup)
        self.close()
        assert not self.stack, f"unclosed tags: {[t for t, _ in self.stack]}"

    def _in(self, key: str):
        return next((a[key] for _, a in reversed(self.stack) if key in a), None)

    def handle_starttag(self, tag, attrs):
        self.tags.add(tag)
        attrs = dict(attrs)
        if "data-row" in attrs:
            row = int(attrs["data-row"])
            self.order.append(row)
            self.rows[row], self.headers[row] = [], ""
        if tag not in VOID:
            self.stack.append((tag, attrs))
        if "data-tok" in attrs and self._in("data-row") is not None:
            self.rows[int(self._in("data-row"))].append((int(attrs["data-tok"]), "", attrs.get("style", "")))

    def handle_endtag(self, tag):
        assert self.stack and self.stack[-1][0] == tag, f"</{tag}> closes {self.stack[-1][0] if self.stack else None}"
        self.stack.pop()

    def handle_data(self, data):
        row = self._in("data-row")
        if row is None:
            return
        row = int(row)
        if self._in("data-tok") is not None:
            k, text, style = self.rows[row][-1]
            self.rows[row][-1] = (k, text + data, style)
        elif self._in("data-special") is None:
            self.headers[row] += data

    def text(self, row: int) -> str:
        return "".join(t for _, t, _ in self.rows[row])


def hf_texts(state) -> list[str]:
    """Independent reference: each row's real token ids decoded by their bytes (conftest.reference_row_text; on
    valid UTF-8 the HF tokenizer's decoding, which reads an invalid run of <0xNN> tokens as one U+FFFD per byte)."""
    return [reference_row_text(state.tokenizer, ids[mask.bool()].tolist())
            for ids, mask in zip(state.token_ids, state.attention_masks)]


def check_state_view(state) -> View:
    markup = state._repr_html_()
    assert markup == state.to_html() and markup.isascii()
    view = View(markup)
    assert view.order == list(range(state.rows)), "rows drawn batch-major, in order"
    assert "script" not in view.tags
    lps = state.token_logprobs
    for r, ref in enumerate(hf_texts(state)):
        assert view.text(r) == ref
        toks = view.rows[r]
        n = int(state.attention_masks[r].sum())
        row_lp = lps[r][state.attention_masks[r].bool()].tolist()
        assert [k for k, _, _ in toks] == sorted(k for k, _, _ in toks) and toks[-1][0] <= n - 1
        for k, _, style in toks:  # generated tokens shaded by exp(log-prob), prompt/added tokens plain
            hue = re.search(r"hsl\((\d+),", style)
            if math.isnan(row_lp[k]):
                assert hue is None
            else:
                assert hue is not None and int(hue.group(1)) == round(120 * math.exp(row_lp[k]))
        w = float(state.weights.flatten()[r])
        assert f"weight {w:.3f}" in view.headers[r]
        if state.finish_reasons is not None:
            assert f"finish: {state.finish_reasons[r // state.samples][r % state.samples]}" in view.headers[r]
    return view


def test_every_shape(model):
    torch.manual_seed(0)
    text = continuous(generate.text(model, samplers.greedy()))
    s = text(["Once upon a time", "The quick brown fox"], max_tokens=6)
    check_state_view(s)
    forks = continuous(generate.text(model, samplers.multinomial(3)))(s, max_tokens=4, rng=torch.Generator().manual_seed(0))
    check_state_view(forks)
    beams = continuous(generate.text(model, samplers.beam_search(2)))(s, max_tokens=4)
    view = check_state_view(beams)
    w = beams.weights
    assert bool((w[:, 0] >= w[:, 1]).all()), "beams are drawn in rank order, best first"
    assert "sample 1" in view.headers[1] and "<b>batch 1</b>" in beams.to_html()
    check_state_view(s[..., :12])  # cut from the start: cache kept
    check_state_view(forks[..., 3:])  # re-tokenized
    check_state_view(s + " and then")
    check_state_view("Title: " + s)
    check_state_view(s + s)
    check_state_view(forks[1, ::2, :])
    check_state_view(SequenceState.from_prompts(model, ["a prompt only"]))


def test_incomplete_constrained_row(model):
    gen = continuous(generate.regex(model, r"[a-z]{5,9}( [a-z]{5,9}){6}", samplers.greedy()))
    s = gen(["Words:", "More words:"], max_tokens=4)
    view = check_state_view(s)
    assert all(not c for c in s._last.complete)
    assert all("incomplete" in view.headers[r] for r in range(2))


def test_hostile_text_is_escaped(gpt2_model):
    s = continuous(generate.text(gpt2_model, samplers.greedy()))(HOSTILE, max_tokens=3)
    # the model itself writes the markup: a regex makes it generate exactly these characters
    w = continuous(generate.regex(gpt2_model, r"<script>alert\(1\)</script>", samplers.greedy()))(s + " ")
    for state in (s, w):
        view = check_state_view(state)
        assert not ({"script", "img"} & view.tags)
        assert "<script" not in state.to_html() and HOSTILE in view.text(0)
    assert w.last_text == "<script>alert(1)</script>"
    chat = chat_to_html([{"role": "user", "content": HOSTILE}, {"role": "assistant", "content": HOSTILE}])
    assert "<script" not in chat and "<img" not in chat and not ({"script", "img"} & View(chat).tags)


def test_long_state_is_elided_and_small(gpt2_model):
    s = continuous(generate.text(gpt2_model, samplers.greedy()))("Once upon a time", max_tokens=5)
    chunk = " ".join(f"word{i}" for i in range(3000))
    for long in (s + chunk, chunk + s + chunk):  # the last step at the start, then in the elided middle
        n = int(long.attention_masks[0].sum())
        assert n >= 10_000
        markup = long.to_html()
        assert len(markup) < 200_000
        view = View(markup)
        shown = view.rows[0]
        assert len(shown) == HEAD + TAIL and f"{n - HEAD - TAIL:,} tokens not shown" in markup
        full = hf_texts(long)[0]
        head = "".join(t for k, t, _ in shown if k < HEAD)
        tail = "".join(t for k, t, _ in shown if k >= HEAD)
        assert full.startswith(head) and full.endswith(tail) and len(head) + len(tail) < len(full)
    gap = re.search(r"tokens not shown \(([^)]*)\)", markup)
    assert gap and "last text step starts here" in gap.group(1) and "last text step ends here" in gap.group(1)


def test_forced_tokens_are_marked(gpt2_model):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer"}},
              "required": ["name", "age"]}
    for sampler in (samplers.greedy(), samplers.beam_search(2)):
        ff = continuous(generate.json(gpt2_model, schema, sampler, whitespace_pattern=""))("Data: ", max_tokens=30)
        step = continuous(generate.json(gpt2_model, schema, sampler, whitespace_pattern="", fast_forward=False))(
            "Data: ", max_tokens=30)
        assert ff.texts == step.texts  # fast-forward changes nothing but the work
        assert step._last.marks is not None and not any(step._last.marks)
        for state in (ff, "Say: " + ff, ff[..., :len(ff.texts[0]) - 2], SequenceState.stack([ff, ff])):
            view = check_state_view(state)
            forced = [t for _, t, st in view.rows[0] if "border-bottom" in st]
            assert forced and all(t in '{"name":"' or t in '","age":' or t == "}" for t in forced)
    again = SequenceState.load(_saved(ff), gpt2_model)
    assert again._last.marks == ff._last.marks


def _saved(state):
    import tempfile
    from pathlib import Path

    path = Path(tempfile.mkdtemp()) / "s.safetensors"
    state.save(path)
    return path


def test_healed_token_is_marked():
    from transformers import AutoTokenizer

    from continuum import models

    from conftest import fixture_path, tiny_llama

    tok = AutoTokenizer.from_pretrained(str(fixture_path("tokenizers", "gpt2")))
    model = models.Transformers(tiny_llama(len(tok), bos=0, eos=tok.eos_token_id), tok)
    s = continuous(generate.text(model, samplers.greedy(), token_healing=True))(["Visit https:", "Hello"], max_tokens=3)
    view = check_state_view(s)
    healed = [t for _, t, st in view.rows[0] if "dashed" in st]
    assert len(healed) == 1 and healed[0].startswith(":") and not any("dashed" in st for _, _, st in view.rows[1])


def test_chat_to_html(gpt2_model):
    def conv(user: str) -> list[dict]:
        return [{"role": "system", "content": "Be brief."}, {"role": "user", "content": user}]

    prompts = ["User: hi\nAssistant:", "User: a story?\nAssistant:"]
    gen = continuous(generate.text(gpt2_model, samplers.greedy()))
    s = gen(prompts, max_tokens=6)
    chats = [conv("hi") + [{"role": "assistant", "content": s.last_text[0]}],
             conv("a story?") + [{"role": "assistant", "content": s.last_text[1]}]]
    markup = chat_to_html(chats, s)
    view = View(markup)
    assert view.order == [0, 1] and markup.isascii()
    for r in range(2):
        assert view.text(r) == s.last_text[r]
        lps = [x for x in s._real_rows()[r][1] if x == x]
        shades = [int(re.search(r"hsl\((\d+),", st).group(1)) for _, _, st in view.rows[r] if "hsl" in st]
        assert shades == [round(120 * math.exp(x)) for x in lps]
    assert markup.index(">Be brief.<") < markup.index(">hi<") < markup.index('data-row="0"')
    # one conversation, plain messages; several samples: one shaded reply each
    assert 'data-row' not in chat_to_html(chats[0]) and "a story?" not in chat_to_html(chats[0])
    forks = continuous(generate.text(gpt2_model, samplers.multinomial(2)))(prompts[0], max_tokens=5,
                                                                             rng=torch.Generator().manual_seed(0))
    view = View(chat_to_html(chats[0][:-1] + [{"role": "assistant", "content": forks.last_text[0]}], forks))
    assert [view.text(r) for r in view.order] == forks.last_text
    # a final message that is not the state's reply: shown plain, with a note
    other = chat_to_html([chats[0][:-1] + [{"role": "assistant", "content": "something else"}]], s[0, :, :])
    assert "not shaded" in other and "something else" in other
    with pytest.raises(BatchMismatch):
        chat_to_html(chats[:1], s)
    with pytest.raises(ContinuumTypeError):
        chat_to_html("hello")
    with pytest.raises(ContinuumTypeError):
        chat_to_html([{"content": "no role"}])
