"""The generation engine: models, samplers, the decoding loop, EOS/stop/max_tokens, errors."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from continuum import continuous, generate, models, samplers
from continuum.errors import ContextLengthError, GeneratorArgumentError, TokenizerError

from conftest import reference_row_text

PROMPTS = ["Once upon a time", "The dog", "Le café est très", "東京は 🤗"]


def hf_greedy(model, prompts, max_new):
    """Reference: HF generate(do_sample=False) on left-padded prompts; returns full rows decoded by their bytes
    (conftest.reference_row_text: HF's own decoding but for invalid runs of byte-fallback tokens)."""
    import copy

    tok = copy.deepcopy(model.tokenizer.hf)  # do not touch the session fixture
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    enc = tok(prompts, return_tensors="pt", padding=True)
    out = model.model.generate(**enc, max_new_tokens=max_new, do_sample=False, pad_token_id=tok.pad_token_id,
                               eos_token_id=model.tokenizer.eos_token_id)
    return [reference_row_text(tok, row) for row in out.tolist()]


@pytest.mark.parametrize("batched", [False, True])
def test_greedy_equals_hf_generate(model, batched):
    prompts = PROMPTS if batched else PROMPTS[:1]
    state = continuous(generate.text(model, samplers.greedy()))(prompts, max_tokens=12)
    assert list(state) == hf_greedy(model, prompts, 12)


def test_greedy_equals_hf_generate_real_tokenizers(real_tokenizer_model):
    prompts = ["Hello world", "Ça va? 🤗 naïve", "x"]
    state = continuous(generate.text(real_tokenizer_model, samplers.greedy()))(prompts, max_tokens=6)
    assert list(state) == hf_greedy(real_tokenizer_model, prompts, 6)


def test_batched_rows_equal_single_rows(model):
    gen = generate.text(model, samplers.greedy())
    batched = gen(PROMPTS, max_tokens=10)
    assert batched == [gen(p, max_tokens=10) for p in PROMPTS]


def test_text_returns_continuation_only(model):
    gen = continuous(generate.text(model, samplers.greedy()))
    state = gen("The dog", max_tokens=5)
    out = generate.text(model, samplers.greedy())("The dog", max_tokens=5)
    assert list(state)[0] == "The dog" + out
    assert state.last_text == out


def test_multinomial_seeded_is_reproducible(model):
    gen = generate.text(model, samplers.multinomial(3, temperature=1.3, top_k=50, top_p=0.95))
    a = gen(PROMPTS[:2], max_tokens=8, rng=torch.Generator().manual_seed(7))
    b = gen(PROMPTS[:2], max_tokens=8, rng=torch.Generator().manual_seed(7))
    c = gen(PROMPTS[:2], max_tokens=8, rng=torch.Generator().manual_seed(8))
    assert a == b and a != c
    assert len(a) == 2 and all(len(row) == 3 for row in a)


def test_multinomial_prefills_prompt_once(model):
    from conftest import count_forward_tokens

    state = continuous(generate.text(model, samplers.greedy()))("Le café est très bon", max_tokens=0)
    n_prompt = int(state.attention_masks.sum())
    counter, handle = count_forward_tokens(model)
    try:
        continuous(generate.text(model, samplers.multinomial(4)))("Le café est très bon", max_tokens=3,
                                                                   rng=torch.Generator().manual_seed(0))
    finally:
        handle.remove()
    # prompt once (1 row), then 2 decode steps of 4 rows each
    assert counter["tokens"] == n_prompt + 2 * 4


def test_return_shapes(model):
    g1 = generate.text(model, samplers.greedy())
    assert isinstance(g1("a", max_tokens=2), str)
    assert isinstance(g1(["a"], max_tokens=2), list) and len(g1(["a"], max_tokens=2)) == 1
    g3 = generate.text(model, samplers.multinomial(3))
    out = g3("a", max_tokens=2)
    assert isinstance(out, list) and len(out) == 3 and all(isinstance(x, str) for x in out)
    out = g3(["a", "b"], max_tokens=2)
    assert len(out) == 2 and all(len(r) == 3 for r in out)
    beams = generate.text(model, samplers.beam_search(2))(["a", "b"], max_tokens=2)
    assert len(beams) == 2 and all(len(r) == 2 for r in beams)


def test_max_tokens(model):
    gen = continuous(generate.text(model, samplers.greedy()))
    base = gen("The dog", max_tokens=0)
    assert base.last_text == ""
    assert generate.text(model, samplers.greedy())("The dog", max_tokens=0) == ""
    s = gen("The dog", max_tokens=7)
    new = int(s.attention_masks.sum()) - int(base.attention_masks.sum())
    assert new <= 7
    with pytest.raises(GeneratorArgumentError, match="max_tokens"):
        gen("The dog", max_tokens=-1)
    with pytest.raises(GeneratorArgumentError):
        gen("The dog", max_tokens=2.5)


def _clean_window(text: str, start: int, size: int = 2) -> str:
    """A substring of ``text`` without replacement characters (random models emit stray bytes)."""
    for i in range(start, len(text) - size):
        if "\ufffd" not in text[i:i + size]:
            return text[i:i + size]
    pytest.skip("no clean stop string in this generation")


def test_stop_at_keeps_stop_string_and_cuts_there(model):
    gen = generate.text(model, samplers.greedy())
    full = gen("Once upon a time", max_tokens=20)
    # pick a stop string that occurs in the free generation
    stop = _clean_window(full, 3)
    out = gen("Once upon a time", max_tokens=20, stop_at=stop)
    assert out == full[: full.index(stop) + len(stop)]
    out2 = gen("Once upon a time", max_tokens=20, stop_at=["\u0000never", stop])
    assert out2 == out
    # the continuous state ends exactly after the stop string and still continues correctly
    s = continuous(gen)("Once upon a time", max_tokens=20, stop_at=stop)
    assert list(s)[0] == "Once upon a time" + out


def test_stop_at_batched_rows_unaffected(model):
    gen = generate.text(model, samplers.greedy())
    free = gen(PROMPTS, max_tokens=10)
    stop = _clean_window(free[0], 2)
    stopped = gen(PROMPTS, max_tokens=10, stop_at=stop)
    for f, s in zip(free, stopped):
        assert s == (f[: f.index(stop) + len(stop)] if stop in f else f)


def _eos_after(model, trigger: int):
    """A forward hook making EOS the argmax right after ``trigger`` was fed (a deterministic EOS rule)."""
    eos = model.tokenizer.eos_token_id

    def hook(module, args, kwargs, output):
        ids = kwargs["input_ids"]
        hit = ids[:, -1] == trigger
        output.logits[hit, -1, eos] += 1e4
        return output

    return model.model.register_forward_hook(hook, with_kwargs=True)


def test_eos_ends_rows_without_changing_others(model):
    gen = continuous(generate.text(model, samplers.greedy()))
    free = gen(PROMPTS, max_tokens=10)
    # trigger EOS on a token the first row generates early
    row0 = free.token_ids[0][free.attention_masks[0].bool()].tolist()
    n0 = len(model.tokenizer.encode_prompts(PROMPTS[:1])[0])
    trigger = row0[n0 + 1]
    handle = _eos_after(model, trigger)
    try:
        ended = gen(PROMPTS, max_tokens=10)
        alone = [gen(p, max_tokens=10) for p in PROMPTS]
    finally:
        handle.remove()
    assert list(ended) == [list(a)[0] for a in alone]
    assert len(list(ended)[0]) < len(list(free)[0])
    # EOS is not part of the state; its log-prob is not in the weights
    assert model.tokenizer.eos_token_id not in ended.token_ids[0][ended.attention_masks[0].bool()].tolist()
    lp = ended.token_logprobs[0]
    assert math.isclose(float(ended.weights[0, 0]), float(lp[~lp.isnan()].sum()), abs_tol=1e-4)


def test_beam_search_matches_exhaustive_search():
    """With beams >= V^(T-1), beam search over T steps is exhaustive: compare with brute force."""
    from conftest import make_bpe_tokenizer, tiny_gpt2

    tok = make_bpe_tokenizer(vocab_size=262)  # tiny vocabulary
    hf = tiny_gpt2(len(tok), seed=3)
    model = models.Transformers(hf, tok)
    allowed = "[ab]{3}"  # 2 byte tokens per step -> 8 sequences
    gen = continuous(generate.regex(model, allowed, samplers.beam_search(4)))
    state = gen("Hi", max_tokens=3)
    prompt = model.tokenizer.encode_prompts(["Hi"])[0]
    a, b = model.tokenizer.encode_continuation("a"), model.tokenizer.encode_continuation("b")
    assert len(a) == len(b) == 1
    scores = {}
    for seq in itertools.product([a[0], b[0]], repeat=3):
        ids = torch.tensor([prompt + list(seq)])
        with torch.no_grad():
            lp = torch.log_softmax(hf(ids).logits[0].float(), -1)
        n = len(prompt)
        scores[model.tokenizer.decode(list(seq))] = sum(float(lp[n - 1 + i, t]) for i, t in enumerate(seq))
    # the guide only allows a/b bytes plus merged tokens like "ab": restrict brute force to what beams produced
    beams = state.value
    best = sorted(scores.items(), key=lambda kv: -kv[1])
    got = [float(w) for w in state.weights[0]]
    assert got == sorted(got, reverse=True)
    # the best beam is at least as good as the best single-byte sequence
    assert got[0] >= best[0][1] - 1e-4
    assert all(len(x) == 3 and set(x) <= {"a", "b"} for x in beams)


def test_beam_search_first_step_has_no_duplicates(model):
    state = continuous(generate.text(model, samplers.beam_search(4)))("The dog", max_tokens=3)
    rows = [tuple(r) for r in state.token_ids.tolist()]
    assert len(set(rows)) == 4
    w = state.weights[0].tolist()
    assert w == sorted(w, reverse=True)


def test_beam_search_exhaustive_small_vocab():
    """Exact check on a model whose whole vocabulary is tiny: beams = V^(T-1) explores everything."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers import models as tmodels
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(["<eos>", "a", "b", "c", "d"])}
    t = Tokenizer(tmodels.WordLevel(vocab, unk_token="<eos>"))
    t.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    t.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=t, eos_token="<eos>", unk_token="<eos>")
    torch.manual_seed(1)
    hf = GPT2LMHeadModel(GPT2Config(vocab_size=5, n_positions=32, n_embd=16, n_layer=1, n_head=2)).eval()
    with torch.no_grad():
        hf.lm_head.weight.mul_(20)
        hf.transformer.wte.weight.data[0] = hf.transformer.wte.weight.data[0]  # keep tied
    model = models.Transformers(hf, tok)
    T, V = 3, 4
    k = V ** (T - 1)
    state = continuous(generate.regex(model, "[abcd]{3}", samplers.beam_search(k)))("ab", max_tokens=T)
    prompt = [vocab["a"], vocab["b"]]
    scores = []
    for seq in itertools.product(range(1, 5), repeat=T):
        with torch.no_grad():
            lp = torch.log_softmax(hf(torch.tensor([prompt + list(seq)])).logits[0], -1)
        scores.append(sum(float(lp[len(prompt) - 1 + i, t]) for i, t in enumerate(seq)))
    expected = sorted(scores, reverse=True)[:k]
    assert torch.allclose(state.weights[0], torch.tensor(expected), atol=1e-4)


def test_pad_token_is_set_from_eos(caplog):
    from continuum.models import Tokenizer

    from conftest import make_bpe_tokenizer

    bpe_tokenizer = make_bpe_tokenizer()

    assert bpe_tokenizer.pad_token is None
    with caplog.at_level("INFO", logger="continuum"):
        t = Tokenizer(bpe_tokenizer)
    assert t.pad_token_id == bpe_tokenizer.eos_token_id
    assert "pad token" in caplog.text


def test_tokenizer_without_pad_or_eos_raises():
    from tokenizers import Tokenizer as T
    from tokenizers import models as tm
    from transformers import PreTrainedTokenizerFast

    from continuum.models import Tokenizer

    tok = PreTrainedTokenizerFast(tokenizer_object=T(tm.WordLevel({"a": 0, "<unk>": 1}, unk_token="<unk>")))
    with pytest.raises(TokenizerError, match="pad token"):
        Tokenizer(tok)


def test_generators_are_reusable_and_do_not_leak(model):
    gen = generate.regex(model, r"[0-9]{2,4}", samplers.greedy())
    a = gen("Code: ", max_tokens=6)
    gen(["x", "y", "z"], max_tokens=6)
    assert gen("Code: ", max_tokens=6) == a


def test_context_length(model):
    gen = generate.text(model, samplers.greedy())
    n = model.context_length
    with pytest.raises(ContextLengthError, match="context"):
        gen("a " * (n + 5), max_tokens=1)
    # close to the limit: generation is capped, not an error
    prompt_tokens = len(model.tokenizer.encode_prompts(["a " * (n - 10)])[0])
    s = continuous(gen)("a " * (n - 10), max_tokens=50)
    assert int(s.attention_masks.sum()) <= n
    assert int(s.attention_masks.sum()) >= prompt_tokens


def test_max_tokens_none_on_a_huge_context_allocates_a_small_buffer_and_grows_it(spm_tokenizer, monkeypatch):
    """A context of 2**20 positions and max_tokens=None: the loop's token buffers (Rows) start at the prompt plus
    a few hundred columns, not the context (20 MiB a row here, 16 GiB where it is unbounded), grow a few times
    (not per token) as the call goes past them, and the text equals the same call with max_tokens set."""
    from continuum.loop import setup
    from continuum.loop.rows import Rows

    from conftest import tiny_llama

    model = models.Transformers(tiny_llama(len(spm_tokenizer), max_positions=2**20), spm_tokenizer)
    assert model.context_length == 2**20
    made, grown = [], []

    class Spy(Rows):  # (records the buffers' widths; the behaviour is Rows')
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append((self.width, self.ids.shape[1]))

        def ensure(self, width):
            have = self.ids.shape[1]
            super().ensure(width)
            if self.ids.shape[1] > have:
                grown.append(self.ids.shape[1])

    monkeypatch.setattr(setup, "Rows", Spy)
    gen = generate.text(model, samplers.greedy())
    text = gen("Once upon a time", max_tokens=400)
    assert len(model.tokenizer.encode_continuation(text)) > 300  # past the columns allocated up front
    stop = next(text[-k:] for k in range(1, len(text) + 1) if text.find(text[-k:]) == len(text) - k)  # ends it there
    made.clear(), grown.clear()
    assert gen("Once upon a time", max_tokens=None, stop_at=stop) == text
    assert made and all(cols - width <= 256 for width, cols in made)
    assert 1 <= len(grown) <= 3


def test_top_k_one_is_greedy(model):
    g = generate.text(model, samplers.greedy())("The dog", max_tokens=8)
    m = generate.text(model, samplers.multinomial(top_k=1))("The dog", max_tokens=8, rng=torch.Generator().manual_seed(0))
    assert g == m


def test_weights_are_raw_logprobs_of_generated_tokens(model):
    state = continuous(generate.text(model, samplers.multinomial(2, temperature=0.5)))(
        PROMPTS[:2], max_tokens=6, rng=torch.Generator().manual_seed(1))
    ids, mask = state.token_ids, state.attention_masks
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        lp = torch.log_softmax(model.model(input_ids=ids, attention_mask=mask, position_ids=pos).logits.float(), -1)
    tlp = state.token_logprobs
    for r in range(ids.shape[0]):
        gen_cols = (~tlp[r].isnan()).nonzero().flatten()
        expected = sum(float(lp[r, c - 1, ids[r, c]]) for c in gen_cols)
        assert math.isclose(float(state.weights.flatten()[r]), expected, abs_tol=1e-3)
        assert torch.allclose(tlp[r, gen_cols], lp[r, gen_cols - 1, ids[r, gen_cols]], atol=1e-4)


def test_stream_yields_chunks_and_final_state(model):
    gen = generate.text(model, samplers.greedy())
    stream = gen.stream("Once upon a time", max_tokens=10)
    chunks = list(stream)
    assert "".join(chunks) == gen("Once upon a time", max_tokens=10) == stream.result
    cstream = continuous(gen).stream(["The dog", "東京"], max_tokens=6)
    parts = list(cstream)
    joined = ["".join(p[i] for p in parts) for i in range(2)]
    assert joined == cstream.state.last_text


def test_stories_real_model(stories):
    """The real TinyStories model: greedy output equals HF and documented llama2.c output."""
    gen = generate.text(stories, samplers.greedy())
    out = gen("Once upon a time", max_tokens=30)
    assert out.startswith(", there was a little girl named Lily. She loved to play outside in the park.")
    assert list(continuous(gen)("Once upon a time", max_tokens=30)) == hf_greedy(stories, ["Once upon a time"], 30)
