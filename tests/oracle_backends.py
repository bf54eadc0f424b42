"""The oracle's backends (``tests/test_oracle.py``): one model's weights behind several continuum adapters, and the
reference that judges them (a fresh transformers forward; llama-cpp-python's own ``Llama.eval`` of the f32 GGUF).
The checks against those references are in ``tests/oracle_checks.py``, the history's steps in ``tests/oracle_support.py``.
"""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import torch

from continuum import continuous, generate, models, samplers, speculate

from conftest import _sharpen, fixture_path, tiny_llama

HF_TOL, HF_MARGIN = 1e-4, 1e-3  # fp32: a fresh forward vs continuum's cached one; below 1e-3 a top-2 gap is a tie
MAX_TOKENS = 160  # states stay about this short (the references' contexts: 512 positions)
JSON_SCHEMAS = {"bool": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]},
                "small": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
                          "required": ["n"]}}


CFG_SCALE = 1.5  # the oracle's classifier-free guidance calls (no negative prompt: the unconditional branch is BOS)
MEMO_BYTES = 1 << 30  # the reference log-probs a backend keeps (Backend.logprobs)


@dataclass
class Backend:
    """One model's weights behind several continuum adapters (``variants``: the prefix cache on/off, a small pool),
    and its reference. ``tol``: per-token log-prob; ``margin``: the top-2 gap above which argmax must agree."""

    name: str
    kind: str  # "hf" | "llama"
    variants: dict[str, Any]
    tol: float
    margin: float
    hf: Any = None  # the transformers module (beams: its own generate)
    flash_attn: bool = False
    gguf: str = "f32"  # llama.cpp: the GGUF the reference evaluates (gguf_path: "f32", "lfm2", "window", "gemma")
    server: Any = None  # a served backend's ``continuum serve`` (benchmarks.replicas.Server): restarted by the stress
    _memo: dict = field(default_factory=dict)
    _gens: dict = field(default_factory=dict)

    @property
    def model(self):
        return self.variants["plain"]

    def appended(self, text: str) -> str:
        """How ``text`` reads once added to a row: normalized on its own as the tokenizer's own normalizer does
        (Qwen2's NFC composes ``"e\u0301"`` into ``"é"``; docs/state.md), else unchanged."""
        hf_tok = getattr(self.model.tokenizer, "hf", None)
        normalizer = getattr(getattr(hf_tok, "backend_tokenizer", None), "normalizer", None)
        return unicodedata.normalize("NFC", text) if "NFC" in repr(normalizer) else text

    def logprobs(self, ids: list[int]) -> torch.Tensor:
        """``(len(ids), V)`` float64: row ``j`` is the reference's log-probs of the token after ``ids[:j + 1]``."""
        key = tuple(ids)
        if key in self._memo:
            self._memo[key] = self._memo.pop(key)  # (most recently used last: evicted last)
        else:
            if self.kind == "hf":
                with torch.no_grad():
                    logits = self.hf(input_ids=torch.tensor([ids]), use_cache=False).logits[0]
            else:
                llm = llama_reference(self.flash_attn, self.gguf)
                llm.reset()
                llm.eval(list(ids))
                logits = torch.tensor(llm.scores[:len(ids)])
            self._memo[key] = logits.double().log_softmax(-1)
            # bounded by bytes, not entries: a row's matrix is len(ids) x V float64, 73 MB for 60 tokens of Qwen2's
            # 151,936 (tiny_window), and 257 of them (the bound this had) took a stress run to 14 GB and an OOM kill
            while sum(m.numel() * 8 for m in self._memo.values()) > MEMO_BYTES and len(self._memo) > 1:
                del self._memo[next(iter(self._memo))]
        return self._memo[key]

    def generator(self, variant: str, kind: str, n: int = 1, arg: Any = None):
        """A continuous generator (cached: regex and JSON guides compile once)."""
        key = (variant, kind, n, repr(arg))
        if key not in self._gens:
            m = self.variants[variant]
            sampler = {"greedy": samplers.greedy(), "lookup": samplers.greedy(), "cfg": samplers.greedy(),
                       "sample": samplers.multinomial(n),
                       "fork": samplers.multinomial(n), "beam": samplers.beam_search(n), "choice": samplers.greedy(),
                       "regex": samplers.greedy(), "json": samplers.greedy()}[kind]
            if kind == "choice":
                g = generate.choice(m, list(arg), sampler)
            elif kind == "regex":
                g = generate.regex(m, arg, sampler)
            elif kind == "json":
                g = generate.json(m, JSON_SCHEMAS[arg], sampler)
            elif kind == "lookup":  # greedy with prompt-lookup speculation: drafts verified in one forward each
                g = generate.text(m, sampler, speculate=speculate.lookup())
            elif kind == "cfg":  # greedy under classifier-free guidance (an unconditional branch beside the rows)
                g = generate.text(m, sampler, guidance_scale=CFG_SCALE)
            else:
                g = generate.text(m, sampler)
            self._gens[key] = continuous(g)
        return self._gens[key]


def tiny_window(tok) -> Any:
    """A random tiny Qwen2 (sharpened) whose second layer attends over a sliding window of 8 tokens (the first over
    every token, as Gemma 3 mixes them): states of the oracle's lengths outgrow the window many times."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, use_sliding_window=True,
                      sliding_window=8, max_window_layers=1, bos_token_id=tok.bos_token_id or 0,
                      eos_token_id=tok.eos_token_id)
    with torch.random.fork_rng():
        torch.manual_seed(1)
        hf = _sharpen(Qwen2ForCausalLM(cfg).eval(), 4.0)
    hf.generation_config.eos_token_id = tok.eos_token_id
    return hf


@cache
def hf_backend(name: str) -> Backend:
    """``stories``: the pretrained stories260K; ``tiny``: a random tiny Llama (sharpened) over the real qwen2 BPE
    tokenizer; ``window``: :func:`tiny_window` over the same tokenizer; ``lfm2``: the random LFM2 hybrid fixture
    (short convolutions beside attention: recurrent snapshots). Variants share the weights (states move between them
    with their KV)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if name in ("stories", "lfm2"):
        path = str(fixture_path("models", "stories260K" if name == "stories" else "lfm2-tiny"))
        tok, hf = AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path).eval()
    else:
        tok = AutoTokenizer.from_pretrained(str(fixture_path("tokenizers", "qwen2-bpe")))
        if name == "window":
            hf = tiny_window(tok)
        else:
            hf = _sharpen(tiny_llama(len(tok), bos=tok.bos_token_id or 0, eos=tok.eos_token_id), 4.0)
            hf.generation_config.eos_token_id = tok.eos_token_id
    plain = models.Transformers(hf, tok)
    budget = 6 * MAX_TOKENS * int(plain.kv_bytes_per_token)  # any one call (<= 6 rows) fits; a few at once wait
    variants = {"plain": plain, "prefix": None, "budget": models.Transformers(hf, tok, kv_budget=budget)}
    if plain.hybrid is None:
        variants["prefix"] = models.Transformers(hf, tok, prefix_cache="4MiB")
    else:  # (the prefix cache holds attention KV only: refused on a hybrid, docs/hybrid.md)
        del variants["prefix"]
    return Backend(name, "hf", variants, HF_TOL, HF_MARGIN, hf=hf)


def gguf_path(kind: str):
    """The GGUF of ``kind``: ``f32`` (stories260K, llamacpp_support.gguf), ``lfm2`` (the random LFM2 hybrid),
    ``window`` (a random tiny Gemma 3 with a window of 8 tokens, written at test time: tiny_gguf.py) or ``gemma`` (the
    real Gemma 3 270M Q4_K_M from the registry, skipped without it; the stress driver's ``gguf-gemma``, whose
    tolerance is llamacpp_support.DECODE_TOL's for it)."""
    from tiny_gguf import window_gguf

    from llamacpp_support import gguf

    if kind == "window":
        return window_gguf()
    if kind == "gemma":  # (the real Gemma 3 270M Q4_K_M from the registry: the stress driver's gguf-gemma)
        from llamacpp_support import gemma_path

        return gemma_path()
    return fixture_path("models", "lfm2-tiny-gguf", "lfm2-tiny-f32.gguf") if kind == "lfm2" else gguf(kind)


@cache
def llama_reference(flash_attn: bool, kind: str = "f32"):
    """llama-cpp-python's ``Llama`` on the f32 GGUF, every position's logits kept (``llamacpp_support.reference`` on one
    thread: two spin-wait badly on a loaded 2-core machine, 10-100x slower; results do not depend on it)."""
    import llama_cpp  # noqa: F401  (absent: ImportError, as before)

    from continuum.models.llamacpp.amx import guarded_llama  # (around llama.cpp's AMX crash, as continuum loads)
    from continuum.models.llamacpp.decode import FA_TILE_ROWS

    # micro-batches below flash attention's tiled kernel (64+ query rows), as continuum's generated tokens are
    # computed (one-row decodes; prefills in the batch-invariant mode): found by the long oracle (ninth session), at
    # position 497 of a 512-token row llama.cpp's own one-pass evaluation in ONE 512-row micro-batch gave a log-prob
    # of -0.8005 where its evaluation in 32-row micro-batches gave -0.9100, bit for bit what continuum computed (HF
    # transformers on the same weights: -0.8555): the reference's own batching, not continuum's, made the difference
    return guarded_llama(gguf_path(kind), 1, n_ctx=1024, n_batch=512, n_ubatch=FA_TILE_ROWS - 1, n_threads_batch=1,
                         logits_all=True, flash_attn=flash_attn, verbose=False)


def own_llama(n_ctx: int = 1024, invariant: bool = False, prefix: bool = False, kind: str = "f32") -> Backend:
    """A GGUF (:func:`gguf_path`) on a llama.cpp model of its own; ``n_ctx=256``: a small pool (16 sequence ids),
    where calls park and held states spill. (A hybrid's prefix cache is refused: ``prefix`` is ignored there.)"""
    from llamacpp_support import DECODE_TOL

    m = models.llamacpp(gguf_path(kind), batch_invariant=invariant, n_threads=1, n_ctx=n_ctx,
                        prefix_cache="8MiB" if prefix and kind != "lfm2" else None,
                        **(dict(n_seq_max=16) if n_ctx < 512 else {}))
    tol = DECODE_TOL.get(kind, DECODE_TOL["f32"])
    name = f"gguf{'-' + kind if kind != 'f32' else ''}{'-invariant' if invariant else ''}-{n_ctx}"
    return Backend(name, "llama", {"plain": m}, 2 * tol, 2 * tol, flash_attn=m.llama.flash_attn, gguf=kind)


@cache
def remote_backend(target: str = "gguf-window", n_ctx: int = 256) -> Backend:
    """``models.remote`` against ``continuum serve`` on loopback: ``target`` ``stories`` (stories260K on transformers,
    checked against a fresh forward of the same weights) or a GGUF (``gguf``, ``gguf-window``, ``gguf-lfm2``:
    :func:`gguf_path`; ``--speculate lookup``, a pool of ``n_ctx`` cells on one thread; checked against llama.cpp's
    evaluation). A served state's log-probs are the reference's as any local one's, whatever the server ran before.
    One server per target and process (stopped at exit); its store in a temporary folder."""
    import atexit
    import os
    import tempfile
    from pathlib import Path

    from benchmarks import replicas

    from llamacpp_support import DECODE_TOL

    folder = Path(tempfile.mkdtemp(prefix="oracle-remote-"))
    os.environ.setdefault("CONTINUUM_REMOTE_CACHE", str(folder / "tokenizers"))
    if target == "stories":
        ref = hf_backend("stories")
        path, args = str(fixture_path("models", "stories260K")), []
    else:
        kind = target.removeprefix("gguf").lstrip("-") or "f32"
        path, args = str(gguf_path(kind)), ["--n-ctx", str(n_ctx), "--threads", "1", "--speculate", "lookup"]
    srv = replicas.Server(path, folder / "store", "--api-key", "oracle", *args, name=target, key="oracle")
    atexit.register(srv.stop)
    remote = {"plain": models.remote(srv.base, api_key="oracle")}
    if target == "stories":
        return Backend(f"remote-{target}", "hf", remote, ref.tol, ref.margin, hf=ref.hf, server=srv)
    flash = remote["plain"].fingerprint.flash_attn  # (how the server's llama.cpp computes: its KV fingerprint says)
    tol = DECODE_TOL["f32"]
    return Backend(f"remote-{target}", "llama", remote, 2 * tol, 2 * tol, flash_attn=flash, gguf=kind, server=srv)


@cache
def llama_backend(invariant: bool, small: bool, prefix: bool, kind: str = "f32") -> Backend:
    """:func:`own_llama`, one per setting (shared by the histories and the tests)."""
    return own_llama(256 if small else 1024, invariant, prefix and kind != "lfm2", kind)

