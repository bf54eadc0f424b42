"""The decoding loop's home: where a call enters, where concurrent calls are merged, where a forward runs.

- :mod:`~continuum.loop.decoding`: the one decoding loop (``decode``, ``prefill``), every generator's: set up in
  the caller's thread, then a coroutine the engine resumes at every step.
- :mod:`~continuum.loop.checks`: a call's arguments and input, checked before anything runs.
- :mod:`~continuum.loop.rows`: its per-row state; ``Rows.reorder`` is the one place rows follow ancestors.
- :mod:`~continuum.loop.fastforward`: tokens a constraint forces, computed in the next forward.
- A step's other parts: :mod:`~continuum.loop.healing` (token healing), :mod:`~continuum.loop.cfg` (classifier-free
  guidance and its unconditional branch), :mod:`~continuum.loop.scoring` (choice by scoring every option in one
  forward), :mod:`~continuum.loop.cancel` (the token a loop checks once per step), :mod:`~continuum.loop.parallel`
  (the guards of a program run on every rank).
- :mod:`~continuum.loop.engine`: one engine per model runs every running call's loop in one step (``model.engine``);
  :mod:`~continuum.loop.arrivals`: calls being set up, which the next step waits for; :mod:`~continuum.loop.call`:
  a call's handle (what its caller waits on).
- :mod:`~continuum.loop.forwards`: how a step's requests run (merged groups, the rest alone, the counters).
- :mod:`~continuum.models.hf.merge`: how a step's requests are laid out in one batch (the group's log-softmax);
  :mod:`~continuum.models.hf.slab`: the shared KV storage they are laid out in.
- :mod:`~continuum.loop.ranks`: the same steps on every rank under torchrun.
"""
