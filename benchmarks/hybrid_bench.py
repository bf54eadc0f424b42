"""B27: a multi-turn chat on a hybrid model (the tiny LFM2 fixture: convolutions + attention), states by snapshots.

The model: ``../shared/fixtures/models/lfm2-tiny`` (random weights, 4 layers, 512 positions; skipped when absent).
Replies are greedy under a regex of lowercase words (the random model's free text is invalid UTF-8, which a chat
re-renders canonically: every turn would then recompute from the first reply, on any model). A short
template (``u:`` / ``a:`` lines before each message): the fixture's 512-token vocabulary spells ChatML's markers in many tokens.

* B27a: an 8-turn chat (``continuum.chat.Chat``): positions computed over all turns, against re-running the whole
  history every turn (what a stateless loop computes: the rendered prompt and the reply); target <= 0.5x. The
  series gives both per turn.
* B27b / B27c: the final state sliced back 1 / 3 turns (to where an earlier reply ended: an end snapshot) and
  continued with a new user turn: positions computed over the positions after the cut's cached ones (appended +
  generated); at most 1.0 when nothing before the cut is recomputed (target <= 1.0).
* B27d: the recurrent snapshots' bytes at the last turn over the attention KV's bytes (target <= 0.5x); the notes
  give both per turn (the policy bounds the snapshots: docs/hybrid.md).
"""

from __future__ import annotations

import time

from .model import FIXTURES, Bench
from .results import Row, Skip, log

__all__ = ["HYBRID_SCENARIOS"]

LFM2 = FIXTURES / "models" / "lfm2-tiny"
TEMPLATE = ("{% for message in messages %}{{ message['role'][0] + ':\\n' + message['content'] + '\\n' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ 'a:\\n' }}{% endif %}")  # (short: the fixture's vocabulary has 512 tokens)
USERS = ["Tell me about the dog in the park", "What did the cat say to the bird", "Where is the little red ship",
         "Why was the king so sad today", "Who lives in the tall old tree", "How did the girl find the key",
         "When will the rain stop at last", "What is the name of the boy", "Which way to the sea"]
REPLY = r"[a-z]{1,4}( [a-z]{1,4}){1,3}\."


def b27(bench: Bench, cfg) -> list[Row]:
    if not (LFM2 / "config.json").exists():
        raise Skip(f"no lfm2-tiny fixture at {LFM2}")
    from continuum import continuous, generate, models, samplers
    from continuum.chat import Chat

    model = models.transformers(str(LFM2))
    turns = 3 if cfg.smoke else 8
    new = 4 if cfg.smoke else 16
    reply = generate.regex(model, REPLY, samplers.greedy())
    log(f"B27: {turns}-turn chat on lfm2-tiny (hybrid: convolutions + attention), replies <= {new} tokens")
    chat, states, ours, stateless, snap_bytes, attn_bytes = Chat(model, template=TEMPLATE), [], [], [], [], []
    t0 = time.perf_counter()
    for t in range(turns):
        chat = chat.user(USERS[t])
        before = model.tokens_computed
        chat = chat.reply(reply, max_tokens=new)
        ours.append(model.tokens_computed - before)
        state = chat.state
        # a stateless loop re-renders the history and computes all of it: the prompt, then each reply token but the last
        stateless.append(len(state._real_rows()[0][0]) - 1)
        states.append(state)
        snap_bytes.append(state._kv.snapshot_bytes())
        attn_bytes.append(state._kv.nbytes() - snap_bytes[-1])
    took = time.perf_counter() - t0
    rows = [Row("B27a", f"{turns}-turn chat on a hybrid model (LFM2): positions computed", "re-running the history",
                figure=sum(ours) / sum(stateless), op="<=", threshold=0.5, unit="x positions", cont_s=took,
                base_computed=sum(stateless), cont_computed=sum(ours), reps=1,
                notes=[f"per turn, continuum {ours}, re-running the history {stateless}"],
                series={"title": "B27a: positions computed per turn (LFM2)", "x": list(range(1, turns + 1)),
                        "xlabel": "turn", "ylabel": "positions", "lines": {"continuum": ours, "re-run": stateless}})]
    text = continuous(generate.regex(model, REPLY, samplers.greedy()))
    final = states[-1]
    for back, rid in ((1, "B27b"), (min(3, turns - 1), "B27c")):
        at = states[-1 - back]
        cut = final[:len(list(at)[0])]
        appended = cut + "\nu:\nAnd then?\na:\n"
        before, t = model.tokens_computed, time.perf_counter()
        out = text(appended, max_tokens=new)
        took = time.perf_counter() - t
        computed = model.tokens_computed - before
        after_cut = len(out._real_rows()[0][0]) - int(cut.cached_tokens)  # every position after the cached ones
        rows.append(Row(rid, f"slice the chat back {back} turn(s) and continue", "positions after the cut",
                        figure=computed / after_cut, op="<=", threshold=1.0, unit="x positions", cont_s=took,
                        base_computed=after_cut, cont_computed=computed, reps=1,
                        notes=[f"cut at {int(cut.cached_tokens)} cached tokens (the end of turn {turns - back}); "
                               f"a stateless loop computes {len(out._real_rows()[0][0]) - 1}"]))
    rows.append(Row("B27d", "recurrent snapshots' memory at the last turn", "attention KV bytes",
                    figure=snap_bytes[-1] / attn_bytes[-1], op="<=", threshold=0.5, unit="x memory", reps=1,
                    notes=[f"snapshot bytes per turn {snap_bytes}", f"attention KV bytes per turn {attn_bytes}"]))
    return rows


HYBRID_SCENARIOS = {"B27": b27}
