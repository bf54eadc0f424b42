"""One entry for every engine: normalise a JSON schema and build the output check.

:func:`prepare_json_schema` is what ``generate.json`` (and any engine backend) calls: it runs the
normaliser (:mod:`continuum.guides.normalize`), warns with a :class:`SchemaCoverageWarning` where the
normalised schema is narrower than the original, and returns a ``parse`` that turns an output into
a Python value only after ``jsonschema`` validated it against the ORIGINAL schema (with its draft's
validator; ``format`` is not asserted), raising :class:`~continuum.errors.SchemaViolationError`
otherwise. Pydantic models are validated by pydantic instead.

Example:
    >>> prepared = prepare_json_schema({"type": "integer", "minimum": 3})
    >>> prepared.schema, prepared.parse("4")
    ({'type': 'integer', 'minimum': 3}, 4)
    >>> prepared.parse("2")  # doctest: +NORMALIZE_WHITESPACE
    Traceback (most recent call last):
    ...
    continuum.errors.SchemaViolationError: the JSON output fails its schema at / (rule minimum at /minimum):
    2 is less than the minimum of 3
"""

from __future__ import annotations

import json as _json
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import SchemaViolationError, UnsupportedSchemaError
from .bounds import resolve_bounds
from .limits import check_schema_bounds
from .normalize import NormalizedSchema, dialect_of, normalize_schema
from .schema import SchemaCoverageWarning, outlines_regex

__all__ = ["prepare_json_schema", "PreparedSchema", "original_validator", "normalized_validator", "coverage_message",
           "ON_UNSUPPORTED", "schema_to_regex"]


@dataclass(frozen=True)
class PreparedSchema:
    """The normalised schema for the engines, the check of outputs, and the parser that applies it."""

    schema: Any  # normalised JSON schema (draft 2020-12)
    validate: Callable[[Any], None]  # raises SchemaViolationError
    parse: Callable[[str], Any]  # text -> validated value
    name: str = "schema"
    normalized: NormalizedSchema | None = None
    #: what the engine does not enforce (outlines-core's ignored keywords, llguidance's lenient notes)
    engine_ignored: tuple = ()

    @property
    def exact(self) -> bool:
        """True when every keyword is enforced while generating (no output can fail validation)."""
        return not self.approximated and not self.engine_ignored

    @property
    def approximated(self) -> tuple:
        """The keywords (with their JSON paths) that are dropped or widened, so NOT enforced."""
        return self.normalized.approximated if self.normalized is not None else ()

    @property
    def narrowed(self) -> tuple:
        """Where the generated values are a sound subset of the valid ones."""
        return self.normalized.narrowed if self.normalized is not None else ()


def _validator_class(dialect: str):
    import jsonschema

    return {"draft4": jsonschema.Draft4Validator, "draft6": jsonschema.Draft6Validator,
            "draft7": jsonschema.Draft7Validator, "2019-09": jsonschema.Draft201909Validator}.get(
        dialect, jsonschema.Draft202012Validator)


def original_validator(schema: Any, dialect: str):
    """A ``jsonschema`` validator of ``schema`` under its draft (formats are not asserted)."""
    import jsonschema

    cls = _validator_class(dialect)
    try:
        cls.check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise UnsupportedSchemaError(f"the JSON schema is not a valid {dialect} schema, so its outputs cannot be "
                                     f"validated: {exc.message}") from exc
    return cls(schema)


def normalized_validator(normalized: NormalizedSchema):
    """A validator of the normalised schema with the original draft's types (draft 4 counts ``1.0``
    as a number, not an integer): for checking that the normaliser is sound."""
    import jsonschema

    base = jsonschema.Draft202012Validator
    cls = jsonschema.validators.extend(base, type_checker=_validator_class(normalized.dialect).TYPE_CHECKER)
    return cls(normalized.schema)


def _pointer(parts) -> str:
    return "/" + "/".join(str(p).replace("~", "~0").replace("/", "~1") for p in parts)


def _checker(validator) -> Callable[[Any], None]:
    def validate(value: Any) -> None:
        error = next(iter(sorted(validator.iter_errors(value), key=lambda e: e.path)), None)
        if error is None:
            return
        path, rule = _pointer(error.absolute_path), f"{error.validator} at {_pointer(error.absolute_schema_path)}"
        raise SchemaViolationError(f"the JSON output fails its schema at {path} (rule {rule}): {error.message[:300]}",
                                   path=path, rule=rule, value=value)

    return validate


ON_UNSUPPORTED = ("approximate", "raise")


def coverage_message(narrowed=(), approximated=(), ignored=()) -> str | None:
    """The text of the one :class:`SchemaCoverageWarning` of a schema, or None when everything is enforced exactly."""
    parts = []
    if approximated:
        parts.append("NOT enforced (the engine generates under a wider schema; every output is validated against "
                     "the original schema and one that fails raises SchemaViolationError): "
                     + "; ".join(map(str, approximated)))
    if ignored:
        parts.append("NOT enforced by the engine (outputs that violate them raise "
                     "SchemaViolationError): " + ", ".join(sorted(map(str, ignored))))
    if narrowed:
        parts.append("narrowed (every output is valid, but some valid values cannot be generated): "
                     + "; ".join(map(str, narrowed)))
    return "the JSON schema is not enforced exactly as written. " + " | ".join(parts) if parts else None


def check_options(additional_properties: Any, on_unsupported: Any) -> None:
    """The argument checks of ``additional_properties`` and ``on_unsupported`` (``GeneratorArgumentError``)."""
    from ..errors import GeneratorArgumentError

    if not isinstance(additional_properties, bool):
        raise GeneratorArgumentError(f"additional_properties must be True or False, got {additional_properties!r}")
    if on_unsupported not in ON_UNSUPPORTED:
        raise GeneratorArgumentError(f"on_unsupported must be 'approximate' or 'raise', got {on_unsupported!r}")


def prepare_json_schema(schema: Any, *, max_string_length: int | None = None, additional_properties: bool = False,
                        on_unsupported: str = "approximate", warn: bool = True,
                        max_items: int | None = None, relax: bool = False, inline: bool = True,
                        bounds: Any = None) -> PreparedSchema:
    """Normalise ``schema`` (a pydantic model class, a JSON schema dict or string) and build its output check.

    Args:
        bounds: how long the values the schema leaves unbounded may be (a
            :class:`~continuum.guides.bounds.JsonBounds`, a preset name ``"default"``/``"small"``/``"none"``,
            or None: nothing bounded; see :mod:`continuum.guides.bounds`).
        max_string_length: bounds every string value and every generated property name that has no
            bound of its own.
        max_items: bounds every array that has no ``maxItems`` (never tightens an explicit bound;
            a ``minItems`` above it raises ``UnsupportedSchemaError``).
        additional_properties: False (default): objects that say nothing about extra keys are
            generated closed (only their declared properties); True: the JSON Schema default.
        on_unsupported: ``"approximate"`` (default): a keyword no engine enforces is dropped or
            widened (listed in :attr:`PreparedSchema.approximated`; outputs are validated);
            ``"raise"``: :class:`~continuum.errors.UnsupportedSchemaError` instead.
        relax, inline: see :func:`~continuum.guides.normalize.normalize_schema` (the compile step's
            fallbacks: no narrowing, references kept).
        warn: emit the :class:`SchemaCoverageWarning` here (the compile step emits one for the
            schema and the engine together instead).

    Raises :class:`~continuum.errors.UnsupportedSchemaError` for schemas ``jsonschema`` rejects (and,
    with ``on_unsupported="raise"``, for what no engine can enforce).
    """
    from pydantic import BaseModel

    from .closing import close_objects

    check_options(additional_properties, on_unsupported)
    approximate = on_unsupported == "approximate"
    limits = resolve_bounds(bounds, max_string_length, max_items)
    max_string_length = limits.max_string_length

    def engine_schema(normalized: NormalizedSchema) -> Any:
        return close_objects(normalized.schema, additional_properties=additional_properties,
                             max_key_length=max_string_length)

    if isinstance(schema, type) and issubclass(schema, BaseModel):  # pydantic validates its own outputs
        prepared = _from_model(schema, approximate, relax, inline, limits, engine_schema)
    else:
        prepared = _from_json(schema, approximate, relax, inline, limits, engine_schema)
    normalized = prepared.normalized
    assert normalized is not None
    message = coverage_message(normalized.narrowed, normalized.approximated)
    if warn and message:
        warnings.warn(message, SchemaCoverageWarning, stacklevel=3)
    return prepared


def _from_model(model: Any, approximate: bool, relax: bool, inline: bool, limits: Any,
                engine_schema: Callable[[NormalizedSchema], Any]) -> PreparedSchema:
    """A pydantic model class prepared: its JSON schema normalised; pydantic validates and parses the outputs."""
    try:
        model_schema = model.model_json_schema()
    except Exception as exc:  # BaseModel itself, a field type pydantic cannot express in JSON Schema...
        raise UnsupportedSchemaError(f"pydantic cannot give the JSON schema of {model.__name__}: {exc}") from exc
    normalized = normalize_schema(model_schema, approximate=approximate, relax=relax, inline=inline, bounds=limits)

    def validate_model(value: Any) -> None:
        model.model_validate(value)

    return PreparedSchema(engine_schema(normalized), validate_model, model.model_validate_json, model.__name__,
                          normalized)


def _from_json(schema: Any, approximate: bool, relax: bool, inline: bool, limits: Any,
               engine_schema: Callable[[NormalizedSchema], Any]) -> PreparedSchema:
    """A JSON schema (a dict, a boolean or its JSON text) prepared: checked against its metaschema, normalised, and
    every output parsed and validated with ``jsonschema`` against the original."""
    if isinstance(schema, str):
        try:
            schema = _json.loads(schema)
        except ValueError as exc:
            raise UnsupportedSchemaError(f"the JSON schema string is not valid JSON: {exc}") from exc
        except RecursionError:
            raise UnsupportedSchemaError("the JSON schema string is nested too deeply to parse: flatten it") from None
    if not isinstance(schema, (dict, bool)):
        raise UnsupportedSchemaError(f"generate.json takes a pydantic model class, a JSON schema dict or a JSON "
                                     f"string, not {type(schema).__name__}")
    check_schema_bounds(schema)  # before anything walks it recursively
    validator = original_validator(schema, dialect_of(schema))  # the metaschema refuses malformed keywords first
    normalized = normalize_schema(schema, approximate=approximate, relax=relax, inline=inline, bounds=limits)
    validate = _checker(validator)

    def parse(text: str) -> Any:
        try:
            value = _json.loads(text)
        except ValueError as exc:
            raise SchemaViolationError(f"the output is not valid JSON ({exc}): {text[:200]!r}",
                                       rule="JSON syntax") from exc
        validate(value)
        return value

    name = schema.get("title", "schema") if isinstance(schema, dict) else "schema"
    return PreparedSchema(engine_schema(normalized), validate, parse, str(name), normalized)


def schema_to_regex(schema: Any, whitespace_pattern: str | None = r"[ ]?", *,
                    max_string_length: int | None = None) -> tuple[str, Any]:
    """(regex, parser) for a pydantic model class, a JSON schema dict or a JSON schema string.

    The schema goes through :func:`prepare_json_schema` (normalised; the
    parser validates every output against the original schema) and then to outlines-core.
    """
    prepared = prepare_json_schema(schema, max_string_length=max_string_length)
    return outlines_regex(prepared.schema, whitespace_pattern), prepared.parse
