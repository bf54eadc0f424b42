"""``SequenceState`` and the modules that implement its algebra.

How the package is arranged (imports point one way, except the documented binding in ``core``):

* ``laststep``: the record of the last generation step (offsets, completion, finish reasons,
  resumable guide states); imports nothing from the package.
* ``core``: the state itself (layout, per-row views, properties, value, repr). Its operators
  (``state[...]``, ``+``, ``stack``, ``to_model``, ``save``/``load``) are one-line methods that call
  the modules below; ``core`` binds those modules on its LAST line, after ``SequenceState`` exists.
* ``indexing`` (``state[batch, sample, chars]``, cutting text), ``combine`` (``+`` and stacking),
  ``convert`` (moving a state to another model, dropping its cache) and ``persistence`` (save and
  load): each imports ``core`` (and ``convert`` where a model must be checked); from outside the
  package, the state modules import only lower modules (``models``, ``errors``, ``display``). These
  imports of ``core`` are the only import circle the library allows (``tests/test_imports.py`` checks
  that there is no other anywhere).
* ``text`` (a row's token character spans, streaming detokenization) and ``completion`` (the ``str`` a text
  generator returns) import nothing from the package.
Everything outside the package imports ``SequenceState``/``LastStep`` from here.
"""

from .core import LastStep, SequenceState

__all__ = ["SequenceState", "LastStep"]
