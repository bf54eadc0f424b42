"""Classifier-free guidance: the guided scores, the validated settings, the unconditional branch.

The formula (Sanchez et al. 2023, "Stay on topic with classifier-free guidance"), on the
log-softmaxed scores of both branches::

    guided = uncond + scale * (cond - uncond)
    guided = r * cond + (1 - r) * guided          # guidance_rescale = r (0: no blend)

:func:`guided_logprobs` is that formula and nothing else: the decoding loop, choice scoring and
an HF ``LogitsProcessor`` all call it (one implementation). :class:`Guidance` holds validated
generator settings; :class:`UnconditionalBranch` runs the unconditional branch next to the
decoding loop with its own KV cache, in one forward with 2x rows (``"batched"``) or in a second
forward per step (``"sequential"``).

Example:
    >>> cond = torch.log_softmax(torch.tensor([[2.0, 1.0, 0.0]]), -1)
    >>> uncond = torch.log_softmax(torch.tensor([[2.0, 0.0, 0.0]]), -1)
    >>> guided_logprobs(cond, uncond, 3.0).argmax(-1).item()   # the token the prompt favours most
    1
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..errors import BatchMismatch, ContextLengthError, GeneratorArgumentError
from ..models import kv as kvcache
from ..models.request import Request
from .checks import PREALLOCATED

__all__ = ["guided_logprobs", "guided_scores", "Guidance", "UnconditionalBranch"]

_MODES = ("batched", "sequential")


def guided_logprobs(cond: torch.Tensor, uncond: torch.Tensor, scale: float, rescale: float = 0.0) -> torch.Tensor:
    """``uncond + scale * (cond - uncond)``, blended ``rescale * cond + (1 - rescale) * guided``.

    Elementwise on log-probs of any shape (a vocabulary row, or the log-probs of chosen tokens).
    A token the conditional branch excludes (``-inf``) stays excluded, whatever ``uncond`` says.
    """
    guided = uncond + scale * (cond - uncond)
    if rescale:
        guided = rescale * cond + (1.0 - rescale) * guided
    return guided.masked_fill(cond == -math.inf, -math.inf)


def guided_scores(cond_logits: torch.Tensor, uncond_logits: torch.Tensor, scale: float, rescale: float = 0.0) -> torch.Tensor:
    """:func:`guided_logprobs` of raw logits (or of log-probs: log-softmax leaves them unchanged)."""
    return guided_logprobs(torch.log_softmax(cond_logits.float(), -1), torch.log_softmax(uncond_logits.float(), -1),
                           scale, rescale)


@dataclass(frozen=True)
class Guidance:
    """Validated classifier-free guidance settings of a generator.

    :meth:`make` returns ``None`` when ``scale == 1`` (no guidance).

    ``negative``: the negative prompt(s) as token ids, one tuple (shared by every batch row) or one
    per batch row; ``None`` means the default unconditional prompt (BOS, else the row's last token).
    """

    scale: float
    rescale: float = 0.0
    negative: tuple[tuple[int, ...], ...] | None = None
    per_row: bool = False  # one negative prompt per batch row (a list was given)
    mode: str = "batched"

    @classmethod
    def make(cls, tokenizer, guidance_scale: float = 1.0, negative_prompt: str | Sequence[str] | None = None,
             guidance_rescale: float = 0.0, cfg_mode: str = "batched") -> Guidance | None:
        """Check the generator arguments; raise :class:`GeneratorArgumentError` saying what to pass instead."""
        for name, value in (("guidance_scale", guidance_scale), ("guidance_rescale", guidance_rescale)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise GeneratorArgumentError(f"{name} must be a finite number, got {value!r}")
        if not 0.0 <= guidance_rescale <= 1.0:
            raise GeneratorArgumentError(f"guidance_rescale must be in [0, 1] (0 = no blend), got {guidance_rescale}")
        if cfg_mode not in _MODES:
            raise GeneratorArgumentError(f"cfg_mode must be 'batched' (one forward, 2x rows) or 'sequential' "
                                         f"(two forwards, less memory), got {cfg_mode!r}")
        negative, per_row = None, False
        if negative_prompt is not None:
            per_row = not isinstance(negative_prompt, str)
            prompts = list(negative_prompt) if isinstance(negative_prompt, (list, tuple)) else [negative_prompt]
            if not prompts or not all(isinstance(p, str) for p in prompts):
                raise GeneratorArgumentError(f"negative_prompt must be a string or a non-empty list of strings (one per "
                                             f"prompt), got {negative_prompt!r}")
            negative = tuple(tuple(ids) for ids in tokenizer.encode_prompts(prompts, argument="negative_prompt"))
            empty = [i for i, ids in enumerate(negative) if not ids]
            if empty:
                raise GeneratorArgumentError(f"negative prompt(s) {empty} tokenize to no token (this tokenizer adds no "
                                             f"BOS): give some text, or leave negative_prompt=None for the default")
        if guidance_scale == 1:  # the short-circuit: no unconditional branch at all
            return None
        return cls(float(guidance_scale), float(guidance_rescale), negative, per_row, cfg_mode)

    def prefixes(self, batch: int, samples: int, last_tokens: Sequence[int], bos: int | None) -> list[list[int]]:
        """The unconditional prompt of every row (batch-major, ``samples`` rows per batch item).

        Raises :class:`BatchMismatch` when a list of negative prompts does not match ``batch``.
        """
        if self.negative is None:
            return [[bos] if bos is not None else [int(t)] for t in last_tokens]
        if self.per_row and len(self.negative) != batch:
            raise BatchMismatch(f"{len(self.negative)} negative prompts for {batch} prompts: give one per prompt, "
                                f"or a single string shared by all")
        return [list(self.negative[r // samples if self.per_row else 0]) for r in range(batch * samples)]


def _left_padded(rows: list[list[int]], width: int, pad: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.full((len(rows), width), pad, dtype=torch.long, device=device)
    mask = torch.zeros((len(rows), width), dtype=torch.long, device=device)
    for r, row in enumerate(rows):
        if row:
            ids[r, width - len(row):], mask[r, width - len(row):] = torch.tensor(row, device=device), 1
    return ids, mask


class UnconditionalBranch:
    """The unconditional branch of one decoding call, and a stand-in for the loop's forward request.

    The decoding loop runs :meth:`forward` (``yield from``) where it would yield its request: it asks the engine for
    the conditional columns it is given and the unconditional branch's matching column (the same generated token,
    the same keep flag), as the call's own requests (so the call is admitted, counted, parked like any), returns
    the conditional logits and KV, and keeps the unconditional logits for :meth:`guide`. :meth:`reorder` makes the
    branch follow the conditional rows (``Rows.reorder`` calls it; it returns the reordered conditional KV).

    * ``"sequential"``: the branch has its own KV cache and a second forward per step.
    * ``"batched"``: after the first step (the conditional suffix and the negative prompt are
      prefilled separately), both branches' caches are copied once into one cache of 2x rows,
      right-aligned to a common width (the shorter side gets masked leading columns), and every
      further step is ONE forward. The conditional KV handed back is a view of the first rows;
      :meth:`release` copies it out at the end so the result state does not hold the other half.
    """

    def __init__(self, guidance: Guidance, state, steps: int):
        """``steps``: the most tokens the call may generate; :attr:`steps` may be lower (context cap)."""
        model, tok = state._model, state._model.tokenizer
        self.guidance, self.steps = guidance, steps
        prefixes = guidance.prefixes(state.batch, state.samples, state._ids[:, -1].tolist(), tok.bos_token_id)
        longest = max(len(p) for p in prefixes)
        ctx = model.context_length
        if ctx is not None and longest >= ctx:
            raise ContextLengthError(f"the negative prompt has {longest} tokens but the model's context is {ctx}: "
                                     f"shorten the negative prompt")
        if ctx is not None:  # like the conditional rows: generation is capped where a row would leave the context
            self.steps = steps = min(steps, ctx - longest)
        self.prompt_ids, prompt_mask = _left_padded(prefixes, longest, tok.pad_token_id, state._ids.device)
        # (rows, longest + a bounded part of steps: with max_tokens=None steps is the rest of the context; _grow)
        self.mask = torch.cat([prompt_mask, prompt_mask.new_zeros((len(prefixes), min(steps, PREALLOCATED)))], 1)
        self.width = longest  # columns of self.mask in use
        self.kv: kvcache.KV | None = None  # sequential: this branch's cache; batched: both branches', 2x rows
        self.lead = 0  # batched: masked leading columns in front of the conditional rows
        self.uncond_logits: torch.Tensor | None = None

    def _grow(self) -> None:
        """Room for one more column in the mask, by half its width at a time (a long call copies it a few times)."""
        if self.width >= self.mask.shape[1]:
            self.mask = torch.cat([self.mask, self.mask.new_zeros((self.mask.shape[0], max(1, self.mask.shape[1] // 2)))], 1)

    @property
    def batched(self) -> bool:
        return self.guidance.mode == "batched"

    def _cond_view(self, rows: int) -> kvcache.KV:
        assert self.kv is not None  # batched: both branches' cache, set at the prefill
        return kvcache.narrow(self.kv, rows, self.lead)

    @staticmethod
    def _run(ids, mask, pos, kv, logits: str = "last", reserve: int = 0):
        """One forward as a request of the call's loop: the engine runs it in its next step, merged with the other
        calls' (the call is admitted like any, its rows counted twice: ``turns._per_prompt``)."""
        req = Request(ids, mask, pos, kv, logits, reserve)
        yield req
        result, req.result = req.result, None
        return result

    def forward(self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, kv, *, logits: str = "last", reserve: int = 0):
        """``model.forward`` for the conditional rows (the same arguments), as the loop's requests (a generator: its
        value is the conditional ``(logits, kv)``); the unconditional branch runs alongside."""
        R = ids.shape[0]
        first = self.uncond_logits is None  # the prefill: the conditional suffix and the whole negative prompt
        if not first:  # a generated column: the same token and keep flag in the unconditional branch
            self._grow()
            self.mask[:, self.width] = mask[:, -1]
            self.width += 1
        umask = self.mask[:, :self.width]
        if first or not self.batched:
            cond, kv = yield from self._run(ids, mask, pos, kv, logits, 0 if self.batched else reserve)
            uids = self.prompt_ids if first else ids
            upos = kvcache.positions(umask)[:, -uids.shape[1]:]
            self.uncond_logits, ukv = yield from self._run(uids, umask, upos, None if first else self.kv, "last",
                                                           0 if self.batched else reserve)
            if not self.batched:
                self.kv = ukv
                return cond, kv
            # batched: one cache of 2R rows from now on, right-aligned to a common width
            width = max(kvcache.length(kv), self.width)
            self.lead = width - kvcache.length(kv)
            self.kv = kvcache.stack_rows([kv, ukv], width, reserve)
            if width > self.width:
                self.mask = torch.cat([self.mask.new_zeros((R, width - self.width)), self.mask], 1)
            self.width = width
            return cond, self._cond_view(R)
        # one generated column for 2R rows: the conditional rows behind `lead` masked columns
        both_mask = torch.cat([torch.cat([umask.new_zeros((R, self.lead)), mask.to(umask.dtype)], 1), umask], 0)
        both_pos = both_mask[:, :-1].sum(1, keepdim=True)
        out, self.kv = yield from self._run(torch.cat([ids, ids], 0), both_mask, both_pos, self.kv, logits, reserve)
        self.uncond_logits = out[R:]
        return out[:R], self._cond_view(R)

    def guide(self, cond_logprobs: torch.Tensor) -> torch.Tensor:
        """The guided scores of this step, from the conditional log-probs and the stored unconditional logits."""
        assert self.uncond_logits is not None  # set by forward(), which runs before every guide()
        uncond = torch.log_softmax(self.uncond_logits.float(), -1)
        return guided_logprobs(cond_logprobs, uncond, self.guidance.scale, self.guidance.rescale)

    def reorder(self, ancestors: torch.Tensor, cond_kv: kvcache.KV | None) -> kvcache.KV | None:
        """Follow the conditional rows (forks, beams); returns the conditional KV reordered."""
        R = self.mask.shape[0]
        self.mask = self.mask.index_select(0, ancestors.to(self.mask.device))
        if not self.batched:
            self.kv = kvcache.select_rows(self.kv, ancestors)
            return kvcache.select_rows(cond_kv, ancestors)
        assert self.kv is not None  # batched: set at the prefill
        where = kvcache.devices(self.kv)
        a = ancestors.to(where[0]) if where else ancestors
        self.kv = kvcache.select_rows(self.kv, torch.cat([a, a + R]))
        return self._cond_view(a.numel())

    def release(self, cond_kv: kvcache.KV | None) -> kvcache.KV | None:
        """The conditional KV to keep in the result state: its own storage (batched), not a view of 2x rows."""
        if not self.batched or cond_kv is None:
            return cond_kv
        return kvcache.stack_rows([cond_kv], kvcache.length(cond_kv), 0)

