"""The backends and references of the oracle test (``tests/test_oracle.py``): every result is checked against the
backend's OWN evaluation of the same token ids, never against continuum.

* transformers: a fresh, cache-less ``model.model(input_ids=...)`` forward over a row's real ids gives every
  position's log-probs (fp32: a stored log-prob and a weight must agree within ``1e-4``); beams are compared with
  transformers' own ``generate(num_beams=n)``.
* llama.cpp: llama-cpp-python's ``Llama(logits_all=True).eval`` of the same ids on the f32 GGUF (the model's
  flash-attention setting), within the documented tolerance (docs/llamacpp.md#exactness): one token decoded at a time
  vs a prefill, up to ``DECODE_TOL["f32"]`` (0.05) in a logit, so twice that in a log-prob.

Greedy tokens and choices are compared with the reference's argmax only where the reference's top-2 margin exceeds
the noise: ``1e-3`` in fp32 on transformers (DESIGN.md, wave 9), twice ``DECODE_TOL`` on llama.cpp (each of the two
logits may move by ``DECODE_TOL``: a gap of 0.078 at position 361 of a 512-token greedy text flipped, and
llama-cpp-python's own one-token-at-a-time evaluation of those ids moves it to 0.040, its K cells off its prefill's
by one f16 step, as continuum's are); a near-tie may go either way and proves nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import re
import unicodedata
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import torch
from hypothesis import event, note
from hypothesis.errors import InvalidArgument
from hypothesis.stateful import multiple

from continuum import SequenceState, continuous, generate, models, samplers, speculate

from conftest import _sharpen, chars_key, fixture_path, tiny_llama

HF_TOL, HF_MARGIN = 1e-4, 1e-3  # fp32: a fresh forward vs continuum's cached one; below 1e-3 a top-2 gap is a tie
MAX_TOKENS = 160  # states stay about this short (the references' contexts: 512 positions)
JSON_SCHEMAS = {"bool": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]},
                "small": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
                          "required": ["n"]}}


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


# ------------------------------------------------------------------------------------------------- checks
def real_rows(state: SequenceState) -> list[tuple[list[int], list[float]]]:
    """Each row's real token ids and stored log-probs (NaN: not generated), read from the public tensors."""
    out = []
    for ids, mask, lps in zip(state.token_ids, state.attention_masks, state.token_logprobs):
        keep = mask.bool()
        out.append((ids[keep].tolist(), lps[keep].tolist()))
    return out


def check_state(b: Backend, state: SequenceState, carried: list[float | None]) -> None:
    """Every stored log-prob is the reference's log-prob of that token after the ids before it, and each weight is
    their sum plus what the algebra carried (``state + other`` adds ``other``'s weight; ``None``: unknown)."""
    weights = state.weights.flatten().tolist()
    for r, (ids, lps) in enumerate(real_rows(state)):
        ref, total, count = b.logprobs(ids), 0.0, 0
        for j, lp in enumerate(lps):
            if math.isnan(lp):
                continue
            assert j > 0, f"row {r}: a log-prob on the first token"
            want = float(ref[j - 1, ids[j]])
            assert abs(lp - want) <= b.tol, f"row {r} token {j} ({ids[j]}): log-prob {lp} != reference {want}"
            total, count = total + want, count + 1
        if carried[r] is not None:
            # (a weight is a float32 sum: each of its `count` additions may round by float32's epsilon of the total,
            # 1.1e-4 over 31 tokens summing -265.7 in the long profile)
            f32 = count * 1.2e-7 * abs(total + carried[r])
            err, tol = abs(weights[r] - (total + carried[r])), (b.tol if b.kind == "hf" else b.tol * max(count, 1)) + f32
            assert err <= tol, f"row {r}: weight {weights[r]} != reference sum {total} + carried {carried[r]} ({count} tokens)"


def clear_argmax(b: Backend, row: torch.Tensor) -> int | None:
    """The reference's argmax, or None where its top-2 margin is within the noise (a near-tie)."""
    top = torch.topk(row, 2)
    return int(top.indices[0]) if float(top.values[0] - top.values[1]) > b.margin else None


def check_greedy(b: Backend, out: SequenceState, starts: list[int], prefixes: list[list[int]]) -> int:
    """Rows continue their input's ids unchanged, and every token after ``starts[r]`` is the reference's argmax
    wherever the reference's top-2 margin exceeds ``b.margin``. Returns how many tokens were compared."""
    compared = 0
    for r, (ids, _) in enumerate(real_rows(out)):
        assert ids[:starts[r]] == prefixes[r], f"row {r}: the input's tokens changed"
        ref = b.logprobs(ids)
        for j in range(starts[r], len(ids)):
            want = clear_argmax(b, ref[j - 1])
            if want is not None:
                assert ids[j] == want, f"row {r} token {j}: greedy chose {ids[j]}, the reference's argmax is {want}"
                compared += 1
    return compared


CFG_SCALE = 1.5  # the oracle's classifier-free guidance calls (no negative prompt: the unconditional branch is BOS)


def check_cfg(b: Backend, out: SequenceState, starts: list[int], last: list[int]) -> int:
    """Every token after ``starts[r]`` is the argmax of ``uncond + s * (cond - uncond)`` (loop/cfg.py's formula), each
    branch the reference's own log-probs: ``cond`` after the row's ids, ``uncond`` after BOS (the input's last token
    without one) and the tokens this call generated before it; where the guided top-2 margin exceeds the noise of
    ``2 s + 1`` log-probs. Returns how many tokens were compared."""
    compared, bos = 0, b.model.tokenizer.bos_token_id
    for r, (ids, _) in enumerate(real_rows(out)):
        gen = ids[starts[r]:]
        if not gen:
            continue
        cond = b.logprobs(ids)
        uncond = b.logprobs([bos if bos is not None else last[r]] + gen)
        for k in range(len(gen)):
            guided = uncond[k] + CFG_SCALE * (cond[starts[r] + k - 1] - uncond[k])
            top = torch.topk(guided, 2)
            if float(top.values[0] - top.values[1]) > (2 * CFG_SCALE + 1) * b.margin:
                assert gen[k] == int(top.indices[0]), (f"row {r} token {starts[r] + k}: guided greedy chose {gen[k]}, the "
                                                        f"reference's guided argmax is {int(top.indices[0])}")
                compared += 1
    return compared


def option_scores(b: Backend, inp: SequenceState, options: list[str]) -> tuple[list[list[list[int]]], list[list[float]]]:
    """Per row and option: the ids of ``inp + option`` (continuum's own tokenization of the option in context) and
    the reference's total log-prob of the option's tokens there."""
    base = real_rows(inp)
    all_ids, scores = [[] for _ in base], [[] for _ in base]
    for o in options:
        for r, (ids, _) in enumerate(real_rows(inp + o)):
            n = len(base[r][0])
            assert ids[:n] == base[r][0], f"row {r}: adding {o!r} changed the row's tokens"
            ref = b.logprobs(ids)
            all_ids[r].append(ids)
            scores[r].append(sum(float(ref[j - 1, ids[j]]) for j in range(n, len(ids))))
    return all_ids, scores


def check_choice(b: Backend, inp: SequenceState, out: SequenceState, options: list[str]) -> int:
    """A greedy choice's row is ``inp + option`` for one option, that option's value, and the reference's best
    option wherever the reference's best two option totals are further apart than the noise (per token of the two
    options: ``1e-3`` on transformers, a log-prob's tolerance ``2 * DECODE_TOL`` on llama.cpp). Returns the rows compared."""
    all_ids, scores = option_scores(b, inp, options)
    values = out.value if out.rows > 1 else [out.value]
    compared = 0
    for r, (ids, _) in enumerate(real_rows(out)):
        picked = [i for i, o_ids in enumerate(all_ids[r]) if o_ids == ids]
        assert picked, f"row {r}: {ids[-4:]} is no option's tokens after the input"
        assert options[picked[0]] == values[r], (r, options[picked[0]], values[r])
        order = sorted(range(len(options)), key=lambda i: -scores[r][i])
        best = order[0]
        if len(order) > 1:
            second = order[1]
            tokens = len(all_ids[r][best]) + len(all_ids[r][second]) - 2 * len(real_rows(inp)[r][0])
            if scores[r][best] - scores[r][second] <= max(b.margin, b.tol) * max(tokens, 1):
                continue
        assert best in picked, (f"row {r}: chose {values[r]!r} (reference total {scores[r][picked[0]]:.5f}); the "
                                f"reference's best is {options[best]!r} ({scores[r][best]:.5f}); all {scores[r]}")
        compared += 1
    return compared


def check_beams(b: Backend, inp: SequenceState, out: SequenceState, n: int, k: int) -> bool:
    """A fresh ``beam_search(n)`` of ``k`` tokens equals transformers' ``generate(num_beams=n, length_penalty=0)``
    (both rank by summed log-probs) as a set of sequences, each new weight generate's score (1e-3); where the sets
    differ, the step where they part must be a near-tie in the reference (n-th vs (n+1)-th candidate within
    ``b.margin``). Skipped where a beam ends early (EOS: generate keeps finished hypotheses aside)."""
    eos = b.hf.generation_config.eos_token_id
    ours_rows = real_rows(out)
    if k == 0:  # n copies of each row, weights unchanged (generate takes no max_new_tokens=0)
        assert [x for x, _ in ours_rows] == [ids for ids, _ in real_rows(inp) for _ in range(n)]
        assert torch.equal(out.weights.flatten(), inp.weights.flatten().repeat_interleave(n))
        return True
    for i, (ids, _) in enumerate(real_rows(inp)):
        res = b.hf.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                            do_sample=False, num_beams=n, num_return_sequences=n, max_new_tokens=k, length_penalty=0.0,
                            output_scores=True, return_dict_in_generate=True, pad_token_id=eos)
        theirs = [tuple(s[len(ids):].tolist()) for s in res.sequences]
        ours = [tuple(x[len(ids):]) for x, _ in ours_rows[i * n:(i + 1) * n]]
        assert all(x[:len(ids)] == ids for x, _ in ours_rows[i * n:(i + 1) * n]), "a beam lost its input's tokens"
        if any(len(t) != k or eos in t for t in theirs + ours):
            return False
        if set(ours) == set(theirs):
            w0 = inp.weights.flatten()[i].item()
            got = sorted((out.weights.flatten()[i * n:(i + 1) * n] - w0).tolist(), reverse=True)
            want = sorted(res.sequences_scores.tolist(), reverse=True)
            assert max(abs(a - c) for a, c in zip(got, want)) <= 1e-3, (got, want)
            continue
        # (the sets differ: a brute-force beam search on the reference's own log-probs must meet a near-tie on its way;
        # the final sequences' prefixes do not say where the live beams parted, since a beam alive at a step may be
        # dropped later: the stress driver, window backend, seed 1802, history 24)
        found, gap = _reference_beams(b, ids, n, k)
        assert set(ours) == found or gap <= b.margin, (
            f"beams differ where the reference's own beam search met no near-tie (its smallest n-th vs (n+1)-th gap "
            f"{gap:.3g}): ours {ours}, its {sorted(found)}, generate's {theirs}")
    return True


def _reference_beams(b: Backend, ids: list[int], n: int, k: int) -> tuple[set, float]:
    """A beam search of ``n`` beams and ``k`` steps run on the reference's log-probs (each beam's next row from a fresh
    evaluation of its ids): its final beams, and the smallest gap between its n-th and (n+1)-th candidates."""
    beams: list[tuple[float, tuple[int, ...]]] = [(0.0, ())]
    smallest = float("inf")
    for _ in range(k):
        cands = []
        for score, p in beams:
            row = torch.as_tensor(b.logprobs(ids + list(p))[-1], dtype=torch.float64)
            top = torch.topk(row, n + 1)
            cands += [(score + float(v), p + (int(t),)) for v, t in zip(top.values, top.indices)]
        cands.sort(key=lambda c: c[0], reverse=True)
        smallest = min(smallest, cands[n - 1][0] - cands[n][0])
        beams = cands[:n]
    return {p for _, p in beams}, smallest


def check_pattern(out: SequenceState, pattern: str | None, schema: str | None) -> None:
    """A finished regex/JSON step's text matches the pattern (Python's ``re``) or parses and fits the schema
    (``jsonschema``); an unfinished one refuses to give a value."""
    import json

    import jsonschema

    from continuum.errors import IncompleteGenerationError

    texts = out.last_text if out.rows > 1 else [out.last_text]
    for text, reason in zip(texts, sum(out.finish_reasons, [])):
        if reason in ("length", "context"):
            continue
        if pattern is not None:
            assert re.fullmatch(pattern, text), (pattern, text, reason)
        else:
            jsonschema.validate(json.loads(text), JSON_SCHEMAS[schema])
    if any(reason in ("length", "context") for reason in sum(out.finish_reasons, [])):
        try:
            out.value
        except IncompleteGenerationError:
            return
        raise AssertionError("an unfinished constrained step gave a value")


# ------------------------------------------------------------------------------------------- the machine's steps
@dataclass(frozen=True)
class Call:
    kind: str  # greedy | lookup (greedy, speculating) | cfg (greedy, guided) | sample | fork | beam | choice | regex | json
    k: int | None = 4
    n: int = 1
    arg: Any = None  # options, a pattern or a schema's name
    seed: int = 0
    variant: str = "plain"
    suffix: str = ""  # text added to the input first (as a program would: ``pick(s + " ok?")``)


@dataclass
class Held:
    """A state the history holds, with the weight the algebra carried per row on top of its own tokens' log-probs
    (``state + other`` carries ``other``'s weight; ``None``: unknown)."""

    state: SequenceState
    carried: list
    final: bool = False  # by a call without max_tokens: checked, never continued (test_oracle's regressions)

    def __repr__(self) -> str:
        return f"Held({self.state.shape}, {[t[-24:] for t in self.state]!r})"


def cut_carried(before: SequenceState, after: SequenceState, carried: list) -> list:
    """A row that a cut shortened keeps only its kept tokens' log-probs (docs/state.md); an uncut row keeps all."""
    return [0.0 if len(a) < len(t) else c for t, a, c in zip(before, after, carried)]


def prepare(h: Held, call: Call) -> tuple[SequenceState, list]:
    """The call's input: sample 0 for a one-sample sampler, cut back under MAX_TOKENS, plus the call's suffix."""
    s, c = h.state, list(h.carried)
    if call.kind != "sample" and s.samples > 1:
        s, c = s[:, 0, :], [c[b * s.samples] for b in range(s.batch)]
    while longest(s) > MAX_TOKENS - 40:
        cut = s[chars_key(s, slice(None, max(len(t) for t in s) // 2))]
        s, c = cut, cut_carried(s, cut, c)
    return (s + call.suffix if call.suffix else s), c


def execute(b: Backend, call: Call, inp: SequenceState, asynchronous: bool = False):
    n = inp.samples if call.kind == "sample" else call.n
    gen = b.generator(call.variant, call.kind, n, call.arg)
    rng = torch.Generator().manual_seed(call.seed) if call.kind in ("sample", "fork") else None
    k = None if call.kind == "choice" else call.k
    return gen.acall(inp, max_tokens=k, rng=rng) if asynchronous else gen(inp, max_tokens=k, rng=rng)


def record(what: str, text: str) -> None:
    """``note`` the step and count it as an ``event`` inside hypothesis (the tour runs outside it)."""
    with contextlib.suppress(InvalidArgument):
        note(text)
        event(what)


def verify(b: Backend, call: Call, inp: SequenceState, carried: list, out: SequenceState) -> Held:
    """Checks ``out`` against the reference; returns it with the weights it carries."""
    record(call.kind, f"{call} on {list(inp)!r} -> {list(out)!r} weights {out.weights.flatten().tolist()}")
    src = [r if out.samples == inp.samples else r // out.samples for r in range(out.rows)]
    inputs = real_rows(inp)
    out_carried = [carried[i] for i in src]
    for r, (ids, _) in enumerate(real_rows(out)):
        assert ids[:len(inputs[src[r]][0])] == inputs[src[r]][0], f"row {r}: the input's tokens changed"
    check_state(b, out, out_carried)
    if call.kind in ("greedy", "lookup"):
        compared = check_greedy(b, out, [len(inputs[i][0]) for i in src], [inputs[i][0] for i in src])
        record(f"greedy tokens compared: {min(compared, 3)}+", "")
        if call.kind == "lookup":
            spec = out._last.speculation if out._last is not None else None
            record(f"lookup drafts accepted: {min((spec or {}).get('accepted', 0), 2)}+", "")
    elif call.kind == "cfg":
        last = [real_rows(inp)[i][0][-1] for i in src]
        record(f"guided tokens compared: {min(check_cfg(b, out, [len(inputs[i][0]) for i in src], last), 3)}+", "")
    elif call.kind == "choice":
        record(f"choices compared: {check_choice(b, inp, out, list(call.arg))}", "")
    elif call.kind == "beam" and b.kind == "hf":
        record(f"beams compared with generate: {check_beams(b, inp, out, call.n, call.k)}", "")
    elif call.kind in ("regex", "json"):
        check_pattern(out, call.arg if call.kind == "regex" else None, call.arg if call.kind == "json" else None)
    return Held(out, out_carried, final=call.k is None and call.kind in ("greedy", "lookup"))


def keep(*held: Held):
    """The states later steps may continue (not one that filled a small pool: see ``Held.final``)."""
    return multiple(*[h for h in held if not h.final])


def gather(b: Backend, jobs: list[tuple]) -> list[Held]:
    """``(call, input, carried)`` jobs merged by ``asyncio.gather`` of ``acall``, each result verified."""
    async def main():
        return await asyncio.gather(*[execute(b, c, inp, asynchronous=True) for c, inp, _ in jobs])

    return [verify(b, c, inp, carried, out) for (c, inp, carried), out in zip(jobs, asyncio.run(main()))]


def longest(state: SequenceState) -> int:
    return max(len(ids) for ids, _ in real_rows(state))


def run_program(b: Backend, h: Held, program: list[Call]) -> list[tuple]:
    """One program instance (on run_batch's worker thread): its calls chained, each input and output kept."""
    done = []
    for i, call in enumerate(program):
        if call.k is None and i < len(program) - 1:  # (only last: see Held.final)
            call = Call(call.kind, 6, call.n, call.arg, call.seed, call.variant, call.suffix)
        inp, carried = prepare(h, call)
        out = execute(b, call, inp)
        done.append((call, inp, carried, out))
        src = [r if out.samples == inp.samples else r // out.samples for r in range(out.rows)]
        h = Held(out, [carried[i] for i in src])
    return done
