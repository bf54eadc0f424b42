"""The benchmark model and its inputs: fixtures, the text corpus, model setup, prompts of an exact length.

:func:`load_bench` builds the :class:`Bench` every scenario shares (a random-weight GPT-2 by default, or a
model path); :func:`make_text` / :func:`n_tokens` build and count prompts; :func:`configure_threads` and
:func:`load_average` set up and describe the machine the runner measures on.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .counting import ForwardCounter

FIXTURES = Path(os.environ.get("CONTINUUM_FIXTURES", Path(__file__).resolve().parents[2] / "shared" / "fixtures"))

# Plain English-like text used to build prompts and histories of an exact token length.
CORPUS = (
    "The harbour town woke slowly. Fishing boats came back with the tide, and the market filled with "
    "voices, baskets and the smell of bread. Anna walked along the quay to the old library, where she "
    "kept a notebook of every ship that entered the bay. Her grandfather had started the notebook fifty "
    "years ago, and each page held a name, a date, a flag and a short line about the weather. "
    "That morning the sky was clear, the wind came from the west, and a tall ship with grey sails waited "
    "outside the breakwater. Nobody in the town knew its name. The harbour master climbed the tower with "
    "his telescope, the children ran to the end of the pier, and the baker forgot his ovens for a while. "
    "When the ship finally moved, it turned not toward the harbour but along the coast, past the cliffs "
    "and the lighthouse, until only the top of its mast could be seen above the rocks. "
)


def configure_threads(threads: int) -> None:
    torch.set_num_threads(threads)


def load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):  # pragma: no cover - not on Linux
        return None


@dataclass
class Bench:
    """The model under test, shared by all scenarios."""

    hf: object
    tok: object  # the Hugging Face tokenizer
    model: object  # continuum.models.Transformers
    name: str
    random_weights: bool
    counter: ForwardCounter
    notes: list = field(default_factory=list)
    force_length: bool = False  # a real model: suppress EOS on both sides so they generate the same counts

    @property
    def context(self) -> int:
        return self.model.context_length or 1024

    @property
    def pad_id(self) -> int:
        tok = self.tok
        return tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id


def _gpt2_tokenizer(notes: list):
    from transformers import AutoTokenizer

    path = FIXTURES / "tokenizers" / "gpt2"
    if path.exists():
        return AutoTokenizer.from_pretrained(str(path)), "GPT-2 tokenizer (fixtures)"
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=8000, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([CORPUS] * 20, trainer)
    notes.append(f"no GPT-2 tokenizer at {path}: trained a byte-level BPE ({tok.get_vocab_size()} tokens) on the fly")
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>",
                                     unk_token="<|endoftext|>")
    return hf_tok, "byte-level BPE trained on the fly"


def load_bench(model_path: str | None = None, seed: int = 0, tiny: bool = False) -> Bench:
    """The benchmark model: GPT-2-small-shaped with random fp32 weights, or ``model_path``.

    ``tiny`` (``--smoke``): a 2-layer, 64-wide random GPT-2 over the same tokenizer, so that every
    scenario runs in seconds; its figures mean nothing.

    Example:
        >>> bench = load_bench(tiny=True)          # doctest: +SKIP
        >>> bench.model.tokens_computed
        0
    """
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config, GPT2LMHeadModel

    from continuum import models

    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    notes: list[str] = []
    if model_path:
        tok = AutoTokenizer.from_pretrained(model_path)
        hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        name, random_weights = f"{model_path} ({type(hf).__name__}, fp32)", False
    else:
        tok, tok_name = _gpt2_tokenizer(notes)
        vocab = 50257 if len(tok) <= 50257 and tok_name.startswith("GPT-2") else len(tok)
        size = {"n_layer": 2, "n_embd": 64, "n_head": 2} if tiny else {}
        cfg = GPT2Config(vocab_size=vocab, bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id, **size)
        hf = GPT2LMHeadModel(cfg).eval()
        shape = f"{cfg.n_layer} layers, {cfg.n_embd} wide, vocab {cfg.vocab_size}"
        kind = "tiny GPT-2" if tiny else "GPT-2-small-shaped"
        name, random_weights = f"{kind} random fp32 ({shape}; {tok_name})", True
    hf.generation_config.pad_token_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    model = models.Transformers(hf, tok)
    if not random_weights:
        # same number of tokens on both sides: HF gets min_new_tokens, continuum stops treating EOS as the end
        model.tokenizer.eos_token_ids = frozenset()
        notes.append("real model: EOS never ends a generation (HF: min_new_tokens; continuum: empty eos_token_ids)")
    return Bench(hf=hf, tok=tok, model=model, name=name, random_weights=random_weights,
                 counter=ForwardCounter(hf), notes=notes, force_length=not random_weights)


def make_text(tok, n_tokens: int, offset: int = 0) -> str:
    """Text that the tokenizer encodes (with its default special tokens) to about ``n_tokens`` tokens."""
    special = len(tok("", add_special_tokens=True)["input_ids"])
    offset %= len(CORPUS)  # (an offset past the text repeated below left an empty prompt: B22's 72 of 128 were)
    body = CORPUS * (3 + (n_tokens * 6) // len(CORPUS))
    ids = tok(body[offset:], add_special_tokens=False)["input_ids"]
    want = max(1, n_tokens - special)
    best = None
    for k in range(want, max(0, want - 8), -1):
        text = tok.decode(ids[:k])
        n = len(tok(text, add_special_tokens=True)["input_ids"])
        if n == n_tokens:
            return text
        if best is None or abs(n - n_tokens) < abs(best[1] - n_tokens):
            best = (text, n)
    return best[0]


def n_tokens(tok, text: str) -> int:
    return len(tok(text, add_special_tokens=True)["input_ids"])
