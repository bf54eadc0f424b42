"""Benchmark B10: forced-token fast-forward on JSON with compact whitespace (the B5 schema).

Forced keys and punctuation are appended as one run and computed in the next forward pass: the
figure is how many fewer forward passes a JSON output takes than the same generator with
``fast_forward=False`` (time ratio in the notes). Both sides must produce the same text.
"""

from __future__ import annotations

from continuum import continuous, generate, samplers

from .helpers import complete, json_schema, new_tokens
from .measurement import median, paired
from .model import Bench, make_text, n_tokens
from .results import Row, log

__all__ = ["b10"]


def b10(bench: Bench, cfg) -> list[Row]:
    """B10 on stories260K when the fixture is there (the checked row: a trained model that closes its
    JSON), and on the benchmark model. A random model writes digits until ``max_tokens``, so few keys
    get forced: with stories260K present its row is informational (checked only against ``>= 1``:
    fast-forward never costs forwards, and both sides give the same text)."""
    stories = _stories()
    random_row = _b10(bench, cfg, "B10", make_text(bench.tok, 32, offset=3) + "\nThe person as JSON: ",
                      threshold=1.0 if stories is not None else 1.5)
    if stories is None:
        return [random_row]
    random_row.notes.insert(0, "informational (random weights): the checked B10 figure is the stories260K row")
    # a trained model with a small vocabulary: keys spelled with several tokens
    return [_b10(stories, cfg, "B10-stories260K", "Once upon a time, JSON: "), random_row]


def _stories():
    """stories260K (the fixture) as a benchmark model, or None when the fixture is absent."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from continuum import models

    from .counting import ForwardCounter
    from .model import FIXTURES

    path = FIXTURES / "models" / "stories260K"
    if not path.exists():
        return None
    tok = AutoTokenizer.from_pretrained(str(path))
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return Bench(hf=hf, tok=tok, model=models.Transformers(hf, tok), name="stories260K (fixture)",
                 random_weights=False, counter=ForwardCounter(hf))


def _b10(bench: Bench, cfg, row_id: str, prompt: str, threshold: float = 1.5) -> Row:
    Person = json_schema()
    plen = n_tokens(bench.tok, prompt)
    fast_c = continuous(generate.json(bench.model, Person, samplers.greedy(), whitespace_pattern=""))
    slow_c = continuous(generate.json(bench.model, Person, samplers.greedy(), whitespace_pattern="", fast_forward=False))
    out = {}

    def run(gen, key):
        def f():
            s = gen(prompt, max_tokens=cfg.b5_max)
            out[key] = s.last_text
            out[key + "_complete"] = complete(s)
            return new_tokens(s, plen)
        return f

    log(f"{row_id}: compact JSON with fast-forward vs the same generator with fast_forward=False ({bench.name})")
    base, cont = paired(bench, run(slow_c, "slow"), run(fast_c, "fast"), cfg.reps, log=log)
    same = out["slow"] == out["fast"]
    fwd = median([b.forward_calls / c.forward_calls for b, c in zip(base, cont)])
    time_ratios = [c.seconds / b.seconds for b, c in zip(base, cont)]
    tokens = median([c.generated for c in cont])
    notes = [f"model: {bench.name}; {tokens} tokens per output ({'complete' if out['fast_complete'] else 'cut by max_tokens'}), "
             f"forwards per output {median([b.forward_calls for b in base])} -> {median([c.forward_calls for c in cont])}; "
             f"same text on both sides: {same}: {out['fast'][:80]!r}",
             f"time ratio (fast-forward / step by step) {median(time_ratios):.3f}; per rep "
             f"{' '.join(f'{r:.3f}' for r in time_ratios)}"]
    if not same:
        notes.append("MISMATCH: fast-forward changed the greedy output")
    b_s, c_s = median([b.seconds for b in base]), median([c.seconds for c in cont])
    return Row(id=row_id, title="compact JSON, forced-token fast-forward", baseline="same generator, fast_forward=False",
               figure=fwd if same else float("nan"), op=">=", threshold=threshold, unit="x fewer forwards", base_s=b_s,
               cont_s=c_s, base_tps=tokens / b_s if b_s else None, cont_tps=tokens / c_s if c_s else None,
               base_computed=int(median([b.computed for b in base])), cont_computed=int(median([c.computed for c in cont])),
               reps=len(base), notes=notes)
