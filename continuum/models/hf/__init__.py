"""The transformers backend: a Hugging Face causal LM and its KV cache as torch tensors.

* ``model``: :class:`Transformers` (``models.transformers(...)``), the forward over rows' uncached columns
  with explicit masks and positions;
* ``cache``: the KV cache as plain per-layer tensor tuples and its functional operations (select rows, crop,
  compact, stack), never writing where another state can look;
* ``prefix_cache``: the automatic prefix cache (KV blocks keyed by a chain of token ids, LRU under a byte budget);
* (token trees, choice scoring's one forward, are backend-neutral: ``continuum.models.token_tree``);
* ``recurrent``, ``hybrid``, ``hybrid_tree``: hybrid and recurrent models (LFM2, Mamba...): the KV with recurrent
  snapshots (:class:`~.recurrent.HybridKV`), their forwards (rows grouped by padding), their token trees (level by
  level); docs/hybrid.md.
"""

from .load import transformers
from .model import Transformers

__all__ = ["Transformers", "transformers"]
