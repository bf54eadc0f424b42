"""Benchmark B21: ``continuum serve`` under concurrent clients, stateful vs stateless vs in-process.

N clients (the official ``openai`` client, one thread each; 16, quick mode 4) hold a 4-turn
conversation each: a first user message carrying a document (~500 tokens; quick ~250), then short
questions, ``new`` generated tokens per reply (greedy). The same conversations run three ways:

* **stateful**: ``/v1/responses`` with ``previous_response_id`` (the server continues the stored state);
* **stateless**: ``/v1/chat/completions`` with the whole history every turn, on the same server
  (prefix cache off, the default);
* **in-process**: the library, one ``Chat`` per client thread, in this process.

Figures: B21a the turn-4 time to first token (first streamed text), stateless / stateful, median
over the clients (target >= 3x); B21b aggregate generated tokens/s, stateful / stateless (target >= 1);
B21c wall time per generated token, stateful server / in-process: the HTTP overhead (target <= 1.15).
The model is B12's (GPT-2-small shape with ChatML special tokens, SmolLM2's template), saved to a
temporary folder and served by a ``python -m continuum serve`` subprocess.
"""

from __future__ import annotations

import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .chat_bench import chat_bench_model, smollm2_template
from .model import Bench, make_text
from .results import Row, Skip, log
from .serving import free_port, in_threads, wait_healthy

__all__ = ["b21"]

ROOT = Path(__file__).resolve().parents[1]
TURNS = 4


def _start_server(folder: str, store: str, threads: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen([sys.executable, "-m", "continuum", "serve", folder, "--port", str(port), "--store", store,
                             "--served-model-name", "bench", "--log-level", "warning"], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    wait_healthy(proc, f"http://127.0.0.1:{port}", "the server")
    return proc, f"http://127.0.0.1:{port}/v1"


def _stateful(client, users: list[str], new: int) -> list[dict]:
    prev, turns = None, []
    for u in users:
        t0, ttft = time.perf_counter(), None
        stream = client.responses.create(model="bench", input=u, previous_response_id=prev, max_output_tokens=new,
                                         temperature=0, stream=True)
        for ev in stream:
            if ev.type == "response.output_text.delta" and ttft is None:
                ttft = time.perf_counter() - t0
            if ev.type == "response.completed":
                final = ev.response
        prev = final.id
        turns.append({"ttft": ttft, "text": final.output_text, "tokens": final.usage.output_tokens,
                      "cached": final.usage.input_tokens_details.cached_tokens, "id": final.id})
    return turns


def _part_bytes(store: str, runs: list[list[dict]]) -> list[list[int]]:
    """Bytes of state each stored response wrote (its part), per client and turn: the size of its
    ``states/<id>.safetensors`` in the store (the layout docs/serve.md describes)."""
    def size(rid: str) -> int:
        path = os.path.join(store, "states", f"{rid}.safetensors")
        return os.path.getsize(path) if os.path.exists(path) else 0

    return [[size(t["id"]) for t in run] for run in runs]


def _stateless(client, users: list[str], new: int) -> list[dict]:
    history: list[dict] = []
    turns = []
    for u in users:
        history.append({"role": "user", "content": u})
        t0, ttft, text, tokens = time.perf_counter(), None, "", 0
        stream = client.chat.completions.create(model="bench", messages=history, max_tokens=new, temperature=0, stream=True,
                                                stream_options={"include_usage": True})
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                ttft = ttft if ttft is not None else time.perf_counter() - t0
                text += chunk.choices[0].delta.content
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        history.append({"role": "assistant", "content": text})
        turns.append({"ttft": ttft, "text": text, "tokens": tokens})
    return turns


def _generated(state) -> int:
    lps = state.token_logprobs[0][state.attention_masks[0].bool()].tolist()
    n = 0
    for x in reversed(lps):
        if math.isnan(x):  # a prompt token
            break
        n += 1
    return n


def _in_process(model, template: str, users: list[str], new: int) -> list[dict]:
    from continuum import generate, samplers
    from continuum.chat import Chat

    gen, c, turns = generate.text(model, samplers.greedy()), Chat(model, template=template), []
    for u in users:
        t0, ttft = time.perf_counter(), None
        stream = c.user(u).stream_reply(gen, max_tokens=new)
        for _ in stream:
            ttft = ttft if ttft is not None else time.perf_counter() - t0
        c = stream.chat
        last = c.messages[-1]
        assert isinstance(last, dict) and c.state is not None
        turns.append({"ttft": ttft, "text": last["content"], "tokens": _generated(c.state)})
    return turns


def _engine_stats(url: str) -> dict:
    """The server's engine counters (``GET /health``)."""
    import json
    import urllib.request

    with urllib.request.urlopen(url.removesuffix("/v1") + "/health", timeout=30) as r:
        return json.loads(r.read()).get("engine", {})


def _step_share(before: dict, after: dict) -> str:
    """Where the server's merged steps spent their time during the stateful phase (the engine's counters)."""
    d = {k: after.get(k, 0) - before.get(k, 0) for k in ("steps", "busy_s", "forward_s", "merged_forwards")}
    if not d["busy_s"]:
        return "engine: no step counted"
    return (f"engine (stateful phase): {d['steps']:.0f} steps, {d['merged_forwards']:.0f} merged forwards, busy "
            f"{d['busy_s']:.1f} s of which forwards {d['forward_s']:.1f} s: outside the forward "
            f"{1 - d['forward_s'] / d['busy_s']:.1%} of a step (target <= 15%); peak rows {after.get('peak_rows', 0)}")


def b21(bench: Bench, cfg) -> list[Row]:
    import importlib.util

    missing = [m for m in ("openai", "httpx", "fastapi", "uvicorn") if importlib.util.find_spec(m) is None]
    if missing:
        raise Skip(f"needs {', '.join(missing)} (the server and its client): pip install -e '.[test]'")
    import openai
    import torch

    bench = chat_bench_model(bench)
    clients = getattr(cfg, "clients", None) or (4 if cfg.quick else 16)
    new = getattr(cfg, "b21_new", 8 if cfg.quick else 16)
    doc = getattr(cfg, "b21_doc", 250 if cfg.quick else 500)
    tpl, tok, hf = smollm2_template(), bench.tok, bench.hf
    assert hasattr(tok, "save_pretrained") and hasattr(hf, "save_pretrained")
    convos = [[f"Read this and answer my questions.\n{make_text(tok, doc, offset=17 * i)}"]
              + [f"Question {t} of client {i}: {make_text(tok, 12, offset=41 * (i + t))}" for t in range(1, TURNS)]
              for i in range(clients)]
    log(f"B21: {clients} concurrent clients x {TURNS} turns, ~{doc}-token first message, {new} new tokens per reply; "
        f"model: {bench.name}")
    with tempfile.TemporaryDirectory() as tmp:
        folder = os.path.join(tmp, "model")
        tok.chat_template = tpl  # type: ignore[attr-defined]
        hf.save_pretrained(folder)
        tok.save_pretrained(folder)
        t0 = time.perf_counter()
        proc, url = _start_server(folder, os.path.join(tmp, "store"), torch.get_num_threads())
        log(f"    the server answered /health after {time.perf_counter() - t0:.1f} s")
        try:
            client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=600)
            _stateful(client, ["warm-up"], 2)
            _stateless(client, ["warm-up"], 2)
            before = _engine_stats(url)
            stateful, t_stateful = in_threads(clients, lambda i: _stateful(client, convos[i], new))
            step = _step_share(before, _engine_stats(url))
            written = _part_bytes(os.path.join(tmp, "store"), stateful)
            stateless, t_stateless = in_threads(clients, lambda i: _stateless(client, convos[i], new))
        finally:
            proc.terminate()
            proc.wait(30)
    _in_process(bench.model, tpl, ["warm-up"], 2)
    inproc, t_inproc = in_threads(clients, lambda i: _in_process(bench.model, tpl, convos[i], new))

    def tokens(runs):
        return sum(t["tokens"] for run in runs for t in run)

    ratios = [sl[-1]["ttft"] / sf[-1]["ttft"] for sf, sl in zip(stateful, stateless)]
    ttft_sf = statistics.median(r[-1]["ttft"] for r in stateful)
    ttft_sl = statistics.median(r[-1]["ttft"] for r in stateless)
    tps = {k: tokens(r) / t for k, r, t in (("stateful", stateful, t_stateful), ("stateless", stateless, t_stateless),
                                             ("in-process", inproc, t_inproc))}
    same = sum(a["text"] == b["text"] == c["text"] for ra, rb, rc in zip(stateful, stateless, inproc)
               for a, b, c in zip(ra, rb, rc))
    cached = [r[-1]["cached"] for r in stateful]
    notes = [(f"turn-4 TTFT median: stateless {ttft_sl * 1e3:.0f} ms, stateful {ttft_sf * 1e3:.0f} ms; per-client ratios "
              f"{', '.join(f'{x:.1f}' for x in ratios)}"),
             f"turn-4 cached_tokens (stateful): {min(cached)}-{max(cached)}",
             ("state bytes written per turn (median over clients, MB): "
              + ", ".join(f"t{t + 1} {statistics.median(w[t] for w in written) / 1e6:.2f}" for t in range(TURNS))
              + "; the whole state at each turn (its chain: what a store without parts wrote) "
              + ", ".join(f"t{t + 1} {statistics.median(sum(w[:t + 1]) for w in written) / 1e6:.2f}" for t in range(TURNS))),
             f"replies equal across stateful / stateless / in-process: {same}/{clients * TURNS} (greedy)",
             step,
             (f"wall: stateful {t_stateful:.1f} s, stateless {t_stateless:.1f} s, in-process {t_inproc:.1f} s; "
              f"tokens/s {tps['stateful']:.1f} / {tps['stateless']:.1f} / {tps['in-process']:.1f}")]
    per_token_server, per_token_lib = t_stateful / max(tokens(stateful), 1), t_inproc / max(tokens(inproc), 1)
    series = {"title": "B21: time to first token per turn (median over clients)", "x": list(range(1, TURNS + 1)),
              "xlabel": "turn", "ylabel": "seconds",
              "lines": {name: [statistics.median(r[t]["ttft"] for r in runs) for t in range(TURNS)]
                        for name, runs in (("stateless /v1/chat/completions", stateless), ("stateful /v1/responses", stateful),
                                           ("in-process Chat", inproc))}}
    return [
        Row(id="B21a", title=f"serve: turn-4 TTFT, {clients} clients, stateless / stateful",
            baseline="stateless chat completions",
            figure=statistics.median(ratios), op=">=", threshold=3.0, unit="x faster", base_s=ttft_sl, cont_s=ttft_sf,
            reps=clients, notes=notes, series=series),
        Row(id="B21b", title="serve: aggregate tokens/s, stateful / stateless", baseline="stateless chat completions",
            figure=tps["stateful"] / tps["stateless"], op=">=", threshold=1.0, unit="x throughput", base_s=t_stateless,
            cont_s=t_stateful, base_tps=tps["stateless"], cont_tps=tps["stateful"], reps=1),
        Row(id="B21c", title="serve: time per generated token, server / in-process", baseline="the library in-process",
            figure=per_token_server / per_token_lib, op="<=", threshold=1.15, unit="x time", base_s=t_inproc, cont_s=t_stateful,
            base_tps=tps["in-process"], cont_tps=tps["stateful"], reps=1),
    ]
