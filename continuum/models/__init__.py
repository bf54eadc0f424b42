"""Model and tokenizer adapters."""

from .hf.load import transformers
from .hf.model import Transformers
from .identity import ModelFingerprint
from .llamacpp.backend import LlamaCpp, llamacpp
from .tokenizer import Tokenizer

__all__ = ["Transformers", "transformers", "LlamaCpp", "llamacpp", "Tokenizer", "ModelFingerprint"]
