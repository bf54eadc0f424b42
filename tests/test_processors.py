"""continuum's processors inside transformers' ``generate()``: constraints hold under greedy, sampling and
beam search, on left-padded batches of tiny GPT-2 and Llama models; NumPy in gives NumPy out."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from transformers import LogitsProcessorList

from continuum.processors import (
    CFGLogitsProcessor,
    ChoiceLogitsProcessor,
    GuidanceLogitsProcessor,
    JSONLogitsProcessor,
    RegexLogitsProcessor,
)

PROMPTS = ["Once upon a time", "The dog"]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 4}, "ok": {"type": "boolean"}},
          "required": ["name", "ok"], "additionalProperties": False}
MODES = {
    "greedy": dict(do_sample=False),
    "sample": dict(do_sample=True, top_k=0),
    "beam": dict(do_sample=False, num_beams=3, num_return_sequences=3),
}


@pytest.fixture(params=["gpt2", "llama"])
def hf(request, gpt2_model, llama_model):
    """(HF model, HF tokenizer set up for left padding)."""
    model = gpt2_model if request.param == "gpt2" else llama_model
    tok = model.tokenizer.hf
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return model.model, tok


def _generate(model, tok, prompts, processors, mode, max_new_tokens=24, seed=0):
    inputs = tok(prompts, return_tensors="pt", padding=True)
    torch.manual_seed(seed)
    out = model.generate(**inputs, logits_processor=LogitsProcessorList(processors), max_new_tokens=max_new_tokens,
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, **MODES[mode])
    # decode whole rows, then drop the prompt: SentencePiece drops the leading space of a first token
    full = tok.batch_decode(out, skip_special_tokens=True)
    heads = tok.batch_decode(inputs["input_ids"], skip_special_tokens=True)
    per = len(full) // len(prompts)
    assert all(f.startswith(heads[i // per]) for i, f in enumerate(full))
    return [f[len(heads[i // per]):] for i, f in enumerate(full)]


@pytest.mark.parametrize("mode", list(MODES))
def test_regex_processor_outputs_match(hf, mode):
    model, tok = hf
    pattern = r"[0-9]{2,4}(-[a-z]{1,3})?"
    texts = _generate(model, tok, PROMPTS, [RegexLogitsProcessor(pattern, tok)], mode)
    assert len(texts) == len(PROMPTS) * (3 if mode == "beam" else 1)
    for text in texts:
        assert re.fullmatch(pattern, text), text


@pytest.mark.parametrize("mode", list(MODES))
def test_choice_processor_outputs_an_option(hf, mode):
    model, tok = hf
    options = [" happy", " sad", " very happy indeed"]
    for text in _generate(model, tok, PROMPTS, [ChoiceLogitsProcessor(options, tok)], mode):
        assert text in options


@pytest.mark.parametrize("mode", list(MODES))
def test_json_processor_outputs_validate(hf, mode):
    jsonschema = pytest.importorskip("jsonschema")
    model, tok = hf
    for text in _generate(model, tok, PROMPTS, [JSONLogitsProcessor(SCHEMA, tok)], mode, max_new_tokens=40):
        jsonschema.validate(json.loads(text), SCHEMA)


def test_batched_equals_one_at_a_time(hf):
    model, tok = hf
    pattern = r"[a-z ]{3,12}\."
    batched = _generate(model, tok, PROMPTS, [RegexLogitsProcessor(pattern, tok)], "greedy")
    alone = [_generate(model, tok, [p], [RegexLogitsProcessor(pattern, tok)], "greedy")[0] for p in PROMPTS]
    assert batched == alone


def test_reset_serves_a_second_call(hf):
    model, tok = hf
    proc = RegexLogitsProcessor(r"[0-9]{3}", tok)
    first = _generate(model, tok, PROMPTS, [proc], "greedy")
    proc.reset()
    assert _generate(model, tok, PROMPTS[::-1], [proc], "greedy") == first[::-1]


def test_numpy_in_numpy_out_same_mask(gpt2_model):
    tok = gpt2_model.tokenizer.hf
    ids = torch.tensor(tok(["Numbers: 1"])["input_ids"])
    scores = torch.randn(1, gpt2_model.vocab_size)
    torch_out = RegexLogitsProcessor(r"[0-9]+", tok)(ids, scores.clone())
    np_out = RegexLogitsProcessor(r"[0-9]+", tok)(ids.numpy(), scores.numpy().copy())
    assert isinstance(np_out, np.ndarray) and np_out.dtype == np.float32
    np.testing.assert_array_equal(np_out, torch_out.numpy())
    allowed = torch.isfinite(torch_out[0]).nonzero().flatten().tolist()
    assert allowed and all(re.fullmatch(r"[0-9]+", tok.decode([i])) for i in allowed)


def test_disallowed_token_kills_the_row_without_raising(gpt2_model):
    """Beam search may carry a token the guide never allowed: the row keeps only EOS finite."""
    tok = gpt2_model.tokenizer.hf
    proc = RegexLogitsProcessor(r"[0-9]{3}", tok)
    prompt = torch.tensor([tok("Code:")["input_ids"]] * 2)
    vocab = gpt2_model.vocab_size
    proc(prompt, torch.zeros(2, vocab))
    digit, letter = tok.convert_tokens_to_ids("1"), tok.convert_tokens_to_ids("a")
    step = torch.cat([prompt, torch.tensor([[digit], [letter]])], 1)
    out = proc(step, torch.zeros(2, vocab))
    assert torch.isfinite(out[0]).sum() > 1
    assert torch.isfinite(out[1]).nonzero().flatten().tolist() == [tok.eos_token_id]


class _FromScratchGuidance(GuidanceLogitsProcessor):
    """Reference: the unconditional branch recomputed from scratch (negative prompt + suffix) at every call."""

    def _unconditional(self, ids):
        keys, _ = self._rows.step(ids)
        neg, mask = self._start(ids)
        gen = ids[:, self._rows.width:]
        with torch.no_grad():
            full_mask = torch.cat([mask, torch.ones_like(gen)], 1)
            out = self.model(input_ids=torch.cat([neg, gen], 1), attention_mask=full_mask,
                             position_ids=(full_mask.cumsum(1) - 1).clamp(min=0))
        return out.logits[:, -1].float()


@pytest.mark.parametrize("mode", ["greedy", "beam"])
def test_guidance_processor_cache_follows_reorders(hf, mode):
    model, tok = hf
    neg = torch.tensor([tok("The sad end.")["input_ids"]])
    cached = _generate(model, tok, PROMPTS, [GuidanceLogitsProcessor(3.0, model, negative_prompt_ids=neg)], mode)
    scratch = _generate(model, tok, PROMPTS, [_FromScratchGuidance(3.0, model, negative_prompt_ids=neg)], mode)
    plain = _generate(model, tok, PROMPTS, [], mode)
    assert cached == scratch
    assert cached != plain  # guidance changes the outputs of the tiny model at this scale


def test_guidance_processor_first_step_matches_formula(gpt2_model):
    model, tok = gpt2_model.model, gpt2_model.tokenizer.hf
    ids = torch.tensor([tok("Once upon a time")["input_ids"]])
    neg = torch.tensor([tok("The sad end.")["input_ids"]])
    with torch.no_grad():
        cond = torch.log_softmax(model(ids).logits[:, -1].float(), -1)
        uncond = torch.log_softmax(model(neg).logits[:, -1].float(), -1)
    expected = uncond + 2.5 * (cond - uncond)
    out = GuidanceLogitsProcessor(2.5, model, negative_prompt_ids=neg)(ids, model(ids).logits[:, -1].detach())
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=0)
    scores = torch.randn(1, gpt2_model.vocab_size)
    assert GuidanceLogitsProcessor(1.0, model)(ids, scores) is scores  # scale 1: nothing runs, nothing changes


def test_guidance_then_constraint(hf):
    model, tok = hf
    procs = [GuidanceLogitsProcessor(2.0, model), RegexLogitsProcessor(r"[0-9]{2,3}", tok)]
    for text in _generate(model, tok, PROMPTS, procs, "beam"):
        assert re.fullmatch(r"[0-9]{2,3}", text)


def test_docs_example_runs(monkeypatch):
    """docs/processors.md's example, with the stories260K fixture in place of the hub model."""
    from pathlib import Path

    from conftest import fixture_path

    local = str(fixture_path("models", "stories260K"))
    page = (Path(__file__).resolve().parents[1] / "docs" / "processors.md").read_text()
    code = page.split("```python\n", 1)[1].split("```", 1)[0].replace('"HuggingFaceTB/SmolLM2-135M"', repr(local))
    scope: dict = {}
    exec(compile(code, "docs/processors.md", "exec"), scope)
    prompts = ["Lily was born in the year", "Tom counted to"]
    assert len(scope["texts"]) == len(prompts)
    for prompt, text in zip(prompts, scope["texts"]):
        assert re.fullmatch(re.escape(prompt) + r" [0-9]{1,4}\.", text), text


def test_guidance_processor_equals_the_guided_generator(model):
    """The processor and ``generate.text(..., guidance_scale=...)`` share the guidance code: same greedy text."""
    from continuum import generate, samplers

    tok = model.tokenizer.hf
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    negative = "The sad end."
    ours = generate.text(model, samplers.greedy(), guidance_scale=2.0, negative_prompt=negative)("Once upon a time",
                                                                                                 max_tokens=12)
    neg_ids = torch.tensor([model.tokenizer.encode_prompts([negative])[0]])
    theirs = _generate(model.model, tok, ["Once upon a time"],
                       [GuidanceLogitsProcessor(2.0, model.model, negative_prompt_ids=neg_ids)], "greedy", max_new_tokens=12)[0]
    assert ours == theirs


GRAMMAR = r"""
start: "(" NUM OP NUM ")"
OP: "+" | "-"
NUM: /[1-9][0-9]?/
"""


@pytest.mark.parametrize("mode", list(MODES))
def test_grammar_processor_outputs_parse(hf, mode):
    import ast

    model, tok = hf
    from continuum.processors import GrammarLogitsProcessor

    for text in _generate(model, tok, PROMPTS, [GrammarLogitsProcessor(GRAMMAR, tok)], mode):
        assert re.fullmatch(r"\([1-9][0-9]?[+-][1-9][0-9]?\)", text), text
        ast.parse(text, mode="eval")  # an independent parser accepts it


@pytest.mark.parametrize("backend", ["outlines", "llguidance"])
def test_json_processor_both_engines_validate(gpt2_model, backend):
    jsonschema = pytest.importorskip("jsonschema")
    tok = gpt2_model.tokenizer.hf
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    proc = JSONLogitsProcessor(SCHEMA, tok, backend=backend)
    for text in _generate(gpt2_model.model, tok, PROMPTS, [proc], "beam", max_new_tokens=40):
        jsonschema.validate(proc.parse(text), SCHEMA)


def test_guidance_processor_keeps_its_earlier_name():
    assert CFGLogitsProcessor is GuidanceLogitsProcessor
