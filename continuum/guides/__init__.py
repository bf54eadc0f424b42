"""Constraints: the guides the decoding loop applies, one module per engine.

* ``outlines``: regex and choice compiled to outlines-core indexes;
* ``schema``: JSON Schema preparation in front of the engines.
"""

from .outlines import Guide, build_mask, choice_regex, escape, regex_guide
from .schema import SchemaCoverageWarning, schema_to_regex

__all__ = ["Guide", "build_mask", "choice_regex", "escape", "regex_guide", "schema_to_regex", "SchemaCoverageWarning"]
