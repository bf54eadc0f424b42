"""Model and tokenizer adapters."""

from .tokenizer import Tokenizer
from .hf import Transformers, transformers
from .identity import ModelFingerprint

__all__ = ["Transformers", "transformers", "Tokenizer", "ModelFingerprint"]
