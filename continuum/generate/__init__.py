"""Generators (``text``, ``choice``, ``regex``, ``json``) and ``continuous``."""

from .api import cfg, choice, json, regex, text
from .continuous import ContinuousGenerator, continuous
from .generator import Generator, Stream

__all__ = ["text", "choice", "regex", "json", "cfg", "continuous", "ContinuousGenerator", "Generator", "Stream"]
