"""continuum's constraints and classifier-free guidance as logits processors of other libraries' generation loops:
``transformers``' ``generate`` (:mod:`.hf`) and llama-cpp-python's ``Llama.generate``/``create_completion``
(:mod:`.llamacpp`, numpy).

Use them with ``model.generate(..., logits_processor=LogitsProcessorList([...]))``. They are built
on the same guides (:mod:`continuum.guides`) and the same guidance formula (:mod:`continuum.loop.cfg`) as the
generators: there is no second implementation.

Two things make a processor correct inside ``generate()``:

* **Rows are identified by the tokens they generated, not by their position.** Beam search
  reorders rows at every step and left-padded prompts all share one width, so each call looks a
  row's state up by its generated suffix (``input_ids[:, prompt_width:]``): its parent is the row
  of the previous call whose suffix is this one minus the last token.
* **Never raise mid-generation, never leave a row without a finite score.** Beam search keeps
  ``-inf`` candidates among its top 2k, so a running beam may hold a token the guide never
  allowed: that row is *dead* and only EOS stays finite (its beam score is already ``-inf``).

A processor holds the state of ONE ``generate()`` call: create one per call, or call
:meth:`reset` in between. Inputs may be torch tensors or any DLPack array with an array-API
namespace (NumPy): the result has the type of ``scores``, converted without copies.

Example:
    >>> from transformers import LogitsProcessorList
    >>> proc = RegexLogitsProcessor(r"[0-9]{3}", tokenizer)                     # doctest: +SKIP
    >>> out = hf_model.generate(**inputs, logits_processor=LogitsProcessorList([proc]),
    ...                         max_new_tokens=5, do_sample=False)             # doctest: +SKIP
"""

from .hf import (
    CFGLogitsProcessor,
    ChoiceLogitsProcessor,
    GrammarLogitsProcessor,
    GuidanceLogitsProcessor,
    GuideLogitsProcessor,
    JSONLogitsProcessor,
    RegexLogitsProcessor,
)
from .llamacpp import LlamaCppLogitsProcessor, llamacpp_choice, llamacpp_grammar, llamacpp_json, llamacpp_regex

__all__ = [
    "GuideLogitsProcessor",
    "RegexLogitsProcessor",
    "ChoiceLogitsProcessor",
    "JSONLogitsProcessor",
    "GrammarLogitsProcessor",
    "GuidanceLogitsProcessor",
    "CFGLogitsProcessor",
    "LlamaCppLogitsProcessor",
    "llamacpp_regex",
    "llamacpp_choice",
    "llamacpp_json",
    "llamacpp_grammar",
]
