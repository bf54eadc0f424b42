"""The decoding loop's home: where a call enters, where concurrent calls are merged, where a forward runs.

- :mod:`~continuum.loop.decoding`: the one decoding loop (``decode``, ``prefill``), every generator's.
- :mod:`~continuum.loop.rows`: its per-row state; ``Rows.reorder`` is the one place rows follow ancestors.
- :mod:`~continuum.loop.fastforward`: tokens a constraint forces, computed in the next forward.
- :mod:`~continuum.loop.scheduler`: concurrent loops on one model share every forward (``model.scheduler``).
- :mod:`~continuum.loop.merge`: how their requests are laid out in one batch (shared KV slabs).
- :mod:`~continuum.loop.ranks`: the same merged batches on every rank under torchrun.
"""
