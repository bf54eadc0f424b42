"""Model and tokenizer adapters."""

from .tokenizer import Tokenizer
from .transformers import Transformers, transformers

__all__ = ["Transformers", "transformers", "Tokenizer"]
