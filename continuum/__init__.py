"""continuum: continuous generation with language models.

Generate, slice, add, fork and resume token sequences without recomputing what the model has
already seen. See ``docs/`` for the state model and ``README.md`` for a quick start.
"""

from . import chat, cluster, generate, models, samplers, speculate
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
from .generate import continuous
from .programs.batch import run_batch
from .state import SequenceState
from .state.completion import Completion

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
