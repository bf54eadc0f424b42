"""B24g: the same 8-turn chat on the llama.cpp backend and on the transformers backend (fp32, then bf16).

``continuum.chat.Chat(model, template=...)`` with Gemma 3's template (the GGUF carries none:
``chat_templates/gemma3.jinja``); every turn one user message and a greedy reply of ``new`` tokens. The transformers
side loads the same GGUF dequantized (``from_pretrained(folder, gguf_file=...)``: about a minute per load on 2 cores;
``--smoke``: the stories260K safetensors fixture, the GGUF's source). Figure: tokens/s of the replies, llama.cpp /
transformers fp32 (no target: the issue asks for each backend's tokens/s, in the notes). Until chats run on llama.cpp
models the row is replaced by ``B24g: cannot run (...)`` on stdout, before anything is loaded.

Example:
    >>> row = b24g(cfg, ours, "model: Gemma 3 270M Q4_K_M")     # doctest: +SKIP
"""

from __future__ import annotations

import time
from pathlib import Path

from .model import FIXTURES
from .results import Row

__all__ = ["b24g", "USER_TURNS"]

USER_TURNS = ["Tell me about harbours.", "What do fishing boats bring back?", "Who keeps the lighthouse?",
              "Describe the market in the morning.", "What does a harbour master do?", "Why do ships wait outside?",
              "Write one line about the weather.", "Say goodbye to the town."]


def _chat_tps(model, template: str, turns: int, new: int) -> tuple[float, float, int]:
    """(tokens/s, seconds, reply tokens) of a ``turns``-turn greedy chat on ``model``."""
    from continuum import generate, samplers
    from continuum.chat import Chat

    gen = generate.text(model, samplers.greedy())
    chat = Chat(model, template=template)
    made, took = 0, 0.0
    for k in range(turns):
        t = time.perf_counter()
        chat = chat.user(USER_TURNS[k % len(USER_TURNS)]).reply(gen, max_tokens=new)
        took += time.perf_counter() - t
        made += len(model.tokenizer.encode_continuation(chat.value))
    return made / took, took, made


def _transformers(path: Path, smoke: bool, dtype):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from continuum import models

    if smoke:
        folder = FIXTURES / "models" / "stories260K"
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(folder)
    else:
        hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return models.Transformers(hf.to(dtype).eval(), tok)


def b24g(cfg, ours, note: str) -> Row | None:
    """The row, or None (said on stdout) when it cannot run here."""
    import torch

    from continuum.errors import ContinuumError

    template_path = FIXTURES / "chat_templates" / "gemma3.jinja"
    if not template_path.exists():
        print(f"B24g: cannot run (no chat template: {template_path} is absent)", flush=True)
        return None
    template = template_path.read_text()
    try:
        from continuum.chat import Chat

        Chat(ours, template=template)
    except (ContinuumError, ImportError) as exc:
        print(f"B24g: cannot run (chats on llama.cpp not available: {exc})", flush=True)
        return None
    try:
        import gguf  # noqa: F401  (transformers reads GGUF files through it)
    except ImportError:
        if not cfg.smoke:
            print("B24g: cannot run (the transformers side loads the GGUF with the gguf package: pip install gguf)",
                  flush=True)
            return None
    turns, new = (2, 4) if cfg.smoke else (8, 16 if cfg.quick else 32)
    tps = {"llama.cpp": _chat_tps(ours, template, turns, new)}
    for name, dtype in (("transformers fp32", torch.float32), ("transformers bf16", torch.bfloat16)):
        hf = _transformers(Path(ours.llama.path), cfg.smoke, dtype)
        tps[name] = _chat_tps(hf, template, turns, new)
        del hf
    base = tps["transformers fp32"]
    return Row("B24g", f"{turns}-turn chat, {new}-token replies: llama.cpp vs transformers", "transformers fp32",
               tps["llama.cpp"][0] / base[0], ">=", 0.0, "x tokens/s", base_s=base[1], cont_s=tps["llama.cpp"][1],
               base_tps=base[0], cont_tps=tps["llama.cpp"][0], reps=1,
               notes=[note, "tokens/s of the replies: " + ", ".join(f"{k} {v[0]:.1f} ({v[2]} tokens in {v[1]:.2f}s)"
                                                                    for k, v in tps.items())])
