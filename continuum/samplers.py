"""Samplers: pick the next token of every row, and the row each new row descends from.

A sampler is called once per decoding step with

* ``logprobs``: ``(rows, vocab)`` log-softmax of the raw logits, ``-inf`` where a constraint
  forbids a token (masks remove tokens, they do not renormalise);
* ``scores``: ``(rows,)`` cumulative log-probs of each row so far (beam search ranks by them);
* ``group``: how many rows each batch item has *now* (1 on a fresh prompt, ``samples`` later);
* ``rng``: an optional ``torch.Generator``.

and returns ``(next_ids, ancestors, scores)``, each of length ``batch * samples``.
``ancestors[i]`` is the current row that new row ``i`` extends: the decoding loop reorders all
per-row state by it in one place. When ``group == 1`` and ``samples > 1`` the sampler forks:
several new rows share one ancestor, so a prompt is prefilled once whatever the sample count.
"""

from __future__ import annotations

import numpy as np
import torch

from .errors import GeneratorArgumentError

__all__ = [
    "Sampler",
    "GreedySampler",
    "MultinomialSampler",
    "BeamSearchSampler",
    "greedy",
    "multinomial",
    "beam_search",
    "exponential_race",
]


class Sampler:
    """Base class. ``samples`` is the number of rows per batch item the sampler produces."""

    samples: int = 1
    #: Beam search keeps rows sorted best first and ranks finished rows with live ones.
    is_beam_search: bool = False
    #: Draws random numbers (from ``rng``, or torch's global generator without one).
    is_random: bool = False

    def __call__(
        self, logprobs: torch.Tensor, scores: torch.Tensor, group: int, rng: torch.Generator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def reorders(self, group: int) -> bool:
        """Whether a step from ``group`` rows per batch item may return ancestors other than ``arange``."""
        return self.is_beam_search or group != self.samples


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x  # not NaN


def _check(name: str, value, ok: bool, expected: str) -> None:
    if not ok:
        raise GeneratorArgumentError(f"{name} must be {expected}; got {value!r}")


def _fork_ancestors(rows: int, group: int, samples: int, device) -> torch.Tensor:
    if group == samples:
        return torch.arange(rows, device=device)
    return torch.arange(rows, device=device).repeat_interleave(samples)


class GreedySampler(Sampler):
    """Always the most likely allowed token.

    Example:
        >>> GreedySampler()(torch.log_softmax(torch.tensor([[0.1, 2.0, 0.3]]), -1), torch.zeros(1), 1)[0]
        tensor([1])
    """

    samples = 1

    def __repr__(self) -> str:
        return "GreedySampler()"

    def __call__(self, logprobs, scores, group, rng=None):
        best, ids = row_max(logprobs)
        return ids, torch.arange(logprobs.shape[0], device=logprobs.device), scores + best


NUMPY_ARGMAX_FROM = 16384  # columns from which numpy's argmax pays for its conversions (a few microseconds a call)


def row_max(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's largest value and its first index, as ``x.max(dim=-1)`` (NaN counts as the largest, as there). On
    the CPU in float32 over a large vocabulary, numpy's vectorised argmax: 6x faster than torch's over Gemma's 262,144
    columns (0.18 against 1.1 ms for 16 rows, 2 cores), once per greedy step."""
    if (x.shape[-1] >= NUMPY_ARGMAX_FROM and x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2
            and not x.requires_grad):
        ids = torch.from_numpy(x.numpy().argmax(axis=-1))
        return x.gather(-1, ids[:, None])[:, 0], ids
    best, ids = x.max(dim=-1)
    return best, ids


class MultinomialSampler(Sampler):
    """Ancestral sampling, with optional temperature, top-k and top-p (nucleus) filtering.

    Args:
        samples: independent samples per batch item (the prompt is prefilled once, then forked).
        top_k: keep the ``top_k`` most likely tokens.
        top_p: keep the smallest set of tokens whose probability reaches ``top_p``.
        temperature: divide the log-probs by it (``0`` means greedy).

    Example:
        >>> sampler = MultinomialSampler(4, temperature=0.7, top_k=50, top_p=0.9)
        >>> sampler.samples
        4
    """

    is_random = True

    def __init__(self, samples: int = 1, *, top_k: int | None = None, top_p: float | None = None,
                 temperature: float | None = None):
        _check("samples", samples, _is_int(samples) and samples >= 1, "an int >= 1")
        _check("top_k", top_k, top_k is None or (_is_int(top_k) and top_k >= 1), "an int >= 1, or None (no top-k)")
        _check("top_p", top_p, top_p is None or (_is_real(top_p) and 0.0 < top_p <= 1.0), "a number in (0, 1], or None")
        _check("temperature", temperature, temperature is None or (_is_real(temperature) and temperature >= 0),
               "a number >= 0 (0 = greedy), or None")
        self.samples, self.top_k, self.top_p, self.temperature = samples, top_k, top_p, temperature

    def __repr__(self) -> str:
        named = (("top_k", self.top_k), ("top_p", self.top_p), ("temperature", self.temperature))
        args = [str(self.samples)] + [f"{k}={v}" for k, v in named if v is not None]
        return f"MultinomialSampler({', '.join(args)})"

    def _filter(self, logits: torch.Tensor) -> torch.Tensor:
        if self.temperature is not None and self.temperature > 0:
            logits = logits / self.temperature
        if self.top_k is not None and self.top_k < logits.shape[-1]:
            kth = logits.topk(self.top_k, dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if self.top_p is not None and self.top_p < 1.0:
            logits = _nucleus(logits, self.top_p)
        return logits

    def __call__(self, logprobs, scores, group, rng=None):
        rows = logprobs.shape[0]
        ancestors = _fork_ancestors(rows, group, self.samples, logprobs.device)
        if self.temperature == 0:
            ids = row_max(logprobs)[1].index_select(0, ancestors)  # (greedy's pick)
        else:
            probs = self._filter(logprobs).softmax(-1)
            if group != self.samples:  # a fork: each new row draws from its ancestor's distribution
                probs = probs.index_select(0, ancestors)
            ids = exponential_race(probs, rng)
        return ids, ancestors, scores.index_select(0, ancestors) + logprobs[ancestors, ids]


def exponential_race(probs: torch.Tensor, rng: torch.Generator | None = None) -> torch.Tensor:
    """One token per row drawn with probability ``probs`` (rows of non-negative weights), as the exponential race
    ``argmax(p / E)`` with ``E ~ Exp(1)`` per token: the rule ``torch.multinomial`` follows for one sample. Its
    winner survives small changes of ``probs`` (llama.cpp's batch-dependent rounding) because each token keeps its
    own ``E``, where inverting the cumulative distribution moves the draw with every token before it
    (tests/test_turns_fit.py). torch's ``exponential_`` took 61 ms for 16 x 262,144 tokens on 2 cores; 32 raw bits
    a token from numpy's PCG64 (seeded from ``rng``, one draw a call) and a float32 ``-log1p(-u)`` take ~8 ms.
    ``u = (bits + 0.5) / 2**32`` is exact near 0, where ``E`` is small and a token with little probability can win:
    ``E``'s resolution there is 2**-32. A row of zeros (every token forbidden) or NaN draws token 0."""
    rows, vocab = probs.shape
    seed = int(torch.randint(0, 2**62, (1,), generator=rng))
    bits = np.random.Generator(np.random.PCG64(seed)).bit_generator.random_raw((rows * vocab + 1) // 2)
    u = torch.from_numpy(bits.view(np.uint32)[:rows * vocab].reshape(rows, vocab))
    keys = torch.empty((rows, vocab), dtype=torch.float32).copy_(u).to(probs.device)
    keys.add_(0.5).mul_(-(2.0 ** -32)).log1p_()  # -E, in (-inf, 0)
    torch.div(probs.to(torch.float32), keys, out=keys)  # -p / E: the race's winner is the smallest
    if keys.device.type == "cpu":  # (numpy's argmin: several times torch's over a large vocabulary, as row_max)
        return torch.from_numpy(keys.numpy().argmin(axis=-1))
    return keys.argmin(dim=-1)


def _nucleus(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """``logits`` with every token outside the smallest most likely set reaching probability ``top_p`` at -inf (the
    token that crosses ``top_p`` is kept). Only the ``k`` most likely tokens are sorted, ``k`` grown until every row's
    set ends inside them: a full sort of Gemma's 262,144 tokens took 192 ms for 16 rows, the top 1,024 16 ms."""
    V = logits.shape[-1]
    norm = torch.logsumexp(logits, -1, keepdim=True)
    k = min(V, 1024)
    while True:
        top, order = logits.topk(k, dim=-1)  # (sorted, most likely first)
        p = (top - norm).to(torch.promote_types(top.dtype, torch.float32)).exp()  # (half precision cannot sum these)
        drop = p.cumsum(-1) - p >= top_p  # (the probability before each token already reaches top_p)
        if k == V or bool(drop[:, -1].all()):  # every row's set ends among these k: the rest is dropped too
            break
        k = min(V, 8 * k)
    return torch.full_like(logits, float("-inf")).scatter_(-1, order, top.masked_fill(drop, float("-inf")))


class BeamSearchSampler(Sampler):
    """Beam search: keep the ``beams`` best rows per batch item by cumulative log-prob.

    On a fresh prompt (one row per batch item) only that row is expanded, so the first step
    yields ``beams`` distinct beams, never duplicates. Rows come out best first.

    Example:
        >>> BeamSearchSampler(3).samples
        3
    """

    is_beam_search = True

    def __init__(self, beams: int = 1):
        _check("beams", beams, _is_int(beams) and beams >= 1, "an int >= 1")
        self.samples = beams

    def __repr__(self) -> str:
        return f"BeamSearchSampler({self.samples})"

    def __call__(self, logprobs, scores, group, rng=None):
        rows, vocab = logprobs.shape
        batch = rows // group
        candidates = (scores[:, None] + logprobs).reshape(batch, group * vocab)
        k = self.samples
        top, flat = candidates.topk(min(k, group * vocab), dim=-1)
        if top.shape[1] < k:  # fewer candidates than beams: pad with dead beams (score -inf)
            extra = k - top.shape[1]
            top = torch.cat([top, top.new_full((batch, extra), float("-inf"))], 1)
            flat = torch.cat([flat, flat[:, :1].expand(batch, extra)], 1)
        ancestors = (flat // vocab + torch.arange(batch, device=logprobs.device)[:, None] * group).reshape(-1)
        return (flat % vocab).reshape(-1), ancestors, top.reshape(-1)


def greedy() -> GreedySampler:
    """The greedy sampler: one sample, the argmax at every step."""
    return GreedySampler()


def multinomial(samples: int = 1, *, top_k: int | None = None, top_p: float | None = None,
                temperature: float | None = None) -> MultinomialSampler:
    """A multinomial sampler (see :class:`MultinomialSampler`)."""
    return MultinomialSampler(samples, top_k=top_k, top_p=top_p, temperature=temperature)


def beam_search(beams: int = 1) -> BeamSearchSampler:
    """A beam-search sampler with ``beams`` beams (see :class:`BeamSearchSampler`)."""
    return BeamSearchSampler(beams)
