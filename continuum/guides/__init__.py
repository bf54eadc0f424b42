"""Constraints: the guides the decoding loop applies, one module per engine.

* ``base``: the guide protocol the decoding loop sees (:class:`Guide`);
* ``outlines``: regex and choice compiled to outlines-core indexes (:class:`OutlinesGuide`);
* ``schema``: JSON Schema preparation in front of the engines.
"""

from .base import DEAD, ENGINES, Guide, check_backend
from .outlines import OutlinesGuide, build_mask, choice_regex, escape, regex_guide
from .schema import SchemaCoverageWarning, schema_to_regex

__all__ = ["Guide", "DEAD", "ENGINES", "check_backend", "OutlinesGuide", "build_mask", "choice_regex", "escape",
           "regex_guide", "schema_to_regex", "SchemaCoverageWarning"]
