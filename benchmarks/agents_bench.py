"""B29: agent traffic, the workload stateful serving exists for (issue 57).

``AGENTS`` conversations of ``TURNS`` turns each, all at once. Every turn re-states a tool's output (a JSON record of
about 300 tokens) and asks for a short structured answer about it (``REPLY`` tokens at most, greedy):

* continuum: ``continuum serve --speculate lookup`` with the Responses API, each turn ``previous_response_id`` plus
  only the new message: the stored state holds the history, KV included, so nothing is re-prefilled and lookup
  drafts from the document the turn just added;
* the baseline: llama-server ``-np AGENTS`` on the same file, chat completions with the whole history each turn
  (its slot's cache is reused only where the prefix matches).

Both stream, so each turn's time to first token is measured from the request. The figure is the baseline's total
time over continuum's (>= 1.5x, issue 57); the notes give both totals and the median TTFT of the last turns.
llama-server is a C++ build (see ``server_pool_bench``): the scenario runs when ``LLAMA_SERVER`` names the binary,
else it is skipped (noted). The chat template is the fixture's ``gemma3.jinja`` for continuum and the GGUF's own for
llama-server (the same Gemma 3 template).
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

from .llamacpp_bench import gguf_bench
from .model import FIXTURES, Bench
from .results import Row, Skip, log
from .server_pool_bench import _llama_server, _stop

__all__ = ["b29", "AGENT_SCENARIOS"]

AGENTS, TURNS, REPLY = 16, 6, 40
SYSTEM = "You are an inventory agent. Answer with one JSON object and nothing else."


def tool_output(agent: int, turn: int) -> str:
    """A tool's JSON record, about 300 tokens on Gemma's tokenizer (distinct per agent and turn)."""
    items = [{"sku": f"A{agent:02d}-{turn}-{k}", "qty": (agent * 7 + turn * 3 + k) % 17, "price": round(1.25 * k + turn, 2),
              "warehouse": ["north", "south", "east"][k % 3], "note": "fragile, keep upright"} for k in range(9)]
    return json.dumps({"request": agent * 100 + turn, "status": "ok", "items": items})


def question(agent: int, turn: int) -> str:
    return (f"Tool result:\n{tool_output(agent, turn)}\nWhich item has the highest price? "
            'Reply as {"sku": ..., "price": ...}.')


def _stream_turn(create, **kw) -> tuple[float, float, str]:
    """One streamed turn: (seconds to the first text, total seconds, the response id or '')."""
    t0 = time.perf_counter()
    first, rid = None, ""
    for event in create(stream=True, **kw):
        kind = getattr(event, "type", None)
        if kind == "response.created":
            rid = event.response.id
        text = getattr(event, "delta", None) if kind else (event.choices[0].delta.content if event.choices else None)
        if text and first is None:
            first = time.perf_counter() - t0
    total = time.perf_counter() - t0
    return (first if first is not None else total), total, rid


def _run(url: str, stateful: bool) -> tuple[float, list[list[float]], int]:
    """Every conversation at once: (total seconds, TTFT per agent per turn, failures)."""
    from openai import OpenAI

    client = OpenAI(base_url=url, api_key="none", max_retries=0, timeout=1800)
    ttft = [[0.0] * TURNS for _ in range(AGENTS)]
    failed = [0]
    lock = threading.Lock()

    def agent(i: int) -> None:
        history = [{"role": "system", "content": SYSTEM}]
        previous = None
        try:
            for t in range(TURNS):
                if stateful:  # only the new message; the server continues its stored state
                    ttft[i][t], _, previous = _stream_turn(
                        client.responses.create, model="bench", input=question(i, t), max_output_tokens=REPLY,
                        temperature=0, previous_response_id=previous, instructions=SYSTEM)
                    # (instructions every turn: OpenAI's Responses API does not carry them over to the next
                    # response, so sent once the later turns would drop the system prompt, a different
                    # conversation from llama-server's, and render a history whose start no longer matches)
                else:  # the whole history each turn
                    history.append({"role": "user", "content": question(i, t)})
                    parts: list[str] = []

                    def create(**kw):
                        for chunk in client.chat.completions.create(**kw):
                            if chunk.choices and chunk.choices[0].delta.content:
                                parts.append(chunk.choices[0].delta.content)
                            yield chunk
                    ttft[i][t], _, _ = _stream_turn(create, model="bench", messages=history, max_tokens=REPLY,
                                                    temperature=0)
                    history.append({"role": "assistant", "content": "".join(parts)})
        except Exception as exc:  # noqa: BLE001  (counted: the figure is over answered conversations)
            log(f"B29: agent {i} failed: {exc!r}"[:300])
            with lock:
                failed[0] += 1

    threads = [threading.Thread(target=agent, args=(i,)) for i in range(AGENTS)]
    t0 = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return time.perf_counter() - t0, ttft, failed[0]


def b29(bench: Bench, cfg) -> list[Row]:
    if cfg.smoke or cfg.quick:
        raise Skip("agent traffic runs in full mode only (two servers, 96 turns each)")
    binary = os.environ.get("LLAMA_SERVER")
    if not binary or not os.path.exists(binary):
        raise Skip("set LLAMA_SERVER to a llama-server binary (see benchmarks/server_pool_bench.py)")
    try:
        import openai  # noqa: F401
    except ImportError as exc:
        raise Skip("the openai client is needed (pip install 'continuum[test]')") from exc
    from .replicas import Server

    _, path, name, threads = gguf_bench(cfg)
    template = Path(FIXTURES) / "chat_templates" / "gemma3.jinja"
    with tempfile.TemporaryDirectory() as tmp:
        srv = Server(str(path), Path(tmp) / "store", "--threads", str(threads), "--speculate", "lookup",
                     "--chat-template", str(template), "--n-ctx", str(AGENTS * 4096), name="bench")
        try:
            log(f"B29: continuum serve, {AGENTS} agents x {TURNS} turns")
            ours, ours_ttft, ours_failed = _run(srv.url, True)
        finally:
            srv.stop()
    proc, url = _llama_server(binary, str(path), threads, AGENTS, 4096)
    try:
        log(f"B29: llama-server -np {AGENTS}, {AGENTS} agents x {TURNS} turns")
        theirs, theirs_ttft, theirs_failed = _run(url, False)
    finally:
        _stop(proc)

    def last(ttft: list[list[float]]) -> float:
        return statistics.median(row[-1] for row in ttft)

    return [Row("B29", f"agent traffic: {AGENTS} conversations x {TURNS} turns (a ~300-token tool result each)",
                f"llama-server -np {AGENTS}, chat completions, whole history", theirs / ours, ">=", 1.5, "x (time)",
                base_s=theirs, cont_s=ours,
                notes=[f"model: {name}", f"continuum {ours:.1f} s ({ours_failed} failed), llama-server {theirs:.1f} s "
                       f"({theirs_failed} failed)", f"median TTFT of the last turn: continuum {last(ours_ttft):.2f} s, "
                       f"llama-server {last(theirs_ttft):.2f} s"])]


AGENT_SCENARIOS = {"B29": b29}
