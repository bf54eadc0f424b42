"""``SequenceState``: an immutable batch of token sequences with weights and a reusable KV cache.

Layout (private; the public properties present it left-padded)
--------------------------------------------------------------
Rows are ``(batch, sample)`` pairs, batch-major: row ``b * samples + s``. Per row the state keeps
token ids, an attention mask and per-token log-probs in ``(rows, columns)`` matrices. The KV
cache covers the first ``C`` columns of every row; columns ``C:`` are the *uncached suffix*, which
the next forward pass prefills in one call. Masked columns (left padding, or *holes* left where
a row was cut or finished early) may appear anywhere; positions are always
``cumsum(mask) - 1``, so holes never shift a token's position.

Two invariants keep continuing cheap and exact:

* the last column is a real token of every non-empty row, and it is never cached, so the next
  step's logits come from prefilling the suffix (at most ``new tokens + 1`` positions computed);
* nothing a state can see is ever written after construction (new KV columns are appended past
  every view, see ``cache.py``), so states share tensors (and cache views) freely: slicing,
  adding and continuing never change another state.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from itertools import accumulate
from typing import Any

import torch

from ..errors import BatchMismatch, ContinuumTypeError
from ..models import kv as kvcache
from .laststep import LastStep, read_values
from .layout import NAN as _NAN
from .layout import rebuild, right_aligned

__all__ = ["SequenceState", "LastStep"]

VIEWS = ("real", "texts", "cached")  # the memoised per-row views a state may take over from another (_memo_from, stack)


def _as_list(value: Any) -> list:
    return value if isinstance(value, list) else [value]


class SequenceState:
    """Token sequences, their log-prob weights and a KV cache, for ``batch x samples`` rows.

    States are immutable: every operation returns a new state, sharing what it can.

    * ``state[batch, sample, chars]`` selects rows and cuts text (shorthands: ``state[chars]``
      when batch == samples == 1, ``state[sample, chars]`` when batch == 1,
      ``state[batch, chars]`` when samples == 1). Cutting from the start keeps the KV cache of
      the longest token prefix that lies inside the kept text.
    * ``state + "text"``, ``state + ["per", "batch row"]``, ``state + other_state``,
      ``"text" + state``.
    * ``list(state)`` gives the full texts, batch-major.
    * Feed a state to any ``continuous(...)`` generator to continue it.

    Example:
        >>> s = continuous(generate.text(model))("Once upon a time", max_tokens=10)  # doctest: +SKIP
        >>> s2 = choice_c(s + ". The end? ")                                          # doctest: +SKIP
        >>> s3 = text_c(s2[:20])                                                     # doctest: +SKIP
    """

    __slots__ = ("_model", "_ids", "_mask", "_logprobs", "_weights", "_kv", "batch", "samples", "_last", "_cache",
                 "__weakref__")  # (a joint call's short callers know their joint result weakly: state/deferred.py)

    def __init__(self, *, model, ids: torch.Tensor, mask: torch.Tensor, logprobs: torch.Tensor, weights: torch.Tensor,
                 kv: kvcache.KV | None, batch: int, samples: int, last: LastStep | None = None):
        if ids.shape[0] != batch * samples:
            raise ValueError(f"{ids.shape[0]} rows for batch={batch} x samples={samples}")
        self._model, self._ids, self._mask, self._logprobs = model, ids, mask, logprobs
        self._weights, self._kv, self.batch, self.samples, self._last = weights, kv, batch, samples, last
        self._cache: dict[str, Any] = {}

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_prompts(cls, model, prompts: str | Sequence[str]) -> SequenceState:
        """A state holding tokenized prompts (no cache, zero weights, one sample)."""
        hint = "pass a str, a non-empty list of str or (to a continuous generator) a SequenceState"
        if not isinstance(prompts, (str, list, tuple)):
            raise ContinuumTypeError(f"a prompt must be text: {hint}; got {type(prompts).__name__}"
                                     + (" (decode bytes first)" if isinstance(prompts, (bytes, bytearray)) else ""))
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        if not prompts:
            raise BatchMismatch(f"no prompts given (an empty list): {hint}")
        bad = [(i, type(p).__name__) for i, p in enumerate(prompts) if not isinstance(p, str)]
        if bad:
            raise ContinuumTypeError(f"prompt {bad[0][0]} of the list is a {bad[0][1]}, not a str: {hint}")
        rows = model.tokenizer.encode_prompts(prompts)
        return cls._from_rows(model, rows, [[_NAN] * len(r) for r in rows], torch.zeros(len(rows)), len(rows), 1, None)

    @classmethod
    def _from_rows(cls, model, rows: list[list[int]], lps: list[list[float]], weights: torch.Tensor, batch: int,
                   samples: int, last: LastStep | None) -> SequenceState:
        ids, mask, lp = right_aligned(rows, lps, model.tokenizer.pad_token_id, model.device)
        return cls(model=model, ids=ids, mask=mask, logprobs=lp, weights=weights, kv=None, batch=batch,
                   samples=samples, last=last)

    def _new(self, **fields) -> SequenceState:
        """A plain state of ``fields`` (a lazily built state's sum is not lazy: ``state/deferred.py``)."""
        return SequenceState(**fields)

    def _rebuild(self, keep_cached: Sequence[int], tails: Sequence[tuple[list[int], list[float]]], weights: torch.Tensor,
                 last: LastStep | None) -> SequenceState:
        """A state keeping, per row, its first ``keep_cached[r]`` cached tokens, followed by ``tails[r]``
        (:func:`continuum.state.layout.rebuild`)."""
        return rebuild(self, keep_cached, tails, weights, last)

    def _memo_from(self, other: SequenceState, rows: slice | None = None) -> SequenceState:
        """``self`` with ``other``'s memoised per-row views (of its rows ``rows``), where ``self`` holds the same real
        tokens, log-probs and cached counts in those rows (a call's result, a joint call's caller): not recomputed."""
        for key in VIEWS:
            if key in other._cache:
                self._cache[key] = other._cache[key] if rows is None else other._cache[key][rows]
        return self

    def _last_column_used(self, C: int) -> bool:
        """Whether some row holds a real token in cached column ``C - 1`` (one row: one element read)."""
        if self._mask.shape[0] == 1:
            return bool(self._mask[0, C - 1])
        return bool(self._mask[:, C - 1].any())

    # ------------------------------------------------------------------ per-row views (memoised)
    @property
    def rows(self) -> int:
        return self.batch * self.samples

    def _real_rows(self) -> list[tuple[list[int], list[float]]]:
        """Per row: (real token ids, their log-probs) in order."""
        if "real" not in self._cache:
            if self._mask.shape[0] >= 8:  # (many rows: the real cells gathered in one op, row-major, then cut per row)
                real = self._mask.bool()
                ids, lps = self._ids[real].tolist(), self._logprobs[real].tolist()
                ends = list(accumulate(real.sum(1).tolist()))
                self._cache["real"] = [(ids[s:e], lps[s:e]) for s, e in zip([0] + ends[:-1], ends)]
            else:
                mask = self._mask.bool().tolist()
                ids, lps = self._ids.tolist(), self._logprobs.tolist()
                self._cache["real"] = [([t for t, m in zip(ri, rm) if m], [p for p, m in zip(rl, rm) if m])
                                       for ri, rl, rm in zip(ids, lps, mask)]
        return self._cache["real"]

    def _real_lengths(self) -> list[int]:
        """Per row: how many real tokens it holds (from the memoised rows when known: no tensor read)."""
        if "real" in self._cache:
            return [len(ids) for ids, _ in self._cache["real"]]
        return self._mask.sum(1).tolist()

    def _cached_real(self) -> list[int]:
        """Per row: how many real tokens the cache covers (memoised: ``state + text`` asks twice)."""
        if "cached" not in self._cache:
            C = kvcache.length(self._kv)
            self._cache["cached"] = self._mask[:, :C].sum(1).tolist() if C else [0] * self.rows
        return list(self._cache["cached"])

    @property
    def texts(self) -> list[str]:
        """The full decoded text of every row (prompt included), batch-major."""
        if "texts" not in self._cache:
            self._cache["texts"] = self._model.tokenizer.decode_batch([ids for ids, _ in self._real_rows()])
        return list(self._cache["texts"])

    # ------------------------------------------------------------------ public properties
    @property
    def shape(self) -> tuple[int, int]:
        """``(batch, samples)``."""
        return (self.batch, self.samples)

    @property
    def model(self):
        return self._model

    @property
    def tokenizer(self):
        """The tokenizer of the model this state belongs to: the Hugging Face tokenizer on transformers, the
        GGUF's (:class:`~continuum.models.llamacpp.LlamaTokenizer`) on llama.cpp."""
        tok = self._model.tokenizer
        return getattr(tok, "hf", tok)

    @property
    def token_ids(self) -> torch.Tensor:
        """``(batch * samples, length)`` token ids, batch-major, left-padded with the pad token."""
        return self._compact()[0]

    @property
    def attention_masks(self) -> torch.Tensor:
        """``(batch * samples, length)`` attention masks matching :attr:`token_ids`."""
        return self._compact()[1]

    @property
    def token_logprobs(self) -> torch.Tensor:
        """Log-prob of each generated token, aligned with :attr:`token_ids`; NaN for prompt/added text and padding."""
        return self._compact()[2]

    @property
    def weights(self) -> torch.Tensor:
        """``(batch, samples)``: sum of the model's raw log-probs of the generated tokens of each row."""
        return self._weights.reshape(self.batch, self.samples).clone()

    @property
    def cached_tokens(self) -> torch.Tensor:
        """``(batch, samples)``: how many of each row's tokens the KV cache covers."""
        return torch.tensor(self._cached_real(), dtype=torch.long).reshape(self.batch, self.samples)

    @property
    def kv_cache(self):
        """A transformers ``DynamicCache`` over the cached columns (a fresh object), or ``None``; on another
        backend, its own KV handle.

        Its columns follow the private layout (see the module docstring), not :attr:`token_ids`.
        """
        layers = kvcache.tensors(self._kv)
        if layers is None:
            return self._kv
        from ..models.hf.dynamic import to_dynamic_cache

        return to_dynamic_cache(layers, self._model.config)

    def _last_step(self) -> LastStep:
        if self._last is None:
            raise ValueError("this state was not produced by a generator, so it has no last step to read: "
                             "its texts are list(state); call a continuous generator on it to get one")
        return self._last

    @property
    def last_text(self):
        """The text the last generation step produced, shaped like a generator's output."""
        last, texts = self._last_step(), self.texts
        out = [texts[r][s:e] for r, (s, e) in enumerate(zip(last.starts, last.ends))]
        return self._shape_output(out)

    @property
    def finish_reasons(self) -> list[list[str]] | None:
        """``(batch, samples)`` nested list: why each row's last generation step ended, one of
        ``"eos"``, ``"stop"`` (a ``stop_at`` string), ``"length"`` (``max_tokens``), ``"context"``
        (the model's context length: see :attr:`truncated`) or ``"pattern"`` (the constraint
        completed). ``None`` for a state no generator produced. Slicing and adding keep them.
        """
        finish = self._last.finish if self._last is not None else None
        if finish is None:
            return None
        return [list(finish[b * self.samples:(b + 1) * self.samples]) for b in range(self.batch)]

    @property
    def truncated(self) -> torch.Tensor:
        """``(batch, samples)`` bool: True where the last generation step was cut by the context length."""
        finish = (self._last.finish if self._last is not None else None) or ("",) * self.rows
        return torch.tensor([f == "context" for f in finish], dtype=torch.bool).reshape(self.batch, self.samples)

    @property
    def reasoning(self):
        """The thought of the last step (a generator with ``reasoning=``), shaped like :attr:`value`;
        ``""`` where the row did not think (docs/reasoning.md)."""
        last, texts = self._last_step(), self.texts
        spans = last.thoughts or ((0, 0, 0, 0),) * self.rows  # (continuum.generate.reasoning.annotate writes them)
        return self._shape_output([t[min(a, len(t)):min(b, len(t))].strip("\n") for t, (_, a, b, _n) in zip(texts, spans)])

    @property
    def value(self):
        """The last step's value: its text (text/regex), the option (choice) or the parsed JSON.

        Texts of a text generator are :class:`~continuum.state.completion.Completion` strings (with
        ``finish_reason`` and ``truncated``). Raises :class:`~continuum.errors.IncompleteGenerationError`
        when a constrained step was cut by ``max_tokens`` (or the context length) before its pattern matched.
        Raises :class:`~continuum.errors.SchemaViolationError` (naming the row, JSON path and rule)
        when a JSON output fails its schema.
        """
        return self._shape_output(read_values(self, self._last_step()))

    def _shape_output(self, flat: list) -> Any:
        if self.samples == 1:
            return flat[0] if self.batch == 1 else flat
        nested = [flat[b * self.samples:(b + 1) * self.samples] for b in range(self.batch)]
        return nested[0] if self.batch == 1 else nested

    def _compact(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if "compact" not in self._cache:
            real = self._real_rows()
            self._cache["compact"] = right_aligned([r for r, _ in real], [p for _, p in real],
                                                    self._model.tokenizer.pad_token_id, self._ids.device)
        return self._cache["compact"]

    # ------------------------------------------------------------------ python protocol
    def __len__(self) -> int:
        return self.rows

    def __iter__(self) -> Iterator[str]:
        return iter(self.texts)

    def __str__(self) -> str:
        texts = self.texts
        if len(texts) == 1:
            return texts[0]
        return "\n".join(f"[{r // self.samples},{r % self.samples}] {t}" for r, t in enumerate(texts))

    def __repr__(self) -> str:
        def short(t: str) -> str:
            return repr(t if len(t) <= 60 else t[:25] + " ... " + t[-30:])
        texts = self.texts
        shown = ", ".join(short(t) for t in texts[:4]) + (f", ... (+{len(texts) - 4})" if len(texts) > 4 else "")
        w = [round(x, 3) for x in self._weights.tolist()[:4]]
        cached = self._cached_real()
        return (f"SequenceState(batch={self.batch}, samples={self.samples}, tokens={[len(r) for r, _ in self._real_rows()][:4]}, "
                f"cached={cached[:4]}, weights={w}, texts=[{shown}])")

    def to_html(self) -> str:
        """This state as HTML, what a notebook shows (tokens shaded by probability, cache and last-step
        boundaries, weights, finish reasons; :mod:`continuum.display`); write it to a file to view it."""
        from ..display import state_to_html
        return state_to_html(self)

    _repr_html_ = to_html  # Jupyter, VS Code and Colab draw a state with it

    # ------------------------------------------------------------------ row selection
    def _select(self, rows: Sequence[int], batch: int, samples: int) -> SequenceState:
        """Rows ``rows`` (any order, repeats allowed); columns that are padding in all of them are dropped."""
        idx = torch.tensor(list(rows), dtype=torch.long)
        dev = idx.to(self._ids.device)
        ids, mask, lp = self._ids.index_select(0, dev), self._mask.index_select(0, dev), self._logprobs.index_select(0, dev)
        kv, C = kvcache.select_rows(self._kv, idx), kvcache.length(self._kv)
        used = mask.bool().any(0)
        lead = int(used.long().argmax()) if bool(used.any()) else 0
        lead = min(lead, C)  # leading padding inside the cache: narrow it (a view)
        uncached = used[C:].nonzero().flatten() + C  # padding columns of the suffix: just drop them
        cols = torch.cat([torch.arange(lead, C, device=ids.device), uncached])
        if cols.numel() != ids.shape[1]:
            ids, mask, lp = ids[:, cols], mask[:, cols], lp[:, cols]
            kv = None if lead == C or kv is None else kvcache.narrow(kv, len(rows), lead)  # (any backend's KV)
        kv = kvcache.compact(kv)  # a few rows of a big cache: do not pin the rest
        return SequenceState(model=self._model, ids=ids, mask=mask, logprobs=lp,
                             weights=self._weights.index_select(0, idx.to(self._weights.device)),
                             kv=kv, batch=batch, samples=samples, last=self._last.select(rows) if self._last else None)

    # ------------------------------------------------------------------ indexing, adding, stacking, persistence
    def __getitem__(self, key) -> SequenceState | str | list[str]:
        return indexing.getitem(self, key)

    def _truncate(self, ends: Sequence[int]) -> SequenceState:
        """Keep the first ``ends[r]`` characters of each row, reusing the cache of what stays."""
        return indexing.truncate(self, ends)

    def __add__(self, other) -> SequenceState:
        return combine.add(self, other)

    def __radd__(self, other) -> SequenceState:
        return combine.radd(self, other)

    @staticmethod
    def stack(states: Sequence[SequenceState]) -> SequenceState:
        """Stack states along the batch axis (same tokenizer and samples), keeping their caches.

        Each state's cached columns are left-padded to the widest cache and its uncached suffix to
        the widest suffix, so every row keeps its cache and positions.
        """
        return combine.stack(states)

    def to_model(self, model) -> SequenceState:
        """This state for ``model``: same tokens, weights, log-probs and last step.

        Another model (same tokenizer) gets no cache: a KV cache is only valid for the model that
        computed it, so the next generator recomputes every token, in one forward pass. The same
        model keeps the cache (moved if the model changed device, dropped if it changed dtype).
        Every continuous generator does this for you with its own model.

        Example:
            >>> s_b = s_a.to_model(model_b)          # doctest: +SKIP
            >>> s_b.cached_tokens                     # doctest: +SKIP
            tensor([[0]])
        """
        return convert.to_model(self, model)

    def save(self, path) -> None:
        """Save tokens, weights, log-probs and the KV cache (safetensors) with JSON metadata."""
        persistence.save(self, path)

    @classmethod
    def load(cls, path, model) -> SequenceState:
        """Load a state saved with :meth:`save` for ``model`` (which must use the same tokenizer).

        Saved from another model (or by an older version that recorded no model), the state keeps
        its tokens, weights, log-probs and last step but drops the KV cache, with a warning on the
        ``"continuum"`` logger; the next generator recomputes it in one pass.
        """
        return persistence.load(path, model)


# the operations live in their own modules; they import this one, so they are bound here, last
from . import combine, convert, indexing, persistence  # noqa: E402
