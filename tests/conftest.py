"""Offline fixtures: tiny random GPT-2 / Llama models and tokenizers trained on the fly.

* ``bpe``: byte-level BPE like GPT-2 (``Ġ`` leading spaces, UTF-8 split across tokens), no pad token.
* ``spm``: SentencePiece-style BPE with ``▁`` and ``<0xNN>`` byte fallback, BOS ``<s>``, no pad token.
* Real tokenizers and the real ``stories260K`` model come from ``../shared/fixtures`` when present.
"""

from __future__ import annotations

import os
import signal
import string
from pathlib import Path

import pytest

# under pytest-xdist (-n N) each worker takes its share of the cores: N processes of 2 threads each on 2 cores would
# fight for them at every barrier of torch's OpenMP team
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    # ... and of llama.cpp's (the tests' n_threads=2, a server's default): OpenMP's idle threads spin at a barrier
    # for a while before they sleep, on a core another worker needs (two llama.cpp test modules side by side: 113 s
    # spinning, 76 s sleeping). Set before torch loads libgomp (it reads the policy once); the servers and
    # notebooks the tests start inherit it.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402 - after the wait policy

# the servers the tests start on a transformers model are forked from one process per worker that imported torch,
# transformers and the server once (benchmarks/forked.py): those imports were ~430 s of the suite's CPU
os.environ.setdefault("CONTINUUM_FORKED_SERVERS", "1")

torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // _WORKERS)))
# llama.cpp reads GGML_CPU_TILED_MM once per process, at its first matmul; the batch-invariant mode sets it to 0 when
# its model is made before anything computes. Tests run in any order, so the test process sets it first
# (test_llamacpp_invariant checks in fresh processes that the mode does it itself).
os.environ.setdefault("GGML_CPU_TILED_MM", "0")

FIXTURES = Path(__file__).resolve().parents[2] / "shared" / "fixtures"
if not FIXTURES.exists():  # a clone placed elsewhere: honour an explicit location
    FIXTURES = Path(os.environ.get("CONTINUUM_FIXTURES", FIXTURES))

CORPUS = [
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the park.",
    "The quick brown fox jumps over the lazy dog. The dog sleeps all day long.",
    "Le café est très bon à Paris; naïve façade, crème brûlée, où est la gare?",
    "東京は日本の首都です。京都も美しい。こんにちは世界。",
    "Emoji time: 🤗 🦙 👍🏽 🎉 and more 😀 smiles 😀 everywhere!",
    '{"name": "Ann", "age": 31, "tags": ["a", "b"], "ok": true, "score": -1.5e3}',
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 123-abc 2024-01-01 3.14159",
    "Review: great phone, battery lasts long.\nSentiment: Positive\nReview: awful.\nSentiment: Negative",
    "def f(x):\n    return x * 2  # code\n\tTabs\tand  double  spaces.",
    "She said “hello” — and ‘goodbye’… Ça va? ¿Qué tal? Ñandú. Straße. Ελληνικά. Русский текст.",
] * 3


def _wrap(tok, **special):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=tok, **special)


def make_bpe_tokenizer(vocab_size: int = 400):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return _wrap(tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>", unk_token="<|endoftext|>")


def make_spm_tokenizer(vocab_size: int = 420):
    import json as _json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"],
                                  show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    # Llama-style byte-fallback tokens <0x00>..<0xFF> in the model vocabulary
    state = _json.loads(tok.to_str())
    vocab = state["model"]["vocab"]
    for i in range(256):
        vocab.setdefault(f"<0x{i:02X}>", len(vocab))
    tok = Tokenizer.from_str(_json.dumps(state))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", vocab["<s>"])])
    return _wrap(tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def make_gemma3_tokenizer():
    """A Gemma-3-style SentencePiece tokenizer (transformers' ``GemmaTokenizer``) over the Llama-2 vocabulary:
    Gemma 3's pipeline (spaces normalised to ``▁`` with no dummy prefix, split after spaces, a decoder with
    byte fallback and NO leading-space strip, ``<bos>`` added), its special ids (``<pad>`` 0, ``<eos>`` 1,
    ``<bos>`` 2, ``<unk>`` 3, ``<mask>`` 4, turn markers special) and a non-special added token (``<h1>``, as
    Gemma's HTML pieces). The real one (262k pieces) ships only inside a 250 MB model package."""
    import json as _json

    from tokenizers import Tokenizer
    from transformers.models.gemma.tokenization_gemma import GemmaTokenizer

    data = _json.loads((fixture_path("tokenizers", "llama2-sentencepiece") / "tokenizer.json").read_text())
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
    vocab = {t: i for i, t in enumerate(specials)}
    for piece, _ in sorted(data["model"]["vocab"].items(), key=lambda kv: kv[1])[3:]:  # after <unk> <s> </s>
        vocab[piece] = len(vocab)
    data["model"].update(vocab=vocab, unk_token="<unk>")
    data["added_tokens"] = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                             "normalized": False, "special": True} for i, t in enumerate(specials)]
    data["normalizer"] = {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}
    data["pre_tokenizer"] = {"type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithPrevious", "invert": False}
    data["decoder"] = {"type": "Sequence", "decoders": [{"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
                                                        {"type": "ByteFallback"}, {"type": "Fuse"}]}
    bos = [{"SpecialToken": {"id": "<bos>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}]
    pair = bos + [{"Sequence": {"id": "B", "type_id": 1}}]
    data["post_processor"] = {"type": "TemplateProcessing", "single": bos, "pair": pair,
                              "special_tokens": {"<bos>": {"id": "<bos>", "ids": [2], "tokens": ["<bos>"]}}}
    tok = GemmaTokenizer(tokenizer_object=Tokenizer.from_str(_json.dumps(data)),
                         extra_special_tokens=["<start_of_turn>", "<end_of_turn>"])
    tok.add_tokens(["<h1>"])
    return tok


def _gpt2_byte_map() -> dict[str, int]:
    """GPT-2's printable-unicode -> byte map, written out here (not continuum's)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


GPT2_BYTES = _gpt2_byte_map()


def reference_row_text(hf_tokenizer, ids: list[int]) -> str:
    """Independent reference of a row's text: its tokens' bytes (from the token strings; special tokens skipped)
    decoded as UTF-8 with standard replacement, less the first space where the decoder strips it (Llama-2)."""
    backend = hf_tokenizer.backend_tokenizer
    special = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
    byte_level = "ByteLevel" in repr(backend.decoder)
    data = b""
    for i, t in zip(ids, hf_tokenizer.convert_ids_to_tokens(ids)):
        if i in special or t is None:
            continue
        if byte_level:
            data += bytes(GPT2_BYTES[c] for c in t) if all(c in GPT2_BYTES for c in t) else t.encode()
        elif len(t) == 6 and t.startswith("<0x") and t.endswith(">"):
            data += bytes([int(t[3:5], 16)])
        else:
            data += t.replace("\u2581", " ").encode()
    if "Strip(" in repr(backend.decoder) and data.startswith(b" "):
        data = data[1:]
    return data.decode("utf-8", "replace")


def tiny_gpt2(vocab_size: int, seed: int = 0, n_positions: int = 256):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=vocab_size, n_positions=n_positions, n_embd=32, n_layer=2, n_head=2,
                     bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg).eval()


def tiny_llama(vocab_size: int, seed: int = 0, max_positions: int = 256, bos: int = 1, eos: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                      bos_token_id=bos, eos_token_id=eos)
    return LlamaForCausalLM(cfg).eval()


def _sharpen(hf_model, scale: float = 8.0):
    """Scale the LM head so the random model has peaked (but still varied) distributions."""
    with torch.no_grad():
        hf_model.get_output_embeddings().weight.mul_(scale)
    return hf_model


@pytest.fixture(scope="session")
def bpe_tokenizer():
    return make_bpe_tokenizer()


@pytest.fixture(scope="session")
def spm_tokenizer():
    return make_spm_tokenizer()


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory, spm_tokenizer) -> str:
    """A tiny Llama (4 heads, 2 key/value heads) and its tokenizer saved as a checkpoint folder (read only)."""
    tok = spm_tokenizer
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_llama(len(tok), bos=tok.bos_token_id, eos=tok.eos_token_id).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def gpt2_model(bpe_tokenizer):
    from continuum import models

    eos = bpe_tokenizer.eos_token_id
    hf = tiny_gpt2(len(bpe_tokenizer))
    hf.config.eos_token_id = hf.generation_config.eos_token_id = eos
    return models.Transformers(hf, bpe_tokenizer)


@pytest.fixture(scope="session")
def llama_model(spm_tokenizer):
    from continuum import models

    hf = tiny_llama(len(spm_tokenizer), bos=spm_tokenizer.bos_token_id, eos=spm_tokenizer.eos_token_id)
    return models.Transformers(hf, spm_tokenizer)


@pytest.fixture(scope="session", params=["gpt2", "llama"])
def model(request, gpt2_model, llama_model):
    """Both architectures: absolute positions (GPT-2) and RoPE (Llama)."""
    return gpt2_model if request.param == "gpt2" else llama_model


def fixture_path(*parts) -> Path:
    path = FIXTURES.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"fixture {path} not available")
    return path


@pytest.fixture(scope="session")
def stories():
    from continuum import models

    return models.transformers(str(fixture_path("models", "stories260K")))


@pytest.fixture(scope="session", params=["gpt2", "llama2-sentencepiece", "llama3-bpe", "qwen2-bpe"])
def real_tokenizer_model(request):
    """A tiny random Llama over a real tokenizer: real boundary quirks, fast forward passes."""
    from transformers import AutoTokenizer

    from continuum import models

    tok = AutoTokenizer.from_pretrained(str(fixture_path("tokenizers", request.param)))
    hf = tiny_llama(len(tok), bos=tok.bos_token_id or 0, eos=tok.eos_token_id)
    return models.Transformers(hf, tok)


def next_logits_via_cache(state) -> torch.Tensor:
    """Next-token logits computed the way continuing ``state`` computes them: its uncached suffix on its cache."""
    from continuum.models.kv import length, positions

    C = length(state._kv)
    logits, _ = state.model.forward(state._ids[:, C:], state._mask, positions(state._mask)[:, C:], state._kv)
    return logits


def next_logits_fresh(state) -> torch.Tensor:
    """Next-token logits of a fresh forward pass of the HF model over ``state``'s (compact) token ids."""
    from continuum.models.hf.cache import positions

    ids, mask = state.token_ids, state.attention_masks
    with torch.no_grad():
        out = state.model.model(input_ids=ids, attention_mask=mask, position_ids=positions(mask))
    return out.logits[:, -1].float()


def assert_reuse_exact(state, atol: float = 1e-4) -> None:
    """Invariant 1: reusing the state's cache gives the logits of a fresh pass over its tokens."""
    torch.testing.assert_close(next_logits_via_cache(state), next_logits_fresh(state), atol=atol, rtol=0)


def count_forward_tokens(model):
    """Attach a forward pre-hook counting the input positions the HF model computes."""
    counter = {"tokens": 0, "calls": 0}

    def hook(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        counter["tokens"] += ids.numel()
        counter["calls"] += 1

    handle = model.model.register_forward_pre_hook(hook, with_kwargs=True)
    return counter, handle


# ---------------------------------------------------------------- shared by the property tests
def kv_layers(state) -> tuple:
    """A transformers state's KV tensors, ``((keys, values), ...)`` (what its TensorKV holds; () without a KV)."""
    from continuum.models import kv

    return kv.tensors(state._kv) or ()


def snapshot(state) -> dict:
    return {
        "ids": state._ids.clone(), "mask": state._mask.clone(), "lp": state._logprobs.clone(),
        "w": state._weights.clone(), "kv": [(k.clone(), v.clone()) for k, v in kv_layers(state)], "texts": list(state),
    }


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(a.nan_to_num(), b.nan_to_num())


def check_unchanged(state, snap: dict) -> None:
    """Invariant 2: nothing changed a state after it was built."""
    assert _same(state._ids, snap["ids"]) and _same(state._mask, snap["mask"])
    assert _same(state._logprobs, snap["lp"]) and _same(state._weights, snap["w"])
    kv = kv_layers(state)
    assert len(kv) == len(snap["kv"])
    for (k, v), (k0, v0) in zip(kv, snap["kv"]):
        assert _same(k, k0) and _same(v, v0), "a KV tensor of an earlier state was modified"
    assert list(state) == snap["texts"]


def chars_key(state, sl, full_form: bool = False):
    """The index ``state[..., sl]`` with the arity the state's shape allows."""
    if full_form:
        return (slice(None), slice(None), sl)
    if state.batch == 1 and state.samples == 1:
        return sl
    if state.batch == 1 or state.samples == 1:
        return (slice(None), sl)
    return (slice(None), slice(None), sl)


# ---------------------------------------------------------------- reasoning (issue 30)
THINK_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]


def think_tokenizer(merges: bool = True):
    """A byte-level BPE with ``<think>``/``</think>`` (and ChatML's markers) as special tokens. ``merges=False``:
    one token per ASCII character, so any text has ONE tokenization (a random model's text re-renders exactly)."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers, trainers
    from tokenizers import models as tmodels

    tok = Tokenizer(tmodels.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    if merges:
        trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=THINK_SPECIAL, show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator(CORPUS, trainer)
    else:
        trainer = trainers.BpeTrainer(vocab_size=1, special_tokens=THINK_SPECIAL, show_progress=False)
        tok.train_from_iterator([t for t in CORPUS if t.isascii()] + [string.printable], trainer)
    return _wrap(tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", additional_special_tokens=THINK_SPECIAL[1:])


def think_llama(merges: bool = True, max_positions: int = 1024):
    from continuum import models

    tok = think_tokenizer(merges)
    return models.Transformers(_sharpen(tiny_llama(len(tok), bos=0, eos=2, max_positions=max_positions)), tok)


@pytest.fixture(scope="session")
def think_model():
    return think_llama()


@pytest.fixture(scope="session")
def think_char_model():
    """One token per character: a random model's replies re-render to the same tokens (chat reuse is exact)."""
    return think_llama(merges=False, max_positions=4096)


# the server tests' shared module-scoped fixtures (model_dir, server, client, lib): one definition for every
# test_serve*.py module (a module that needs another server defines its own, which takes precedence)
from serve_fixtures import client, lib, model_dir, server  # noqa: E402, F401

# A test that leaves its own SIGINT handler behind (uvicorn's, a library's) swallows every later simulated Ctrl-C
# (``_thread.interrupt_main`` calls whatever handler is installed): restore it after each test, and name the test.
SIGINT_CHANGED: list[str] = []


@pytest.fixture(autouse=True)
def _sigint_handler_restored(request):
    before = signal.getsignal(signal.SIGINT)
    yield
    if signal.getsignal(signal.SIGINT) is not before:
        SIGINT_CHANGED.append(request.node.nodeid)
        signal.signal(signal.SIGINT, before)


def pytest_xdist_auto_num_workers(config):
    """``-n auto``: a worker per core, at most 4 (each loads its own models, and starts its modules' servers)."""
    return max(1, min(4, os.cpu_count() or 1))


@pytest.fixture
def python_ctrl_c():
    """Python's own SIGINT handler during the test: ``_thread.interrupt_main`` calls whatever is installed (a
    library's may swallow it), and does nothing where SIGINT is ignored, as in a process started in the background
    of a shell without job control (POSIX: such a job ignores SIGINT): a test of Ctrl-C would then wait forever."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def pytest_terminal_summary(terminalreporter):
    if SIGINT_CHANGED:
        terminalreporter.write_line(f"SIGINT handler changed (and restored) by: {', '.join(SIGINT_CHANGED)}")
