"""Model and tokenizer adapters."""

from .hf.model import Transformers, transformers
from .identity import ModelFingerprint
from .llamacpp.backend import LlamaCpp, llamacpp
from .tokenizer import Tokenizer

__all__ = ["Transformers", "transformers", "LlamaCpp", "llamacpp", "Tokenizer", "ModelFingerprint"]
