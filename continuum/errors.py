"""Exceptions raised by continuum.

Every error derives from :class:`ContinuumError`. Errors about bad arguments also derive
from ``ValueError`` (or ``IndexError`` for indexing), so ``except ValueError`` keeps working
for callers that do not know this library.
"""

from __future__ import annotations

__all__ = [
    "ContinuumError",
    "RecurrentStateError",
    "SampleMismatch",
    "BatchMismatch",
    "SlicingError",
    "GeneratorArgumentError",
    "InvalidRegexError",
    "InvalidChoicesError",
    "InvalidGrammarError",
    "EmptyChoicesError",
    "UnsupportedSchemaError",
    "SchemaViolationError",
    "IncompleteGenerationError",
    "ContextLengthError",
    "TokenizerError",
    "StateFileError",
    "ModelMismatch",
    "TokenizerMismatch",
    "ContinuumTypeError",
    "PrefixCacheArgumentError",
    "ModelLoadError",
    "ChatTemplateError",
    "GuideLimitError",
    "UnencodableTextError",
    "ProgramError",
    "ReasoningError",
    "BackendError",
    "KVCacheFullError",
    "SequencesExhaustedError",
    "StaleWindowError",
    "ForeignStateError",
    "RemoteError",
    "RemoteStateError",
]


class ContinuumError(Exception):
    """Base class of every error raised by continuum."""


class SampleMismatch(ContinuumError, ValueError):
    """Two things disagree on the number of samples (or beams) per batch row."""


class BatchMismatch(ContinuumError, ValueError):
    """Two things disagree on the number of batch rows."""


class SlicingError(ContinuumError, IndexError):
    """A ``SequenceState`` index that cannot be honoured (step != 1, empty selection...)."""


class GeneratorArgumentError(ContinuumError, ValueError):
    """A generator (or :func:`continuum.run_batch`) was created or called with an invalid argument."""


class InvalidRegexError(GeneratorArgumentError):
    """The regular expression cannot be compiled into a token-level index."""


class InvalidChoicesError(GeneratorArgumentError):
    """``generate.choice`` options that cannot be chosen from (empty, duplicated, not strings)."""


class EmptyChoicesError(InvalidChoicesError):
    """``generate.choice`` was given no options (or an empty option)."""


class InvalidGrammarError(GeneratorArgumentError):
    """The context-free grammar (Lark or GBNF) cannot be compiled; the message is the engine's."""


class UnsupportedSchemaError(GeneratorArgumentError):
    """The JSON schema is invalid or uses features no engine can enforce.

    Attributes:
        keyword: the JSON Schema keyword refused (e.g. ``"uniqueItems"``), when known.
        path: its JSON path in the schema (e.g. ``"/properties/tags/uniqueItems"``), when known.
    """

    def __init__(self, message: str, keyword: str | None = None, path: str | None = None):
        super().__init__(message)
        self.keyword, self.path = keyword, path


class SchemaViolationError(ContinuumError, ValueError):
    """A generated JSON value fails its schema (checked with ``jsonschema`` before it is returned).

    Attributes:
        row: the flat row index (batch-major), or None before the row is known.
        batch, sample: the row's batch and sample indices, or None.
        path: the JSON path of the failing value in the output (e.g. ``"/age"``).
        rule: the failing schema rule, as ``keyword`` at its schema path (e.g. ``"minimum at /properties/age/minimum"``).
        value: the parsed output.
    """

    def __init__(self, message: str, *, path: str = "", rule: str = "", value=None, row: int | None = None,
                 batch: int | None = None, sample: int | None = None):
        super().__init__(message)
        self.path, self.rule, self.value = path, rule, value
        self.row, self.batch, self.sample = row, batch, sample


class ContextLengthError(ContinuumError, ValueError):
    """The input is longer than the model's context window."""


class TokenizerError(ContinuumError, ValueError):
    """The tokenizer cannot be used as given (no pad/eos token, another tokenizer's state...)."""


class TokenizerMismatch(TokenizerError, GeneratorArgumentError):
    """States, or a state and a generator, belong to models with different tokenizers.

    Token ids mean nothing under another vocabulary; rebuild the state from its text instead,
    e.g. ``SequenceState.from_prompts(model, list(state))`` (weights and log-probs are not carried).
    """


class ModelMismatch(ContinuumError, ValueError):
    """States of different models (same tokenizer) were combined.

    Convert one first: ``other.to_model(state.model)`` keeps tokens, weights, log-probs and the
    last step, and drops the other model's KV cache (the next generator recomputes it in one pass).
    """


class StateFileError(ContinuumError, ValueError):
    """A saved ``SequenceState`` file is missing, corrupt, or was saved with another tokenizer."""


class ContinuumTypeError(ContinuumError, TypeError):
    """A value of the wrong type (a prompt that is not text, ``state + 1``...); the message names what is accepted."""


class IncompleteGenerationError(ContinuumError, RuntimeError):
    """A constrained generation stopped (``max_tokens`` or context limit) before its pattern matched.

    Attributes:
        rows: the flat row indices (batch-major) whose output is incomplete.
        max_tokens: the ``max_tokens`` value of the call, if any.
    """

    def __init__(self, message: str, rows: list[int] | None = None, max_tokens: int | None = None):
        super().__init__(message)
        self.rows = rows or []
        self.max_tokens = max_tokens


class PrefixCacheArgumentError(ContinuumError, ValueError):
    """A ``prefix_cache=`` budget that is not a size (negative, or a string without a known unit)."""


class ModelLoadError(ContinuumError, ValueError):
    """``models.transformers`` cannot load the model as asked: the checkpoint is missing, or the parallel
    layout cannot work (``tp_plan`` outside ``torchrun``, heads not divisible by the number of processes,
    ``tp_plan`` with ``device_map``). For a GGUF (llama.cpp): the path is missing, is not a GGUF file, or
    llama.cpp refused it. The message says how to launch or what to change."""


class ChatTemplateError(ContinuumError, ValueError):
    """A chat template refused the messages (Gemma's system turn, Mistral's non-alternating roles...),
    or there is no template to render them with; the message carries the template's own words."""


class GuideLimitError(GeneratorArgumentError):
    """A constraint made the engine hit one of its resource limits while decoding (llguidance's lexer
    fuel, Earley items...); the message names the limit (``continuum.guides.limits``) and how to raise it."""


class UnencodableTextError(ContinuumError, ValueError):
    """Text that cannot be encoded as UTF-8 (a lone surrogate such as ``"\\ud800"``, what a careless
    decode produces). The message names the argument and the position of the first bad character.

    Attributes:
        argument: the argument holding the text (``"prompt"``, ``"stop_at"``, ...).
        position: the index of the first character that cannot be encoded.
    """

    def __init__(self, message: str, argument: str = "", position: int = -1):
        super().__init__(message)
        self.argument, self.position = argument, position


class ProgramError(ContinuumError, RuntimeError):
    """Some instances of a :func:`continuum.run_batch` program raised; the others ran to completion.

    Raised after every instance finished, chained to the first failure (``raise ... from``).

    Attributes:
        results: one entry per input, in input order: the program's result, ``None`` where it failed.
        errors: ``{input index: the exception it raised}``, in input order.
    """

    def __init__(self, message: str, results: list | None = None, errors: dict | None = None):
        super().__init__(message)
        self.results = results if results is not None else []
        self.errors = errors if errors is not None else {}


class ReasoningError(GeneratorArgumentError):
    """A reasoning option that cannot work: markers the tokenizer cannot find, a ``thinking_budget``
    that leaves the answer no room in ``max_tokens``, an option combined with one it excludes. The
    message says what to pass instead (see docs/reasoning.md)."""


class BackendError(ContinuumError, RuntimeError):
    """The inference library failed a call it should not fail (llama.cpp's ``llama_decode`` aborted or returned
    an error). The message carries its code; the states involved are unchanged (rows decoded before the failure
    are rolled back)."""


class KVCacheFullError(BackendError):
    """llama.cpp found no room in its KV cache for a decode (``llama_decode`` returned 1), even after idle
    sequences were spilled to host memory. Pass a larger ``n_ctx`` (the pool of KV cells that every live
    state shares), or keep fewer long states alive."""


class SequencesExhaustedError(BackendError):
    """Every llama.cpp sequence id (at most 256 per context) is held by a state that is in use in the same
    step; none can be spilled to host memory. Run fewer rows in one step (``max_rows``)."""


class StaleWindowError(ContinuumError, RuntimeError):
    """A sliding-window model's state cannot be extended in place: the KV cells of the window behind its end
    were evicted (a fork, slice or rewind behind the window, or a spilled state restored from a window-only
    blob). llama.cpp would accept the decode and return wrong logits, so the state's tokens must be recomputed
    (drop its KV and prefill them again).

    Attributes:
        rows: the indices (in the decode's input order) of the rows to recompute.
    """

    def __init__(self, message: str, rows: list[int] | None = None):
        super().__init__(message)
        self.rows = rows or []


class ForeignStateError(StateFileError):
    """A saved llama.cpp KV blob was made by another GGUF, KV type, flash-attention setting or llama.cpp
    version: its bytes would load and give wrong logits. Recompute the state from its tokens instead."""


class RecurrentStateError(ContinuumError, ValueError):
    """An operation a recurrent layer (a convolution or SSM state: LFM2, Mamba) cannot do exactly: masking out
    cached tokens without slicing the state, a hybrid family continuum does not support yet, a prefix cache on
    such a model. The message says what to do instead (see docs/hybrid.md)."""


class RemoteError(ContinuumError, ConnectionError):
    """A remote model's server could not be reached, timed out or answered something that is not continuum's
    (``continuum.models.remote``). The state passed in is untouched: retry the call once the server answers."""


class RemoteStateError(ContinuumError, LookupError):
    """A remote state's handle names a stored state the server does not have for this key (unknown, deleted,
    expired, another key's, or from another model): ``model.detach(state)`` keeps its tokens, weights and log-probs
    without the handle, and the next call recomputes them on the server."""
