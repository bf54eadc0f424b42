"""Benchmark B23: a 4-turn reasoning chat (Qwen3's template, ~64-token thoughts), three ways.

* ``keep_reasoning=True``: ``Chat`` keeps every earlier thought in the rendered history, so each turn
  extends the state: it computes the new messages only.
* ``keep_reasoning=False``: the template's policy (Qwen3 drops earlier thoughts): the chat rewinds
  to the first changed token (the previous turn's ``<think>``) and recomputes the suffix once.
* stateless re-render: ``apply_chat_template`` of the same messages + HF ``generate`` (what a serving
  loop without state does): the whole prompt, every turn.

Per turn: positions computed by the prompt (``chat.recomputed``, and the HF forward counter) and
TTFT (a 1-token probe after the new user message, template rendering included on both sides).
With random weights the benchmark model gets one token per ASCII character (a random thought then
re-renders to exactly its tokens, as a real model's canonical text does); ``--model`` is used as it is.
"""

from __future__ import annotations

import torch

from continuum import generate, samplers
from continuum.chat import Chat

from .counting import ForwardCounter
from .measurement import measure, median
from .model import FIXTURES, Bench
from .results import Row, Skip, log

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
USERS = ["What is the capital of France? Explain briefly.", "And the one of Italy, and why is it famous?",
         "Which of the two cities is older? Give a short reason.", "Summarise both answers in one sentence."]


def _char_tokenizer():
    """One token per ASCII character plus ChatML and think markers as special tokens."""
    import string

    from tokenizers import Tokenizer, decoders, pre_tokenizers, trainers
    from tokenizers import models as tmodels
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(tmodels.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([string.printable], trainers.BpeTrainer(vocab_size=1, special_tokens=SPECIAL, show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=SPECIAL[1:])


def kept_history(messages: list) -> list[dict]:
    """The messages a stateless loop renders for ``keep_reasoning=True`` (docs/reasoning.md): every earlier
    assistant thought written into its content as generated, ``<think>\\n...\\n</think>\\n\\n`` + the answer,
    with an empty ``reasoning_content`` so that the template keeps it.

    Example:
        >>> kept_history([{"role": "assistant", "content": "A", "reasoning_content": "t"}, {"role": "user", "content": "Q"}])[0]
        {'role': 'assistant', 'content': '<think>\\nt\\n</think>\\n\\nA', 'reasoning_content': ''}
    """
    out = []
    for i, m in enumerate(messages):
        thought = m.get("reasoning_content")
        if m["role"] == "assistant" and isinstance(thought, str) and thought and i < len(messages) - 1:
            m = {**m, "content": f"<think>\n{thought}\n</think>\n\n{m['content']}", "reasoning_content": ""}
        out.append(dict(m))
    return out


def reasoning_bench_model(bench: Bench) -> Bench:
    if not bench.random_weights:
        return bench
    import copy

    from transformers import GPT2LMHeadModel

    from continuum import models

    tok = _char_tokenizer()
    torch.manual_seed(0)
    hf_cfg = copy.deepcopy(bench.hf.config)  # the benchmark model's shape (GPT-2 small; --smoke: the tiny one)
    hf_cfg.vocab_size, hf_cfg.n_positions, hf_cfg.bos_token_id, hf_cfg.eos_token_id = len(tok), 4096, 0, 2
    hf = GPT2LMHeadModel(hf_cfg).eval()
    hf.generation_config.pad_token_id = 0
    return Bench(hf=hf, tok=tok, model=models.Transformers(hf, tok), random_weights=True, counter=ForwardCounter(hf),
                 name=f"random fp32 GPT-2 ({hf_cfg.n_layer} layers, {hf_cfg.n_embd} wide), one token per ASCII character "
                      f"(vocab {len(tok)}, <think>/</think> special), 4,096 positions")


def b23(bench: Bench, cfg) -> list[Row]:
    path = FIXTURES / "chat_templates" / "qwen3.jinja"
    if not path.exists():
        raise Skip(f"no Qwen3 chat template fixture at {path}")
    tpl = path.read_text()
    bench = reasoning_bench_model(bench)
    tok, budget, answer = bench.tok, getattr(cfg, "b23_budget", 64), getattr(cfg, "b23_answer", 12)
    users = USERS[:getattr(cfg, "b23_turns", len(USERS))]
    thinker = generate.text(bench.model, samplers.greedy(), reasoning=True, thinking_budget=budget)
    probe_gen = generate.text(bench.model, samplers.greedy())
    reps = 1 if cfg.quick else 3
    log(f"B23: {len(users)}-turn chat (Qwen3 template), {budget}-token thoughts, {answer}-token answers; model: {bench.name}")

    def stateless(messages):
        ids = tok.apply_chat_template(messages, chat_template=tpl, add_generation_prompt=True, tokenize=True,
                                      return_dict=False, enable_thinking=True)
        with torch.inference_mode():
            bench.hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              max_new_tokens=1, do_sample=False, pad_token_id=0)
        return {"generated": 1, "prompt": len(ids)}

    def session(keep: bool) -> dict:
        out: dict = {"probe_s": [], "base_s": [], "computed": [], "recomputed": [], "prompt": [], "thought": []}
        chat = Chat(bench.model, template=tpl, reasoning=True, keep_reasoning=keep)
        for u in users:
            asked = chat.user(u)
            equivalent = kept_history(asked.messages) if keep else [dict(m) for m in asked.messages]
            probes, bases = [], []
            for i in range(reps):  # paired, alternating order
                first = measure(bench, lambda: (asked.reply(probe_gen, max_tokens=1, reasoning=False), 1)[1]) if i % 2 else None
                b = measure(bench, lambda: stateless(equivalent))
                c = first or measure(bench, lambda: (asked.reply(probe_gen, max_tokens=1, reasoning=False), 1)[1])
                probes.append(c.seconds)
                bases.append(b.seconds)
            turn = measure(bench, lambda: (out.__setitem__("chat", asked.reply(thinker, max_tokens=budget + answer + 8)), 1)[1])
            chat = out.pop("chat")
            out["probe_s"].append(median(probes))
            out["base_s"].append(median(bases))
            out["prompt"].append(b.extra["prompt"])
            out["recomputed"].append(chat.recomputed)
            out["computed"].append(turn.computed)
            out["thought"].append(len(tok(chat.state.reasoning, add_special_tokens=False)["input_ids"]))
        return out

    keep, drop = session(True), session(False)
    T = len(users)
    speed_keep = [b / c for b, c in zip(keep["base_s"], keep["probe_s"])]
    speed_drop = [b / c for b, c in zip(drop["base_s"], drop["probe_s"])]
    notes = [
        f"{T} turns; thoughts of {' '.join(map(str, keep['thought']))} tokens (budget {budget}); prompt grows "
        f"{keep['prompt'][0]} -> {keep['prompt'][-1]} tokens (keep_reasoning=True) / {drop['prompt'][0]} -> "
        f"{drop['prompt'][-1]} (False)",
        "prompt positions computed per turn, stateless re-render (keep=True's messages): " + " ".join(map(str, keep["prompt"])),
        "prompt positions computed per turn, keep_reasoning=True:  " + " ".join(map(str, keep["recomputed"])),
        "prompt positions computed per turn, keep_reasoning=False: " + " ".join(map(str, drop["recomputed"])),
        "positions computed per whole turn (prompt + thought + answer), True: " + " ".join(map(str, keep["computed"]))
        + "; False: " + " ".join(map(str, drop["computed"])),
        "TTFT per turn (s), stateless: " + " ".join(f"{x:.3f}" for x in keep["base_s"]),
        "TTFT per turn (s), keep_reasoning=True: " + " ".join(f"{x:.3f}" for x in keep["probe_s"])
        + "; False: " + " ".join(f"{x:.3f}" for x in drop["probe_s"]),
        "TTFT speedup vs stateless per turn, True: " + " ".join(f"{x:.1f}" for x in speed_keep)
        + "; False (vs its own stateless rendering): " + " ".join(f"{x:.1f}" for x in speed_drop),
    ]
    row = Row(id="B23", title=f"reasoning chat TTFT at turn {T}, keep_reasoning=True",
              baseline="apply_chat_template + HF generate (stateless re-render), 1 token", figure=speed_keep[-1], op=">=",
              threshold=2.0, unit="x faster", base_s=keep["base_s"][-1], cont_s=keep["probe_s"][-1],
              base_computed=keep["prompt"][-1], cont_computed=keep["recomputed"][-1], reps=reps, notes=notes,
              series={"title": "B23: reasoning chat TTFT per turn", "x": list(range(1, T + 1)), "xlabel": "turn",
                      "ylabel": "TTFT (s)", "log_y": True,
                      "lines": {"stateless re-render": keep["base_s"], "keep_reasoning=True": keep["probe_s"],
                                "keep_reasoning=False": drop["probe_s"]}})
    return [row]
