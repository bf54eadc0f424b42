"""Constraints: the guides the decoding loop applies, one module per engine.

* ``outlines``: regex and choice compiled to outlines-core indexes;
* ``normalize`` (with ``logic`` and ``rewrites``): the engine-agnostic JSON Schema normaliser;
* ``prepare``: ``prepare_json_schema``, the one entry every engine calls (normalise + output check);
* ``schema``: the outlines-core spelling of a normalised schema (regex).
"""

from .outlines import Guide, build_mask, choice_regex, escape, regex_guide
from .normalize import ENFORCED_FORMATS, NormalizedSchema, normalize_schema
from .prepare import PreparedSchema, prepare_json_schema
from .schema import SchemaCoverageWarning, outlines_regex, schema_to_regex

__all__ = ["Guide", "build_mask", "choice_regex", "escape", "regex_guide", "schema_to_regex", "SchemaCoverageWarning",
           "outlines_regex", "prepare_json_schema", "PreparedSchema", "normalize_schema", "NormalizedSchema",
           "ENFORCED_FORMATS"]
