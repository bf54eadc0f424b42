"""A 20-question multiple-choice task for lm-eval, to check ``continuum serve``'s legacy completions
(``echo`` + ``logprobs``) against the library's own scoring (docs/serve.md, "Evaluation harnesses").

    python3 examples/lmeval_task.py write TASK_DIR        # TASK_DIR/tinystories_mc.{jsonl,yaml}
    lm_eval --model local-completions --include_path TASK_DIR --tasks tinystories_mc --log_samples ...
    python3 examples/lmeval_task.py compare SAMPLES.jsonl MODEL_DIR   # lm-eval's scores vs generate.choice

The questions are short TinyStories-style stories whose answer the story states, built
deterministically; question ``i`` has its answer at option ``i % 4`` (so always picking the first
option, what a server without prompt log-probs makes lm-eval do, scores exactly 0.25).
tests/test_serve_lmeval.py builds the same task.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

NAME = "tinystories_mc"
NAMES = [("Lily", "She", "her"), ("Tom", "He", "his"), ("Mia", "She", "her"), ("Ben", "He", "his")]
# (the story, with the answer as {x}; the prompt the options complete; the four options)
KINDS = [
    ("{n} had a {x} ball.", "The ball was", ["red", "blue", "green", "yellow"]),
    ("{n} had a pet {x}. {P} loved {p} pet very much.", "{P} played with {p}", ["dog", "cat", "bird", "fish"]),
    ("{n} went to the {x} with {p} mom.", "They had fun at the", ["park", "beach", "store", "zoo"]),
    ("{n} lost {p} toy. {P} felt {x}.", "{n} was very", ["sad", "happy", "scared", "angry"]),
    ("{n} had a friend named {x}.", "{n} played with", ["Sue", "Max", "Anna", "Jack"]),
]


def questions() -> list[dict]:
    """20 questions ``{"context", "choices", "label"}`` (seed 31). lm-eval appends ``" " + choice``."""
    rng = random.Random(31)
    out: list[dict] = []
    for story, ask, options in KINDS:
        for n, P, p in NAMES:
            x = rng.choice(options)
            opts = rng.sample([o for o in options if o != x], len(options) - 1)
            opts.insert(len(out) % 4, x)
            out.append({"context": f"{story} {ask}".format(n=n, P=P, p=p, x=x), "choices": opts, "label": opts.index(x)})
    return out


def write(folder: str | Path, cache_dir: str | Path | None = None) -> Path:
    """Write ``folder/tinystories_mc.jsonl`` and the task ``folder/tinystories_mc.yaml`` (``dataset_path:
    json`` on that file; ``cache_dir``: where ``datasets`` caches it, default its own cache)."""
    folder = Path(folder).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / f"{NAME}.jsonl"
    data.write_text("".join(json.dumps(q) + "\n" for q in questions()))
    cache = f"\n  cache_dir: {json.dumps(str(cache_dir))}" if cache_dir is not None else ""
    (folder / f"{NAME}.yaml").write_text(f"""task: {NAME}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {json.dumps(str(data))}{cache}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
""")
    return folder


def library_scores(model, context: str, options: list[str]) -> tuple[list[float], str]:
    """The library's exact choice scoring: each option's total log-prob after ``context`` (the weights of
    ``beam_search(len(options))`` over the options: every option, one forward), and the greedy pick."""
    from continuum import generate, samplers
    from continuum.generate import continuous

    state = continuous(generate.choice(model, options, samplers.beam_search(len(options))))(context)
    by_text = {text[len(context):]: w for text, w in zip(state.texts, state.weights.flatten().tolist())}
    return [by_text[o] for o in options], generate.choice(model, options, samplers.greedy())(context)


def compare(samples: list[dict], model) -> dict:
    """lm-eval's logged samples (``--log_samples``) against :func:`library_scores`: both accuracies, how
    many questions pick the same option, the largest |difference| of a log-likelihood."""
    right_eval = right_lib = same = 0
    diff = 0.0
    for s in samples:
        doc = s["doc"]
        options = [" " + c for c in doc["choices"]]
        served = [float(r[0]) for r in s["filtered_resps"]]
        scores, pick = library_scores(model, doc["context"], options)
        diff = max(diff, *(abs(a - b) for a, b in zip(served, scores)))
        best = max(range(len(served)), key=served.__getitem__)
        right_eval += best == doc["label"]
        right_lib += options.index(pick) == doc["label"]
        same += options.index(pick) == best
    n = len(samples)
    return {"n": n, "acc_lmeval": right_eval / n, "acc_library": right_lib / n, "same_pick": same, "max_abs_diff": diff}


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "write":
        print(write(sys.argv[2]))
    elif len(sys.argv) == 4 and sys.argv[1] == "compare":
        from continuum import models

        rows = [json.loads(line) for line in Path(sys.argv[2]).read_text().splitlines() if line.strip()]
        print(json.dumps(compare(rows, models.transformers(sys.argv[3]))))
    else:
        sys.exit(__doc__)
