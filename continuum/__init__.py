"""continuum: continuous generation with language models.

Generate, slice, add, fork and resume token sequences without recomputing what the model has
already seen. See ``docs/`` for the state model and ``README.md`` for a quick start.
"""

from typing import TYPE_CHECKING

from .errors import (
    BatchMismatch,
    ChatTemplateError,
    ContinuumError,
    IncompleteGenerationError,
    ModelMismatch,
    ProgramError,
    SampleMismatch,
    SlicingError,
    TokenizerMismatch,
)

if TYPE_CHECKING:  # what the names below are, for type checkers; at run time they load on first use
    from . import chat, cluster, generate, models, samplers, speculate
    from .generate import continuous
    from .programs.batch import run_batch
    from .state import SequenceState
    from .state.completion import Completion

# Loaded on first use (PEP 562), so that importing one light module (``continuum.serve``'s command line, the
# llama.cpp model loader) does not import torch and transformers first: `continuum serve model.gguf` loads the
# GGUF while torch is still importing (docs/serve.md, "start-up"). `from continuum import x` works as before.
_LAZY = {"continuous": ("continuum.generate", "continuous"), "run_batch": ("continuum.programs.batch", "run_batch"),
         "SequenceState": ("continuum.state", "SequenceState"), "Completion": ("continuum.state.completion", "Completion")}


def __getattr__(name: str):
    from ._lazy import attribute

    return attribute(globals(), _LAZY, name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__version__ = "0.1.0"

__all__ = [
    "chat",
    "cluster",
    "models",
    "generate",
    "samplers",
    "speculate",
    "continuous",
    "run_batch",
    "SequenceState",
    "Completion",
    "ContinuumError",
    "SampleMismatch",
    "BatchMismatch",
    "SlicingError",
    "IncompleteGenerationError",
    "ModelMismatch",
    "TokenizerMismatch",
    "ChatTemplateError",
    "ProgramError",
]
