"""Generators (``text``, ``choice``, ``regex``, ``json``, ``cfg``) and ``continuous``.

* ``api``: the constructors (argument checks, compiling the constraint);
* ``generator``: :class:`Generator` (calling, streaming, asyncio) and ``continuous``: :class:`ContinuousGenerator`;
* ``reasoning``: reasoning models (markers, budgets, each row's phase, the thought and the answer).
"""

from .api import cfg, choice, json, regex, text
from .continuous import ContinuousGenerator, continuous
from .generator import Generator, Stream

__all__ = ["text", "choice", "regex", "json", "cfg", "continuous", "ContinuousGenerator", "Generator", "Stream"]
