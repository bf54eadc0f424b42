"""One continuum program, run unchanged in one process or in every rank of a torchrun launch.

    python tests/distributed_script.py --model DIR --out OUT                      # one process
    torchrun --nproc-per-node 2 tests/distributed_script.py --model DIR --out OUT  # tensor parallelism

Under torchrun (``WORLD_SIZE`` set) the model is loaded with ``tp_plan="auto"``; every rank runs the
same calls with the same seeds (SPMD) and there is no rank-specific branch below. Every random
sampler gets an explicit ``rng``: the default sampler is multinomial on torch's global RNG, which differs
between processes, and ranks that pick different tokens run different forwards (gloo then aborts on
mismatched collectives). Each process writes
``OUT/results-<tag>.json`` (``tag``: ``single`` or ``tp2-rank0``...) mapping ``section/case`` to the
token ids of every row, the weights and the value; ``tests/test_distributed.py`` compares every rank's
file with the single-process one (ids equal, weights within 1e-4).

Adding a feature (the prefix cache, the chat API...) is one more function decorated with ``@section``
that returns ``{case: record(...)}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run by path: this checkout's continuum
from continuum import SequenceState, continuous, generate, models, samplers

SECTIONS: dict[str, Callable[[Context], dict[str, dict]]] = {}


@dataclass
class Context:
    model: Any
    out: Path  # where states are saved (shared by all runs: the save/load section reads the others' files)
    tag: str  # "single" or "tp<world>-rank<rank>"


def section(fn: Callable[[Context], dict[str, dict]]) -> Callable[[Context], dict[str, dict]]:
    """Register a section: a function of the context returning ``{case name: record(...)}``."""
    SECTIONS[fn.__name__] = fn
    return fn


def rng(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def record(state: SequenceState | None = None, value: Any = None, **extra) -> dict:
    """What is compared across layouts: each row's real token ids, the weights, and a value (JSON-able)."""
    out: dict[str, Any] = {"value": value, **extra}
    if state is not None:
        out["ids"] = [ids for ids, _ in state._real_rows()]
        out["weights"] = [float(w) for w in state.weights.flatten()]
        out["texts"] = list(state) if state.batch * state.samples > 1 else [str(state)]
    return out


def value_of(state: SequenceState) -> Any:
    """The state's last value, or the error reading it raises (a tiny random model may not finish a pattern:
    that must then happen identically in every layout)."""
    try:
        return state.value
    except Exception as exc:  # compared as text across layouts
        return f"{type(exc).__name__}: {exc}"


# ------------------------------------------------------------------------------------ sections
PROMPTS = ["Once upon a time", "The dog"]


@section
def text(ctx: Context) -> dict[str, dict]:
    m = ctx.model
    greedy = generate.text(m, samplers.greedy())
    sampled = continuous(generate.text(m, samplers.multinomial(2)))
    beams = continuous(generate.text(m, samplers.beam_search(2)))
    return {
        "greedy": record(continuous(greedy)(PROMPTS, max_tokens=8)),
        "plain": record(value=greedy(PROMPTS, max_tokens=6)),
        "stop": record(continuous(greedy)(PROMPTS, max_tokens=12, stop_at=["e", "."])),
        "multinomial": record(sampled(PROMPTS, max_tokens=6, rng=rng(1))),
        "beams": record(beams(PROMPTS[0], max_tokens=5)),
    }


@section
def constrained(ctx: Context) -> dict[str, dict]:
    m = ctx.model
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
              "required": ["ok", "n"]}
    grammar = 'start: "yes" | "no" | "maybe " NUM\nNUM: /[0-9]/'
    greedy = samplers.greedy()  # never the default sampler (multinomial on torch's global RNG): see the docstring
    out = {}
    for name, gen, kwargs in [
        ("choice_exact", generate.choice(m, [" happy", " sad", " sleepy"], greedy), {}),
        ("choice_greedy", generate.choice(m, [" happy", " sad", " sleepy"], greedy, method="greedy"), {}),
        ("choice_sampled", generate.choice(m, [" happy", " sad", " sleepy"], samplers.multinomial(3)), {"rng": rng(2)}),
        ("regex", generate.regex(m, r"[0-9]{2}-[a-c]{2}", greedy), {}),
        ("regex_beams", generate.regex(m, r"[0-9]{2}-[a-c]{2}", samplers.beam_search(2)), {}),
        ("json", generate.json(m, schema, greedy), {"max_tokens": 60}),
        ("grammar", generate.cfg(m, grammar, samplers.multinomial()), {"rng": rng(5)}),
    ]:
        state = continuous(gen)(PROMPTS, **kwargs)
        out[name] = record(state, value=value_of(state))
    return out


@section
def states(ctx: Context) -> dict[str, dict]:
    """Continuous states: slice, add, fork, state + state, beams across turns."""
    m = ctx.model
    story = continuous(generate.text(m, samplers.greedy()))
    s1 = story(PROMPTS, max_tokens=6)
    s2 = story(s1[..., :12] + " and", max_tokens=5)  # slice back, add text, resume
    fork = continuous(generate.text(m, samplers.multinomial(3)))(s2[0, :], max_tokens=4, rng=rng(3))
    both = story(s2[0, :] + s2[1, :], max_tokens=3)  # state + state: the right one's text, the left one's cache
    beam = continuous(generate.text(m, samplers.beam_search(2)))
    b1 = beam(PROMPTS[1], max_tokens=4)
    b2 = beam(b1 + " so", max_tokens=3)  # beams across turns
    mood = continuous(generate.choice(m, [" happy", " sad"], samplers.beam_search(2)))(b2 + " He was")
    return {"turn1": record(s1), "sliced": record(s2), "fork": record(fork), "added": record(both),
            "beams1": record(b1), "beams2": record(b2), "choice_after_beams": record(mood, value=value_of(mood))}


@section
def guidance(ctx: Context) -> dict[str, dict]:
    """Classifier-free guidance: a negative prompt, batched and sequential branches, across turns."""
    m = ctx.model
    out = {}
    for mode in ("batched", "sequential"):
        gen = continuous(generate.text(m, samplers.greedy(), guidance_scale=2.0, negative_prompt="The cat", cfg_mode=mode))
        s = gen(PROMPTS, max_tokens=5)
        out[mode] = record(gen(s + " then", max_tokens=4))
    beams = continuous(generate.text(m, samplers.beam_search(2), guidance_scale=1.5, negative_prompt="A"))
    out["beams"] = record(beams(PROMPTS[0], max_tokens=4))
    return out


@section
def streaming(ctx: Context) -> dict[str, dict]:
    m = ctx.model
    stream = continuous(generate.text(m, samplers.greedy())).stream(PROMPTS, max_tokens=6)
    chunks = [chunk for chunk in stream]
    plain = generate.regex(m, r"[a-z ]{4,8}", samplers.multinomial()).stream(PROMPTS[0], rng=rng(6))
    return {"text": record(stream.state, value=chunks), "regex": record(value=[[c for c in plain], plain.result])}


@section
def save_load(ctx: Context) -> dict[str, dict]:
    """Each process saves its state; it loads with its cache into the same layout and rank, and a file of
    another layout (the single-process file, read by every rank) loads without it and is recomputed."""
    m = ctx.model
    story = continuous(generate.text(m, samplers.greedy()))
    s = story(PROMPTS, max_tokens=5)
    s.save(ctx.out / f"state-{ctx.tag}.safetensors")
    own = SequenceState.load(ctx.out / f"state-{ctx.tag}.safetensors", m)
    out = {"own": record(story(own, max_tokens=4), kept=bool(own.cached_tokens.min() > 0))}
    single = ctx.out / "state-single.safetensors"  # written by the single-process run, which runs first
    if ctx.tag != "single" and single.exists():
        other = SequenceState.load(single, m)
        out["from_single"] = record(story(other, max_tokens=4), kept=bool(other.cached_tokens.sum() > 0))
    fp = m.fingerprint
    if fp.world_size > 1:  # the next rank's file: same layout, another rank (its heads), so recomputed too
        import torch.distributed as dist

        dist.barrier()  # every rank has saved
        other = SequenceState.load(ctx.out / f"state-tp{fp.world_size}-rank{(fp.rank + 1) % fp.world_size}.safetensors", m)
        out["from_other_rank"] = record(story(other, max_tokens=4), kept=bool(other.cached_tokens.sum() > 0))
    return out


@section
def seeding(ctx: Context) -> dict[str, dict]:
    """A random sampler without ``rng`` is warned about under tensor parallelism only (``max_tokens=0``:
    nothing is drawn, so the ranks stay in step)."""
    import logging

    from continuum.loop import parallel

    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda r: seen.append(r.getMessage())
    logging.getLogger("continuum").addHandler(handler)
    try:
        parallel._warned = False
        continuous(generate.text(ctx.model))(PROMPTS, max_tokens=0)  # default sampler: multinomial, no rng
        continuous(generate.text(ctx.model, samplers.multinomial()))(PROMPTS, max_tokens=0, rng=rng(7))
    finally:
        logging.getLogger("continuum").removeHandler(handler)
    warned = any("without rng=" in m for m in seen)
    return {"unseeded_warning": record(value=warned == (ctx.model.fingerprint.world_size > 1))}


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@section
def chat(ctx: Context) -> dict[str, dict]:
    """Chat sessions: a text reply, a choice reply, forks across turns, an assistant prefill."""
    from continuum.chat import Chat

    m = ctx.model
    c = Chat(m, template=CHATML, system="Be brief.")
    c1 = c.user("Tell me a story.").reply(generate.text(m, samplers.greedy()), max_tokens=6)
    c2 = c1.user("Again?").reply(generate.choice(m, ["yes", "no"], samplers.greedy()))
    forks = c2.user("More.").reply(generate.text(m, samplers.multinomial(2)), max_tokens=4, rng=rng(8))
    pre = forks[1].assistant("Once").reply(generate.text(m, samplers.greedy()), max_tokens=3)
    return {"text": record(c1.state, value=c1.messages), "choice": record(c2.state, value=c2.value),
            "forks": record(forks.state, value=forks.messages), "prefill": record(pre.state, value=pre.messages)}


@section
def prefix_cache(ctx: Context) -> dict[str, dict]:
    """The automatic prefix cache on the same (sharded) model: hits reuse each rank's own heads."""
    m = ctx.model
    cached = models.Transformers(m.model, m.tokenizer.hf, prefix_cache="16MiB")
    shared = "Once upon a time there was a dog who liked to run in the park with his friends. " * 2
    gen = continuous(generate.text(cached, samplers.greedy()))
    first = gen([shared + "One day", shared + "The cat"], max_tokens=4)
    again = gen([shared + "Then", shared + "One day"], max_tokens=4)
    stats = cached.prefix_cache.stats()
    plain = continuous(generate.text(m, samplers.greedy()))([shared + "Then", shared + "One day"], max_tokens=4)
    return {"first": record(first), "again": record(again), "again_uncached": record(plain),
            "hits": record(value=[stats["hits"] > 0, stats["tokens_reused"], stats["bytes"] <= stats["max_bytes"]])}


@section
def programs(ctx: Context) -> dict[str, dict]:
    """``run_batch`` of a branching program (text -> choice -> regex or text), each instance with its own rng."""
    import continuum

    m = ctx.model
    story = continuous(generate.text(m, samplers.greedy()))
    pick = continuous(generate.choice(m, [" yes", " no"], samplers.greedy()))
    digits = continuous(generate.regex(m, r"[0-9]{2}", samplers.greedy()))
    sampled = continuous(generate.text(m, samplers.multinomial()))

    def program(i: int) -> SequenceState:
        s = story(PROMPTS[i % 2] + " " * (i // 2), max_tokens=3)
        c = pick(s + " Sure?")
        return digits(c + " n=", max_tokens=4) if c.value == " yes" else sampled(c + " So", max_tokens=3, rng=rng(10 + i))

    results = continuum.run_batch(program, range(4), concurrency=4)
    return {f"run_batch_{i}": record(s, value=value_of(s)) for i, s in enumerate(results)}


@section
def concurrent(ctx: Context) -> dict[str, dict]:
    """Calls from several threads share forwards; under torchrun rank 0 decides every merged batch
    (continuum/loop/ranks.py), so every rank runs the same forwards. Each thread names its calls."""
    import threading

    from continuum.loop.ranks import call_key

    m = ctx.model
    greedy = continuous(generate.text(m, samplers.greedy()))
    sampled = continuous(generate.text(m, samplers.multinomial(2)))
    pick = continuous(generate.choice(m, [" happy", " sad"], samplers.greedy()))
    regex = continuous(generate.regex(m, r"[0-9]{2}-[a-c]{2}", samplers.greedy()))
    programs = {
        "greedy_then_more": lambda: greedy(greedy(PROMPTS[0], max_tokens=4) + " and", max_tokens=3),
        "sampled": lambda: sampled(PROMPTS[1], max_tokens=5, rng=rng(7)),
        "choice": lambda: pick(PROMPTS),
        "regex": lambda: regex(PROMPTS[0]),
    }
    out: dict[str, dict] = {}
    errors: list = []

    def run(i: int, name: str) -> None:
        try:
            with call_key(i):
                state = programs[name]()
            out[name] = record(state, value=value_of(state))
        except Exception as exc:  # noqa: BLE001  (reported in the main thread)
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i, name)) for i, name in enumerate(programs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


# ------------------------------------------------------------------------------------ driver
def load_model(path: str):
    """The same checkpoint: tensor-parallel under torchrun, plain otherwise."""
    return models.transformers(path, tp_plan="auto") if "WORLD_SIZE" in os.environ else models.transformers(path)


def main(model_dir: str, out: str | Path, model: Any = None) -> dict[str, dict]:
    """Run every section and write ``out/results-<tag>.json``; returns the results."""
    out = Path(out)
    model = model if model is not None else load_model(model_dir)
    fp = model.fingerprint
    tag = "single" if fp.world_size == 1 else f"tp{fp.world_size}-rank{fp.rank}"
    ctx = Context(model, out, tag)
    results = {"layout": {"value": fp.layout}}
    for name, fn in SECTIONS.items():
        for case, rec in fn(ctx).items():
            results[f"{name}/{case}"] = rec
    (out / f"results-{tag}.json").write_text(json.dumps(results, default=str))
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    main(args.model, args.out)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    sys.exit(0)
