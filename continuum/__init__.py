"""continuum: continuous generation with language models.

Generate, slice, add, fork and resume token sequences without recomputing what the model has
already seen. See ``docs/`` for the state model and ``README.md`` for a quick start.
"""

from . import chat, generate, models, samplers
from .completion import Completion
from .errors import (
    BatchMismatch,
    ContinuumError,
    IncompleteGenerationError,
    ModelMismatch,
    SampleMismatch,
    SlicingError,
    TokenizerMismatch,
    ChatTemplateError,
)
from .generate import continuous
from .state import SequenceState

__version__ = "0.1.0"

__all__ = [
    "chat",
    "models",
    "generate",
    "samplers",
    "continuous",
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
]
