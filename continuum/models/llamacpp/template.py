"""Chat templates of a GGUF model: rendered the way transformers renders them, tokenized by llama.cpp.

A GGUF carries its Jinja chat template in ``tokenizer.chat_template`` (Gemma 3's registry file has none: pass
``template=``). Rendering uses transformers' own Jinja environment (``render_jinja_template``: the same
``raise_exception``, ``strftime_now``, ``tojson`` and loop controls HF templates are written for), with the special
tokens' texts (``bos_token``, ``eos_token``...) read from the GGUF; the rendered text is tokenized by
``llama_tokenize`` with control tokens parsed (``<start_of_turn>`` is one token) and no BOS added (the template
writes it), as ``apply_chat_template`` does on a Hugging Face tokenizer. So a :class:`continuum.chat.Chat` renders
the same prompt on both backends and, where the vocabularies agree, the same ids.

Example:
    >>> tok = models.llamacpp("gemma-3-270m-q4_k_m.gguf").tokenizer                 # doctest: +SKIP
    >>> tok.apply_chat_template([{"role": "user", "content": "Hi"}], chat_template=gemma3,
    ...                         add_generation_prompt=True, tokenize=False)         # doctest: +SKIP
    '<bos><start_of_turn>user\\nHi<end_of_turn>\\n<start_of_turn>model\\n'
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ...errors import ChatTemplateError

__all__ = ["render_chat"]

# transformers' special-token names, and the llama.cpp vocabulary call that gives each one's id
_SPECIALS = {"bos_token": "llama_vocab_bos", "eos_token": "llama_vocab_eos", "pad_token": "llama_vocab_pad",
             "unk_token": None, "sep_token": "llama_vocab_sep"}


def special_texts(tok: Any) -> dict[str, str]:
    """``{"bos_token": "<bos>", ...}`` for the GGUF's special tokens that exist (the template variables
    transformers passes from ``special_tokens_map``)."""
    from ._lib import lib

    L, out = lib(), {}
    for name, call in _SPECIALS.items():
        if call is None or not hasattr(L, call):
            continue
        idx = int(getattr(L, call)(tok.model.vocab_ptr))
        if 0 <= idx < tok.n_vocab:
            out[name] = tok.piece(idx, True).decode("utf-8", errors="replace")
    return out


def render_chat(tok: Any, conversation: Sequence[dict], *, chat_template: str | None = None, tools: list | None = None,
                documents: list | None = None, add_generation_prompt: bool = False,
                continue_final_message: bool = False, tokenize: bool = False, **kwargs: Any) -> str | list[int]:
    """``apply_chat_template`` for a :class:`~.vocab.LlamaTokenizer`: the rendered text, or its ids (``tokenize``).

    Raises :class:`~continuum.errors.ChatTemplateError` when there is no template, and lets the template's own
    errors (``raise_exception``) through for the caller to word.
    """
    from transformers.utils.chat_template_utils import render_jinja_template

    template = chat_template if chat_template is not None else tok.chat_template
    if not template:
        raise ChatTemplateError(f"the GGUF {tok.name!r} has no chat template (tokenizer.chat_template): pass one, "
                                f"e.g. Chat(model, template=jinja_text)")
    if continue_final_message and add_generation_prompt:
        raise ChatTemplateError("continue_final_message and add_generation_prompt cannot both be set")
    if not conversation:
        raise ChatTemplateError("cannot render an empty conversation: add a message first")
    messages = [{k: v for k, v in dict(m).items() if v is not None} for m in conversation]  # (as transformers does)
    rendered = render_jinja_template(conversations=[messages], tools=tools, documents=documents,
                                        chat_template=template, continue_final_message=continue_final_message,
                                        add_generation_prompt=add_generation_prompt,
                                        **{**tok.special_texts, **kwargs})
    text = rendered[0][0]  # ([one text per conversation], assistant indices)
    return tok.tokenize(text, add_special=False, parse_special=True) if tokenize else text
