"""``SequenceState`` and the modules that implement its algebra.

* ``core``: the state itself (layout, per-row views, properties, value, repr); ``laststep``: the
  record of the last generation step (offsets, completion, finish reasons, resumable guide states);
* ``indexing``: ``state[batch, sample, chars]`` and cutting text;
* ``combine``: ``+`` and stacking;
* ``persistence``: save and load.
"""

from .core import LastStep, SequenceState

__all__ = ["SequenceState", "LastStep"]
