"""Benchmarks B15-B20: one program run over many inputs with ``continuum.run_batch`` (issue 22).

Workloads shaped like SGLang's benchmark programs (``benchmark/`` in sgl-project/sglang), synthetic
text, on the benchmark model. Every figure is programs per second of ``run_batch`` against a baseline
measured in the same run (paired repetitions, median ratio):

* B15 32 one-call programs (40-120-word prompts, 32 new tokens) vs one call at a time, one list call,
  and transformers' continuous batching (``model.generate_batch``; skipped when unavailable);
* B16 multi-turn chat (16 sessions x 4 turns) vs sessions one after another and lockstep list calls;
* B17 tree of thought (fork 3 at each of 3 levels, 16-token thoughts, 8 instances) vs sequential;
* B18 select (HellaSwag shape: shared ~400-token few-shot prefix, 4 endings, 32 instances, prefix
  cache on) vs sequential with the prefix cache and one list call;
* B19 judge (~300-token article, fork 6 judgements of 24 tokens, merge, 2-token verdict, 8 instances)
  vs sequential;
* B20 regex chain (~300-token document, 5 chained regex fields, 16 instances) vs sequential and
  lockstep list calls.

When the model has a scheduler exposing ``stats()`` (padding ratio, p99 wait between two steps of one
call, ...), its figures for the ``run_batch`` side are added to the notes.
"""

from __future__ import annotations

import copy
import statistics
from collections.abc import Callable
from typing import Any

import torch

import continuum
from continuum import continuous, generate, models, samplers
from continuum.chat import Chat

from .counting import ForwardCounter
from .measurement import Call, measure
from .model import CORPUS, FIXTURES, Bench, make_text
from .results import Row, log, row_from_calls

__all__ = ["b15", "b16", "b17", "b18", "b19", "b20", "PROGRAM_SCENARIOS"]

WORDS = CORPUS.split()
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + "
          "'\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def _size(cfg, full: int, quick: int, name: str) -> int:
    """A scenario size: ``cfg.<name>`` when set, else the full or quick default."""
    return int(getattr(cfg, name, quick if getattr(cfg, "quick", False) else full))


def _reps(cfg) -> int:
    return max(1, int(getattr(cfg, "heavy_reps", 1)))


def _words(n: int, offset: int) -> str:
    return " ".join(WORDS[(offset + i) % len(WORDS)] for i in range(n))


def _sched_stats(model) -> dict:
    """The model's scheduler figures (padding ratio, p99 step wait...), when it exposes them."""
    stats = getattr(getattr(model, "scheduler", None), "stats", None)
    if not callable(stats):
        return {}
    try:
        got = stats()
    except Exception as exc:  # noqa: BLE001 - a report, never a failure of the benchmark
        return {"error": repr(exc)}
    return dict(got) if isinstance(got, dict) else {"stats": got}


def _reset_sched(model) -> None:
    reset = getattr(getattr(model, "scheduler", None), "reset_stats", None)
    if callable(reset):
        reset()


def _compare(bench: Bench, variants: dict[str, Callable[[], object]], reps: int, warmup: int = 0,
             collect: bool = True) -> dict[str, list[Call]]:
    """Each variant run ``warmup`` times untimed, then timed ``reps`` times, the order rotated every repetition (slow
    drifts hit all alike); ``collect=False``: no full garbage collection before each (``measurement.measure``).

    The ``run_batch`` variant's scheduler figures are collected into ``calls["run_batch"][i].extra``."""
    calls: dict[str, list[Call]] = {k: [] for k in variants}
    names = list(variants)
    for _ in range(warmup):
        for name in names:
            variants[name]()
    for rep in range(reps):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            if name == "run_batch":
                _reset_sched(bench.model)
            call = measure(bench, variants[name], collect)
            if name == "run_batch":
                call.extra["scheduler"] = _sched_stats(bench.model)
            calls[name].append(call)
            log(f"    rep {rep + 1}/{reps} {name}: {call.seconds:.3f}s")
    return calls


def _rows(id: str, title: str, n: int, calls: dict[str, list[Call]], targets: dict[str, float], labels: dict[str, str],
          notes: list[str]) -> list[Row]:
    """One checked row per baseline with a target: run_batch's speed-up over it (programs/s ratio)."""
    cont = calls["run_batch"]
    rate = {k: n / statistics.median(c.seconds for c in v) for k, v in calls.items()}
    notes = notes + ["programs/s: " + ", ".join(f"{k} {v:.2f}" for k, v in rate.items())]
    informative = [k for k in calls if k != "run_batch" and k not in targets]
    for k in informative:
        ratio = statistics.median(b.seconds / c.seconds for b, c in zip(calls[k], cont))
        notes.append(f"run_batch vs {labels.get(k, k)}: {ratio:.2f}x (no target)")
    sched = cont[-1].extra.get("scheduler") if cont else None
    if sched:
        notes.append("scheduler: " + ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in sched.items()))
    out: list[Row] = []
    for j, (k, threshold) in enumerate(targets.items()):
        if k not in calls:  # a baseline skipped here (its reason is in the notes)
            continue
        out.append(row_from_calls(f"{id}{'abcdef'[j]}" if len(targets) > 1 else id, f"{title} vs {labels.get(k, k)}",
                                  labels.get(k, k), calls[k], cont, op=">=", threshold=threshold, speedup=True,
                                  unit="x programs/s", notes=notes if not out else []))
    return out


# ---------------------------------------------------------------------------------------------- B15
def _hf_generate_batch(bench: Bench, prompts: list[str], new: int, quick: bool = False):
    """transformers' continuous batching (``generate_batch``) on the same prompts, or None when unavailable."""
    from transformers import GenerationConfig

    if not hasattr(bench.hf, "generate_batch"):
        return None
    hf_model: Any = bench.hf
    tok: Any = bench.tok
    cb_config: Any = None
    try:
        from transformers.generation import configuration_utils

        cb_config = getattr(configuration_utils, "ContinuousBatchingConfig", None)
    except ImportError:  # older transformers: its defaults
        pass
    ids = [tok(p)["input_ids"] for p in prompts]
    gen_cfg = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=tok.eos_token_id,
                               pad_token_id=bench.pad_id)
    if bench.force_length:
        gen_cfg.min_new_tokens = new
    # a paged cache sized for this batch (the default sizes it from free memory: tens of seconds to set up here)
    kw: dict[str, Any] = {}
    if cb_config is not None:
        longest = max(map(len, ids)) + new
        kw["continuous_batching_config"] = cb_config(
            num_blocks=len(ids) * (1 + longest // 256) + 8, max_batch_tokens=max(512, sum(map(len, ids))))

    def run():
        with torch.inference_mode():
            out = hf_model.generate_batch(inputs=ids, generation_config=gen_cfg, progress_bar=False, warmup=False, **kw)
        return sum(len(o.generated_tokens) for o in out.values())

    try:
        if not quick:
            run()  # warm-up, and the check that it works here
        else:  # quick: no warm-up (it takes as long as the run); a 1-token call checks that it works here
            hf_model.generate_batch(inputs=ids[:1], generation_config=GenerationConfig(
                max_new_tokens=1, do_sample=False, pad_token_id=bench.pad_id), progress_bar=False, warmup=False, **kw)
    except Exception as exc:  # noqa: BLE001 - skipped cleanly, with the reason in the notes
        return repr(exc)[:200]
    return run


def b15(bench: Bench, cfg) -> list[Row]:
    n, new = _size(cfg, 32, 8, "b15_n"), _size(cfg, 32, 8, "b15_new")
    prompts = [_words(40 + (i * 37) % 81, i * 11) for i in range(n)]
    gen = generate.text(bench.model, samplers.greedy())
    log(f"B15: {n} one-call programs, 40-120-word prompts, {new} new tokens")
    gen(prompts[0], max_tokens=2)
    variants: dict[str, Callable[[], object]] = {
        "sequential": lambda: [gen(p, max_tokens=new) for p in prompts] and n * new,
        "list call": lambda: gen(prompts, max_tokens=new) and n * new,
        "run_batch": lambda: continuum.run_batch(lambda p: gen(p, max_tokens=new), prompts, concurrency=n) and n * new,
    }
    notes = []
    hf = "turned off (cfg.b15_hf)"
    if getattr(cfg, "b15_hf", True):
        hf = _hf_generate_batch(bench, prompts, new, getattr(cfg, "quick", False))
    if callable(hf):
        variants["generate_batch"] = hf
    else:
        notes.append(f"HF generate_batch skipped: {hf or 'not available in this transformers'}")
    calls = _compare(bench, variants, _reps(cfg))
    return _rows("B15", f"{n} one-call programs", n, calls, {"list call": 0.9, "generate_batch": 1.5},
                 {"list call": "one list call", "generate_batch": "HF generate_batch", "sequential": "one call at a time"}, notes)


# ---------------------------------------------------------------------------------------------- B16
def _chat_bench(bench: Bench) -> Bench:
    """The bench model with ``<|im_start|>``/``<|im_end|>`` as special tokens and 2,048 positions (a real
    ``--model`` is used as it is)."""
    if not bench.random_weights:
        return bench
    from transformers import GPT2LMHeadModel

    tok: Any = copy.deepcopy(bench.tok)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    hf_cfg = copy.deepcopy(bench.hf.config)
    hf_cfg.vocab_size, hf_cfg.n_positions = len(tok), max(2048, getattr(hf_cfg, "n_positions", 0))
    torch.manual_seed(0)
    hf = GPT2LMHeadModel(hf_cfg).eval()
    hf.generation_config.pad_token_id = tok.eos_token_id
    return Bench(hf=hf, tok=tok, model=models.Transformers(hf, tok), random_weights=True, counter=ForwardCounter(hf),
                 name=bench.name + " + ChatML specials")


def _template() -> str:
    path = FIXTURES / "chat_templates" / "qwen2.5-instruct.jinja"
    return path.read_text() if path.exists() else CHATML


def b16(bench: Bench, cfg) -> list[Row]:
    sessions, turns = _size(cfg, 16, 4, "b16_sessions"), _size(cfg, 4, 2, "b16_turns")
    user_len, new = _size(cfg, 48, 16, "b16_user"), _size(cfg, 32, 8, "b16_new")
    bench = _chat_bench(bench)
    template, model = _template(), bench.model
    gen = generate.text(model, samplers.greedy())
    text_c = continuous(gen)
    users = [[make_text(bench.tok, user_len, offset=97 * s + 31 * t) for t in range(turns)] for s in range(sessions)]
    log(f"B16: multi-turn chat, {sessions} sessions x {turns} turns, ~{user_len}-token user turns, {new}-token replies")

    def session(s: int) -> str:
        chat = Chat(model, "You are a helpful assistant.", template=template)
        for u in users[s]:
            chat = chat.user(u).reply(gen, max_tokens=new)
        messages: Any = chat.messages
        return messages[-1]["content"]

    def lockstep() -> int:  # the same turns as list calls over the sessions' states (ChatML text)
        states: Any = None
        for t in range(turns):
            if states is None:
                inputs = [Chat(model, "You are a helpful assistant.", template=template).user(users[s][0]).render()
                          for s in range(sessions)]
            else:
                inputs = [states[s, :] + f"<|im_end|>\n<|im_start|>user\n{users[s][t]}<|im_end|>\n<|im_start|>assistant\n"
                          for s in range(sessions)]
            states = text_c(inputs, max_tokens=new, stop_at="<|im_end|>")
        return sessions * turns * new

    session(0)
    calls = _compare(bench, {
        "sequential": lambda: [session(s) for s in range(sessions)] and sessions * turns * new,
        "lockstep": lockstep,
        "run_batch": lambda: continuum.run_batch(session, range(sessions), concurrency=sessions) and sessions * turns * new,
    }, _reps(cfg))
    return _rows("B16", f"chat {sessions} sessions x {turns} turns", sessions, calls, {"sequential": 1.5, "lockstep": 0.85},
                 {"sequential": "sessions one after another", "lockstep": "lockstep list calls"},
                 [f"template: {len(template)} chars"])


# ---------------------------------------------------------------------------------------------- B17
def b17(bench: Bench, cfg) -> list[Row]:
    n, levels, new = _size(cfg, 8, 3, "b17_n"), _size(cfg, 3, 2, "b17_levels"), _size(cfg, 16, 8, "b17_new")
    model = bench.model
    fork = continuous(generate.text(model, samplers.multinomial(3)))
    questions = [_words(30, 13 * i) + "?" for i in range(n)]
    log(f"B17: tree of thought, fork 3 at each of {levels} levels, {new}-token thoughts, {n} instances")

    def program(i: int) -> list[str]:
        rng = torch.Generator().manual_seed(i)
        prompt = (f"<|im_start|>system\nThink step by step.<|im_end|>\n<|im_start|>user\n{questions[i]}<|im_end|>\n"
                  f"<|im_start|>assistant\nLet us think.")
        frontier: list[Any] = [fork(prompt, max_tokens=new, rng=rng)]
        for _ in range(levels - 1):
            nxt: list[Any] = []
            for s in frontier:  # each branch forks 3 ways again
                for k in range(s.samples):
                    nxt.append(fork(s[:, k, :] + "\nNext:", max_tokens=new, rng=rng))
            frontier = nxt
        return [t for s in frontier for t in s.last_text]

    program(0)
    thoughts = sum(3 ** k for k in range(1, levels + 1))
    calls = _compare(bench, {
        "sequential": lambda: [program(i) for i in range(n)] and n * thoughts * new,
        "run_batch": lambda: continuum.run_batch(program, range(n), concurrency=n) and n * thoughts * new,
    }, _reps(cfg))
    return _rows("B17", f"tree of thought x{n}", n, calls, {"sequential": 1.5}, {"sequential": "instances one after another"},
                 [f"{thoughts} thoughts per instance in {1 + sum(3 ** k for k in range(1, levels))} forking calls"])


# ---------------------------------------------------------------------------------------------- B18
def b18(bench: Bench, cfg) -> list[Row]:
    n, prefix_len = _size(cfg, 32, 4, "b18_n"), _size(cfg, 400, 400, "b18_prefix")
    model = models.Transformers(bench.hf, bench.model.tokenizer, prefix_cache="1GiB")
    bench = Bench(hf=bench.hf, tok=bench.tok, model=model, name=bench.name, random_weights=bench.random_weights,
                  counter=bench.counter, force_length=bench.force_length)
    shots = make_text(bench.tok, prefix_len, offset=5)
    endings = [" and then it rained.", " so they went home.", " but nobody came.", " until the ship returned."]
    pick = generate.choice(model, endings, samplers.greedy())
    prompts = [f"{shots}\n\nQuestion {i}: {_words(12 + i % 9, 7 * i)}\nAnswer:" for i in range(n)]
    log(f"B18: select, shared {prefix_len}-token few-shot prefix, 4 endings, {n} instances, prefix cache on")

    def fresh(fn):  # every variant starts from an empty prefix cache: each computes the shared prefix once
        def run():
            model.prefix_cache.clear()
            fn()
            return n
        return run

    pick(prompts[0])
    calls = _compare(bench, {
        "sequential": fresh(lambda: [pick(p) for p in prompts]),
        "list call": fresh(lambda: pick(prompts)),
        "run_batch": fresh(lambda: continuum.run_batch(pick, prompts, concurrency=n)),
    }, _reps(cfg))
    rows = _rows("B18", f"select x{n} (prefix cache)", n, calls, {"sequential": 1.2},
                 {"sequential": "sequential with the prefix cache", "list call": "one list call"}, [])
    seq, lst = calls["sequential"], calls["list call"]
    rows.append(row_from_calls("B18b", "select: one list call vs sequential", "sequential with the prefix cache", seq, lst,
                               op=">=", threshold=1.0, speedup=True, unit="x programs/s"))
    return rows


# ---------------------------------------------------------------------------------------------- B19
DIMENSIONS = ["clarity", "accuracy", "originality", "structure", "style", "relevance"]


def b19(bench: Bench, cfg) -> list[Row]:
    n, article_len = _size(cfg, 8, 3, "b19_n"), _size(cfg, 300, 150, "b19_article")
    new = _size(cfg, 24, 8, "b19_new")
    model = bench.model
    text_c = continuous(generate.text(model, samplers.greedy()))
    articles = [make_text(bench.tok, article_len, offset=41 * i) for i in range(n)]
    log(f"B19: judge, {article_len}-token article, fork {len(DIMENSIONS)} judgements of {new} tokens, merge, verdict, "
        f"{n} instances")

    def program(i: int) -> str:
        article = text_c(articles[i], max_tokens=0)  # prefilled once, shared by the forks
        judged = text_c([article + f"\nJudge the {d} of the article:" for d in DIMENSIONS], max_tokens=new)  # the fork
        merged = article + "\n" + "\n".join(f"{d}: {j}" for d, j in zip(DIMENSIONS, judged.last_text)) + "\nVerdict:"
        return text_c(merged, max_tokens=2).last_text

    program(0)
    calls = _compare(bench, {
        "sequential": lambda: [program(i) for i in range(n)] and n * (len(DIMENSIONS) * new + 2),
        "run_batch": lambda: continuum.run_batch(program, range(n), concurrency=n) and n * (len(DIMENSIONS) * new + 2),
    }, _reps(cfg))
    return _rows("B19", f"judge x{n}", n, calls, {"sequential": 1.4}, {"sequential": "instances one after another"},
                 ["the fork is one list call inside each program"])


# ---------------------------------------------------------------------------------------------- B20
FIELDS = [('\n{"name": "', r'[A-Z][a-z]{2,8}'), ('", "age": ', r'[1-9][0-9]?'), (', "city": "', r'[A-Z][a-z]{2,8}'),
          ('", "year": ', r'(19|20)[0-9]{2}'), (', "member": ', r'(true|false)')]


def b20(bench: Bench, cfg) -> list[Row]:
    n, doc_len = _size(cfg, 16, 4, "b20_n"), _size(cfg, 300, 150, "b20_doc")
    model = bench.model
    regexes = [continuous(generate.regex(model, pattern, samplers.greedy())) for _, pattern in FIELDS]
    docs = [make_text(bench.tok, doc_len, offset=53 * i) + "\nExtract the record as JSON." for i in range(n)]
    log(f"B20: regex chain, {doc_len}-token document, {len(FIELDS)} chained regex fields, {n} instances")

    def chain(inputs):  # a document, or the list of all documents (lockstep): the same chain
        s = None
        for (lead, _), regex in zip(FIELDS, regexes):
            if s is None:
                s = regex([x + lead for x in inputs] if isinstance(inputs, list) else inputs + lead, max_tokens=8)
            else:
                s = regex(s + lead, max_tokens=8)
        return s.value

    chain(docs[0])
    tokens = n * len(FIELDS) * 4
    calls = _compare(bench, {
        "sequential": lambda: [chain(d) for d in docs] and tokens,
        "lockstep": lambda: chain(docs) and tokens,
        "run_batch": lambda: continuum.run_batch(chain, docs, concurrency=n) and tokens,
    }, _reps(cfg))
    return _rows("B20", f"regex chain x{n}", n, calls, {"sequential": 1.5, "lockstep": 0.85},
                 {"sequential": "instances one after another", "lockstep": "lockstep list calls"}, [])


PROGRAM_SCENARIOS = {"B15": b15, "B16": b16, "B17": b17, "B18": b18, "B19": b19, "B20": b20}
