"""The llguidance engine: JSON Schema, Lark/GBNF grammars and regexes through ``LLMatcher``.

llguidance (the Rust engine behind vLLM, SGLang and llama.cpp's grammars) does the real work: it
compiles the grammar lazily against an ``LLTokenizer`` (built once per tokenizer and cached on
:class:`~continuum.models.tokenizer.Tokenizer`) and computes each row's allowed tokens as a
bitmask. This module puts it behind the guide protocol (:mod:`continuum.guides.base`):

* a guide holds one *template* matcher, compiled once; a row's state is a ``deep_copy()`` of it
  (~1 us, whereas compiling costs 0.5-5 ms);
* matchers are mutable: :meth:`LLGuidanceGuide.advance` consumes the token in place, so a row owns
  its matcher; the loop copies it when a row is duplicated (forks, beam reorders) or resumed;
* the bitmasks of all live rows are filled with llguidance's helpers (``llguidance.numpy``) into one
  preallocated per-thread buffer (in parallel on a shared ``LLExecutor`` for large batches on several
  cores), unpacked with numpy and applied with one masked copy (numpy on CPU, ``masked_fill_`` on
  accelerators);
* llguidance allows its EOS token when the grammar accepts; every EOS id of our tokenizer
  (``generation_eos`` included) gets the same verdict.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..errors import GuideLimitError
from .limits import compile_limits, explain_llguidance_error, llguidance_limit_hit, llguidance_limits

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # a TypedDict of the stub only

__all__ = ["LLGuidanceGuide", "GrammarCompileError", "llguidance_guide", "json_grammar", "lark_grammar",
           "regex_grammar"]

_LOCK = threading.Lock()
_EXECUTOR: Any = None
# Filling a row's bitmask takes ~5-20 us; the thread pool only pays off for many rows on several cores
# (measured on 2 busy cores: dispatching 8 rows cost ~50x more than filling them one by one).
_PAR_MIN_ROWS = 16
_CPUS = os.cpu_count() or 1


class GrammarCompileError(Exception):
    """llguidance refused a grammar; callers turn it into the error of their constraint kind."""


def _executor():
    global _EXECUTOR
    if _EXECUTOR is None:
        with _LOCK:
            if _EXECUTOR is None:
                from llguidance import LLExecutor

                _EXECUTOR = LLExecutor()
    return _EXECUTOR


def json_grammar(schema: dict, whitespace_pattern: str | None = r"[ ]?", lenient: bool = False) -> str:
    """The llguidance grammar of a (prepared) JSON schema dict.

    ``whitespace_pattern`` bounds the whitespace between tokens like the outlines-core engine does
    (default: one optional space), so a weak model or a beam search cannot pad forever; ``None``
    leaves llguidance's default (flexible whitespace). An ``"x-guidance"`` entry of the schema
    overrides it. ``lenient``: llguidance ignores the keywords it does not implement and reads
    ``oneOf`` as ``anyOf`` (an over-approximation: outputs must be validated).
    """
    from llguidance import LLMatcher

    defaults: JsonCompileOptions = {"whitespace_pattern": whitespace_pattern} if whitespace_pattern is not None else {}
    if lenient:
        defaults["lenient"] = True
        defaults["coerce_one_of"] = True
    try:
        return LLMatcher.grammar_from_json_schema(schema, defaults=defaults or None)
    except Exception as exc:  # not a JSON object, or x-guidance options it does not know
        raise GrammarCompileError(str(exc)) from exc


def lark_grammar(grammar: str) -> str:
    """The llguidance grammar of a Lark grammar in llguidance's syntax."""
    from llguidance import LLMatcher

    try:
        return LLMatcher.grammar_from_lark(grammar)
    except Exception as exc:  # e.g. a NUL character in the text
        raise GrammarCompileError(str(exc)) from exc


def regex_grammar(regex: str) -> str:
    """The llguidance grammar of a regex (Rust ``regex`` syntax, matched in full)."""
    from llguidance import LLMatcher

    try:
        return LLMatcher.grammar_from_regex(regex)
    except Exception as exc:
        raise GrammarCompileError(str(exc)) from exc


class LLGuidanceGuide:
    """An llguidance grammar for one tokenizer, behind the guide protocol (states: ``LLMatcher``).

    Example:
        >>> guide = llguidance_guide(lark_grammar('start: "a"+'), model.tokenizer)   # doctest: +SKIP
        >>> m = guide.new_state(); logprobs = guide.apply_mask(logprobs, [m])         # doctest: +SKIP
    """

    copy_free = False

    def __init__(self, grammar: str, tokenizer):
        from llguidance import LLMatcher

        self.grammar = grammar
        self.key = "llguidance:" + hashlib.sha256(grammar.encode()).hexdigest()[:24]
        lltok = tokenizer.llg_tokenizer
        try:  # explicit resource limits (continuum.guides.limits), not llguidance's defaults
            template = LLMatcher(lltok, grammar, log_level=0, limits=llguidance_limits())
            if not template.is_error():  # the first mask builds the initial lexer: a limit may stop it here
                first = np.empty((lltok.vocab_size + 31) // 32, dtype=np.int32)
                template.unsafe_compute_mask_ptr(first.ctypes.data, first.nbytes)
        except Exception as exc:  # documented not to raise, but be safe
            raise GrammarCompileError(explain_llguidance_error(str(exc))) from exc
        if template.is_error():
            raise GrammarCompileError(explain_llguidance_error(template.get_error()))
        self._template = template
        self.n_vocab: int = lltok.vocab_size
        self._words = (self.n_vocab + 31) // 32
        self.eos_token_id: int = tokenizer.eos_token_id
        self._extra_eos = sorted(i for i in tokenizer.eos_token_ids if i != self.eos_token_id and i < self.n_vocab)
        self._local = threading.local()

    def __repr__(self) -> str:
        return f"LLGuidanceGuide({self.key})"

    def new_state(self):
        return self._template.deep_copy()

    def copy(self, state):
        return state.deep_copy() if state is not None else None

    def is_final(self, state) -> bool:
        return state is not None and state.is_accepting()

    def is_done(self, state) -> bool:
        """Accepted and stopped (the grammar allows nothing but EOS)."""
        return state is not None and state.is_stopped() and state.is_accepting()

    def advance(self, state, token_id: int):
        """Consume ``token_id`` in place; ``None`` (dead) when the grammar does not allow it."""
        if state is None or not state.consume_token(token_id):
            if state is not None and state.is_error() and llguidance_limit_hit(state.get_error()):
                raise GuideLimitError("the constraint stopped while decoding: "
                                      + explain_llguidance_error(state.get_error()))
            return None
        return state

    def forced_tokens(self, state) -> list[int]:
        return list(state.compute_ff_tokens()) if state is not None else []

    def _bitmask(self, rows: int) -> np.ndarray:
        """This thread's preallocated ``(rows, words)`` bitmask (grown, never reallocated per step;
        per thread because a guide is shared by concurrent calls)."""
        buf = getattr(self._local, "bitmask", None)
        if buf is None or buf.shape[0] < rows:
            from llguidance.numpy import allocate_token_bitmask

            buf = self._local.bitmask = allocate_token_bitmask(max(rows, 8), self.n_vocab)
        return buf[:rows]

    def disallowed_mask(self, states: Sequence[Any]) -> np.ndarray:
        """Boolean ``(len(states), n_vocab)`` array: True where a state does NOT allow the token."""
        from llguidance.numpy import fill_next_token_bitmask, fill_next_token_bitmask_par

        bitmask = self._bitmask(len(states))
        if len(states) >= _PAR_MIN_ROWS and _CPUS >= 4:
            fill_next_token_bitmask_par(_executor(), [(m, i) for i, m in enumerate(states)], bitmask)
        else:
            for i, m in enumerate(states):
                fill_next_token_bitmask(m, bitmask, i)
        # invert the 32-bit words in place (cheap), then unpack: the mask to fill, with no pass over vocab-wide bools
        np.invert(bitmask, out=bitmask)
        bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little", count=self.n_vocab)
        if self._extra_eos:
            bits[:, self._extra_eos] = bits[:, self.eos_token_id, None]
        return bits.view(np.bool_)

    def apply_mask(self, logprobs: torch.Tensor, states: Sequence[Any]) -> torch.Tensor:
        """Set the disallowed tokens of every row with a state to ``-inf`` (in place); ``None`` rows are left free."""
        live = [r for r, s in enumerate(states) if s is not None]
        if not live:
            return logprobs
        R, V = logprobs.shape
        banned = self.disallowed_mask([states[r] for r in live])
        n = min(V, self.n_vocab)
        if (logprobs.device.type == "cpu" and logprobs.dtype == torch.float32 and logprobs.is_contiguous()
                and not logprobs.requires_grad):
            # numpy's masked copy is ~1.5x torch's masked_fill_ on CPU; writes through the shared memory
            out = logprobs.numpy()
            if len(live) == R:
                np.copyto(out[:, :n], -np.inf, where=banned[:, :n])
            else:
                for i, r in enumerate(live):
                    np.copyto(out[r, :n], -np.inf, where=banned[i, :n])
            if n < V:  # an LM head wider than the vocabulary (padding): its extra ids are never allowed
                out[live, n:] = -np.inf
            return logprobs
        mask = torch.from_numpy(banned)
        if self.n_vocab != V:
            full = torch.ones((len(live), V), dtype=torch.bool)
            full[:, :n] = mask[:, :n]
            mask = full
        mask = mask.to(logprobs.device, non_blocking=True)
        if len(live) == R:
            return logprobs.masked_fill_(mask, float("-inf"))
        rows = torch.tensor(live, device=logprobs.device)
        logprobs[rows] = logprobs[rows].masked_fill(mask, float("-inf"))
        return logprobs


def llguidance_guide(grammar: str, tokenizer) -> LLGuidanceGuide:
    """Compile an llguidance ``grammar`` for ``tokenizer`` (cached per tokenizer: the second call is instant).

    Raises :class:`GrammarCompileError` with llguidance's message when the grammar is refused.
    """
    key = ("llguidance", grammar, compile_limits())  # a guide compiled under other limits is another guide
    with _LOCK:
        guide = tokenizer.index_cache.get(key)
    if guide is None:
        guide = LLGuidanceGuide(grammar, tokenizer)
        with _LOCK:
            guide = tokenizer.index_cache.setdefault(key, guide)
    return guide
