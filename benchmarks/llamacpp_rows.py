"""B24b, B24d, B24f: GGUF models on llama.cpp, against llama-cpp-python and llama.cpp's own batched loop.

* B24b: two conversations of ~1,000 tokens continued in turn. llama-cpp-python's ``Llama`` keeps ONE sequence, so
  each turn's prompt (the whole history plus the turn) shares only its first tokens with the other conversation's
  and is re-evaluated; continuum continues each conversation's state (only the new turn is computed). Figure: the
  median over turns of time-to-first-token, baseline / continuum (>= 10x).
* B24d: ``run_batch`` of 32 greedy calls against the best batched loop llama.cpp offers (its ``examples/batched``):
  written here against the low-level bindings, one ``llama_decode`` per step for all 32 sequences, greedy
  ``argmax`` in numpy, on a second context of the same weights with continuum's context settings. Figure: tokens/s,
  continuum / baseline (>= 0.8x).
* B24f: a ~1,000-token state, then the same state forked into 8 samples (``multinomial(8)``, two tokens: the first
  is decoded, so each sample has a sequence of its own, forked by ``llama_memory_seq_cp``): the KV bytes
  llama.cpp holds, read as ``llama_state_seq_get_size(ctx, -1)`` (every used cell of the cache once, with its
  positions and sequence ids), on a fresh model so nothing
  else lives in its cache. Figure: with the forks / the state alone (<= 1.05).

Example:
    >>> rows = more_rows(cfg, ours, ref, note)       # doctest: +SKIP
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from .measurement import median
from .model import CORPUS
from .results import Row, log

__all__ = ["more_rows", "text_of", "b24b", "b24d", "b24f"]

PROMPTS = ["Once upon a time", "The little dog", "One day, Lily", "Tom had a red ball", "The sun was hot",
           "A bird sang", "Mom said", "The cat sat"]
TURNS = [" Then the harbour master asked the children what they had seen.", " The baker said the ship would be back.",
         " Anna wrote the date in her notebook and closed it.", " At noon the wind turned and the sails came back."]


def text_of(tok, n_tokens: int, offset: int = 0) -> str:
    """Text of about ``n_tokens`` tokens (BOS included), from the benchmarks' corpus starting at word ``offset``."""
    words = (CORPUS * (2 + n_tokens // 40)).split()[offset:]
    lo, hi = 1, len(words)
    while lo < hi:  # the most words that stay within n_tokens
        mid = (lo + hi + 1) // 2
        if len(tok.encode_prompts([" ".join(words[:mid])])[0]) <= n_tokens:
            lo = mid
        else:
            hi = mid - 1
    return " ".join(words[:lo])


def more_rows(cfg, ours, ref, note: str) -> list[Row]:
    return [b24b(cfg, ours, ref, note), b24d(cfg, ours, note), b24f(cfg, ours, note)]


def b24b(cfg, ours, ref, note: str) -> Row:
    from continuum import continuous, generate, samplers

    hist = 60 if cfg.smoke else 1000
    turns = 1 if cfg.smoke else 2 if cfg.quick else 4
    new = 2 if cfg.smoke else 16
    tok, gen = ours.tokenizer, continuous(generate.text(ours, samplers.greedy()))
    texts = [text_of(tok, hist), text_of(tok, hist, offset=37)]  # two histories that differ from their first words
    states = [gen(t, max_tokens=0) for t in texts]  # each conversation's state (prefilled: not timed)
    ratios, base_t, cont_t = [], [], []
    for k in range(turns):
        for c in range(2):  # the two conversations in turn: the baseline's one sequence switches every time
            turn = TURNS[(k + c) % len(TURNS)]
            t = time.perf_counter()
            ref.create_completion(texts[c] + turn, max_tokens=1, temperature=0)
            b = time.perf_counter() - t
            t = time.perf_counter()
            first = gen(states[c] + turn, max_tokens=1)
            s = time.perf_counter() - t
            ratios.append(b / s)
            base_t.append(b)
            cont_t.append(s)
            states[c] = gen(first, max_tokens=new - 1)  # the rest of the reply (not timed), then the next turn
            texts[c] = states[c].texts[0]
    n = len(tok.encode_prompts([texts[0]])[0])
    return Row("B24b", f"two {hist}-token conversations in turn: time to first token", "llama-cpp-python (one sequence)",
               median(ratios), ">=", 10.0, "x faster TTFT", base_s=median(base_t), cont_s=median(cont_t),
               reps=len(ratios), notes=[note, f"{hist}-token histories, {turns} turns each ({n} tokens at the end), "
                                        f"per-turn TTFT ratios {' '.join(f'{r:.1f}' for r in ratios)}"])


class _Batched:
    """llama.cpp's ``examples/batched`` in Python: the prompts' prefill in one ``llama_decode``, then one decode per
    step of every live sequence's last token, greedy (``argmax`` over the step's logits), until ``n_new`` tokens
    or end of generation; a context of its own over the model's weights, cleared at each call."""

    def __init__(self, model, n_seq: int, n_tokens: int):
        from continuum.models.llamacpp._lib import lib
        from continuum.models.llamacpp.model import KV_TYPES

        L = self.L = lib()
        cp = L.llama_context_default_params()
        cp.n_ctx = -(-(n_tokens + 256) // 256) * 256
        cp.n_batch, cp.n_ubatch, cp.n_seq_max = max(n_tokens, n_seq, 512), model.n_ubatch, n_seq
        cp.n_threads = cp.n_threads_batch = model.n_threads
        cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED if model.flash_attn else L.LLAMA_FLASH_ATTN_TYPE_DISABLED
        cp.type_k = cp.type_v = KV_TYPES[model.kv_type]
        cp.kv_unified, cp.swa_full, cp.no_perf = True, True, True  # (continuum's settings: same kernels and cache)
        self.ctx = L.llama_init_from_model(model.model_ptr, cp)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create the baseline's context")
        self.vocab, self.n_vocab = model.vocab_ptr, model.n_vocab
        self.batch = L.llama_batch_init(cp.n_batch, 0, 1)

    def close(self) -> None:
        self.L.llama_batch_free(self.batch)
        self.L.llama_free(self.ctx)

    def _decode(self, items: list[tuple[int, int, int, bool]]) -> list[int]:
        """Decode ``(token, pos, seq, logits)`` items; the argmax of each item that asked for logits."""
        b, L = self.batch, self.L
        for i, (t, p, s, want) in enumerate(items):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = t, p, 1, want
            b.seq_id[i][0] = s
        b.n_tokens = len(items)
        if L.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed in the baseline")
        n_out = sum(w for *_, w in items)
        return np.ctypeslib.as_array(L.llama_get_logits(self.ctx), shape=(n_out, self.n_vocab)).argmax(1).tolist()

    def __call__(self, prompts: list[list[int]], n_new: int) -> int:
        L = self.L
        L.llama_memory_clear(L.llama_get_memory(self.ctx), True)
        nxt = self._decode([(t, p, s, p == len(ids) - 1) for s, ids in enumerate(prompts) for p, t in enumerate(ids)])
        live = list(range(len(prompts)))
        pos = [len(ids) for ids in prompts]
        made = 0
        for step in range(n_new):
            keep = [(s, t) for s, t in zip(live, nxt) if not L.llama_vocab_is_eog(self.vocab, t)]
            made += len(keep)
            if step == n_new - 1 or not keep:
                break
            live = [s for s, _ in keep]
            nxt = self._decode([(t, pos[s], s, True) for s, t in keep])
            for s in live:
                pos[s] += 1
        return made


def b24d(cfg, ours, note: str) -> Row:
    from continuum import continuous, generate, run_batch, samplers

    from .measurement import paired

    n_new = 4 if cfg.smoke else 32 if cfg.quick else 64
    reps = 1 if cfg.smoke else max(2, cfg.reps)
    programs = PROMPTS * (1 if cfg.smoke else 4)
    gen = continuous(generate.text(ours, samplers.greedy()))
    tok = ours.tokenizer
    n_prompt = [len(ids) for ids in tok.encode_prompts(programs)]
    base = _Batched(ours.llama, len(programs), sum(n_prompt) + len(programs) * n_new)
    try:
        def baseline() -> int:
            return base(tok.encode_prompts(programs), n_new)

        def ours_batch() -> int:
            states = run_batch(lambda p: gen(p, max_tokens=n_new), programs)
            return sum(s.token_ids.shape[1] - n for s, n in zip(states, n_prompt))

        b, c = paired(_NoCounter(), baseline, ours_batch, reps)
    finally:
        base.close()
    per = [(x.generated / x.seconds) / (y.generated / y.seconds) for y, x in zip(b, c)]
    return Row("B24d", f"run_batch of {len(programs)}, {n_new} tokens", "llama.cpp batched loop (one decode per step)",
               median(per), ">=", 0.8, "x tokens/s", base_s=median([y.seconds for y in b]),
               cont_s=median([x.seconds for x in c]), base_tps=median([y.generated / y.seconds for y in b]),
               cont_tps=median([x.generated / x.seconds for x in c]), reps=len(per),
               notes=[note, f"per-rep ratios {' '.join(f'{r:.3f}' for r in per)}; tokens {b[-1].generated} | "
                      f"{c[-1].generated}"])


class _NoCounter:
    """``measurement.measure`` reads forward counts from a transformers model; llama.cpp has none to read here."""

    class counter:
        @staticmethod
        def snapshot() -> tuple[int, int, float]:
            return 0, 0, 0.0


def _kv_cells_bytes(model) -> int:
    """Bytes of every used cell of the cache, each once (llama.cpp's own serialisation size of all sequences)."""
    from continuum.models.llamacpp._lib import lib

    with model.lock:
        return int(lib().llama_state_seq_get_size(model.ctx, -1))


def b24f(cfg, ours, note: str) -> Row:
    from continuum import continuous, generate, models, samplers
    from continuum.models import kv as kvcache

    n = 100 if cfg.smoke else 1000
    fresh: Any = models.llamacpp(ours.llama.path, n_threads=ours.llama.n_threads)
    try:
        empty = _kv_cells_bytes(fresh.llama)
        state = continuous(generate.text(fresh, samplers.greedy()))(text_of(fresh.tokenizer, n), max_tokens=0)
        alone = _kv_cells_bytes(fresh.llama) - empty
        # two tokens: the first is decoded, so every sample holds a sequence of its own (a seq_cp fork and one cell)
        forked = continuous(generate.text(fresh, samplers.multinomial(8)))(state, max_tokens=2)
        both = _kv_cells_bytes(fresh.llama) - empty
        rows, cached = forked.rows, int(state.cached_tokens.sum())
        ours_count = kvcache.nbytes(forked.kv_cache) if forked.kv_cache is not None else 0
    finally:
        fresh.llama.close()
    log(f"    B24f: {cached} cached tokens: {alone} bytes alone, {both} with {rows} forks")
    return Row("B24f", f"a {n}-token state forked into 8 samples: KV memory", "the state alone", both / alone, "<=", 1.05,
               "x memory", reps=1,
               notes=[note, f"llama_state_seq_get_size(ctx, -1): {alone / 2**20:.2f} MiB alone, {both / 2**20:.2f} MiB "
                      f"with the {rows} samples alive ({cached} cached tokens); 8 copies would be "
                      f"{(1 + rows) * alone / 2**20:.1f} MiB; continuum's own estimate of the samples' KV "
                      f"(kv.nbytes, an upper bound: shared cells counted per sequence) {ours_count / 2**20:.2f} MiB"])

