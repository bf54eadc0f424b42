"""Model and tokenizer adapters."""

from .hf.model import Transformers, transformers
from .identity import ModelFingerprint
from .tokenizer import Tokenizer

__all__ = ["Transformers", "transformers", "Tokenizer", "ModelFingerprint"]
