"""Constraints: the guides the decoding loop applies, one module per engine.

* ``base``: the guide protocol the decoding loop sees (:class:`Guide`);
* ``outlines``: regex and choice compiled to outlines-core indexes (:class:`OutlinesGuide`);
* ``llguidance``: JSON Schema, grammars (and regex on request) with llguidance;
* ``normalize`` (with ``logic`` and ``rewrites``): the engine-agnostic JSON Schema normaliser;
* ``bounds``: :class:`JsonBounds`, how long values the schema leaves unbounded may be (``bounds=``);
* ``prepare``: ``prepare_json_schema``, the one entry every engine calls (normalise + output check),
  and ``schema_to_regex`` (prepare, then the outlines-core regex);
* ``schema``: the outlines-core spelling of a normalised schema (regex); imports nothing from ``prepare``.
"""

from .base import DEAD, ENGINES, Guide, check_backend
from .bounds import JsonBounds
from .normalize import ENFORCED_FORMATS, NormalizedSchema, normalize_schema
from .outlines import OutlinesGuide, build_mask, choice_regex, escape, regex_guide
from .prepare import PreparedSchema, prepare_json_schema, schema_to_regex
from .schema import SchemaCoverageWarning, outlines_regex

__all__ = ["Guide", "DEAD", "ENGINES", "check_backend", "OutlinesGuide", "build_mask", "choice_regex", "escape",
           "regex_guide", "schema_to_regex", "SchemaCoverageWarning", "outlines_regex", "prepare_json_schema",
           "PreparedSchema", "normalize_schema", "NormalizedSchema", "ENFORCED_FORMATS", "JsonBounds"]
