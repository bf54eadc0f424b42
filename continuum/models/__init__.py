"""Model and tokenizer adapters."""

from .hf import Transformers, transformers
from .identity import ModelFingerprint
from .tokenizer import Tokenizer

__all__ = ["Transformers", "transformers", "Tokenizer", "ModelFingerprint"]
