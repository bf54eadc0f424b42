"""Model and tokenizer adapters."""

from .tokenizer import Tokenizer
from .hf import Transformers, transformers

__all__ = ["Transformers", "transformers", "Tokenizer"]
