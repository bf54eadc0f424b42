"""Long sessions (issue 11): 200 turns of continue / slice / add / fork on a tiny model, with memory
measured at checkpoints.

What is checked:

* dropping states frees their KV storage: weak references to the storages of dropped states die
  once nothing alive refers to them (storage accounting + ``gc``);
* nothing grows per turn: with the same number of states alive, the bytes of tensor storage
  reachable from them (counted once per storage), the bytes of every tensor the process holds
  outside the model's parameters, and the process RSS are flat between turn 50 and turn 200;
* no state's result changes when others are created or dropped: witness states made early are
  re-read at the end (texts, weights, next-token logits through their cache, a greedy continuation)
  and compared with the values recorded when they were made.

The figures are printed (``pytest -s tests/test_soak.py``) and quoted in docs/state.md
("Long sessions").
"""

from __future__ import annotations

import collections
import gc
import os
import random
import weakref

import pytest
import torch

from continuum import SequenceState, continuous, generate, samplers

from conftest import kv_layers, next_logits_via_cache

pytestmark = pytest.mark.slow

TURNS = 200
ALIVE = 8  # states kept alive besides the witnesses (the last ALIVE turns' results)
USER = ["Tell me more.", " And then?", " café crème", " 東京", " 🤗 ok", " The dog sleeps.", "\nNext: ", " 42 is", " naïve"]


# ---------------------------------------------------------------------------------- accounting
def state_tensors(state: SequenceState) -> list[torch.Tensor]:
    """Every tensor a state holds: token rows and, per layer, its KV views."""
    out = [state._ids, state._mask, state._logprobs, state._weights]
    for k, v in kv_layers(state):
        out += [k, v]
    return out


def view_bytes(t: torch.Tensor) -> int:
    """Bytes of storage a view spans (an ``expand``-ed dimension, stride 0, counts once)."""
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        n *= size if stride else min(size, 1)
    return n * t.element_size()


def storage_bytes(tensors) -> tuple[int, int]:
    """(bytes of the distinct storages behind ``tensors``, bytes the tensors themselves cover).

    The second figure is what the views need; the difference is preallocated room (KV arenas) and
    storage pinned by views of larger tensors.
    """
    storages, views = {}, {}
    for t in tensors:
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
        views.setdefault(s.data_ptr(), {})[(t.data_ptr(), tuple(t.shape), tuple(t.stride()))] = view_bytes(t)
    return sum(storages.values()), sum(min(storages[p], sum(v.values())) for p, v in views.items())


def reachable_bytes(states) -> tuple[int, int]:
    return storage_bytes([t for s in states for t in state_tensors(s)])


def process_tensor_bytes(exclude: set[int]) -> tuple[int, int]:
    """(number of tensors, bytes of distinct storages) of every tensor ``gc`` can see, but ``exclude``'s storages."""
    gc.collect()
    seen, count = {}, 0
    for obj in gc.get_objects():
        try:
            if not issubclass(type(obj), torch.Tensor):  # type(): isinstance would touch lazy modules' __class__
                continue
            s = obj.untyped_storage()
        except Exception:  # noqa: BLE001 - meta/fake tensors, objects that refuse isinstance
            continue
        if s.data_ptr() in exclude:
            continue
        count += 1
        seen[s.data_ptr()] = s.nbytes()
    return count, sum(seen.values())


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def parameter_storages(model) -> set[int]:
    return {p.untyped_storage().data_ptr() for p in model.model.parameters()} | {
        b.untyped_storage().data_ptr() for b in model.model.buffers()}


# ---------------------------------------------------------------------------------- witnesses
class Witness:
    """A state and what it read when it was made; :meth:`check` re-reads it."""

    def __init__(self, state: SequenceState, greedy):
        self.state = state
        self.texts = list(state)
        self.weights = state.weights.clone()
        self.ids = state.token_ids.clone()
        self.logits = next_logits_via_cache(state)
        self.greedy = greedy
        self.continued = list(greedy(state, max_tokens=4))

    def check(self) -> None:
        s = self.state
        assert list(s) == self.texts
        assert torch.equal(s.weights, self.weights)
        assert torch.equal(s.token_ids, self.ids)
        torch.testing.assert_close(next_logits_via_cache(s), self.logits, atol=1e-6, rtol=0)
        assert list(self.greedy(s, max_tokens=4)) == self.continued


# ---------------------------------------------------------------------------------- the session
class Session:
    """A deterministic chat-like loop over one model, keeping the last ``ALIVE`` states."""

    def __init__(self, model, seed: int = 0):
        self.model = model
        self.rand = random.Random(seed)
        self.greedy = continuous(generate.text(model, samplers.greedy()))
        self.fork3 = continuous(generate.text(model, samplers.multinomial(3)))
        self.beam2 = continuous(generate.text(model, samplers.beam_search(2)))
        self.alive: collections.deque[SequenceState] = collections.deque(maxlen=ALIVE)
        self.state = self.greedy("Once upon a time", max_tokens=8)
        self.ops = collections.Counter()

    def tokens(self, state: SequenceState) -> int:
        return int(state.attention_masks.sum(1).max())

    def turn(self, i: int) -> SequenceState:
        s, r = self.state, self.rand
        if self.tokens(s) > 150:  # keep the session inside the tiny model's 256 positions
            op = r.choice(["window", "truncate"])
        else:
            op = r.choice(["continue", "continue", "fork", "beam", "truncate", "add_state", "stack"])
        self.ops[op] += 1
        rng = torch.Generator().manual_seed(i)
        if op == "continue":
            s = self.greedy(s + r.choice(USER), max_tokens=r.randint(1, 10))
        elif op == "fork":  # sample 3, keep the most likely
            f = self.fork3(s + r.choice(USER), max_tokens=r.randint(1, 6), rng=rng)
            self.alive.append(f)
            s = f[0, int(f.weights.argmax()), :]
        elif op == "beam":
            b = self.beam2(s, max_tokens=r.randint(1, 5))
            self.alive.append(b)
            s = b[0, 0, :]
        elif op == "truncate":  # back off a few characters: keeps the cache of what stays
            s = s[: max(1, len(str(s)) - r.randint(1, 12))]
        elif op == "window":  # keep the last characters: re-segmented, no cache
            s = s[-r.randint(60, 120):]
        elif op == "add_state":  # append an earlier state's head
            other = self.alive[0] if self.alive and self.alive[0].shape == (1, 1) else s
            s = s + other[:8]
        else:  # stack with the previous state, continue both, keep the first row
            prev = self.alive[-1] if self.alive and self.alive[-1].shape == (1, 1) else s
            both = self.greedy([s, prev], max_tokens=3)
            self.alive.append(both)
            s = both[0, :]
        self.alive.append(s)
        self.state = s
        return s


def token_rows(states) -> int:
    """Real tokens summed over every row of ``states`` (what their KV caches must at least cover)."""
    return sum(int(s._mask.sum()) for s in states)


@pytest.fixture
def frozen_gc():
    """Objects made before the test (the whole suite's, in one process) moved to gc's permanent generation: each
    ``gc.collect()``/``gc.get_objects()`` here then walks only what the session makes (the scans took most of this
    test's time in the full suite). Every tensor made during the test is still seen; older ones were only ever
    subtracted as the baseline."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


def test_long_session_memory_is_flat_and_states_unchanged(gpt2_model, frozen_gc):
    model = gpt2_model
    torch.set_num_threads(1)
    params = parameter_storages(model)
    baseline = process_tensor_bytes(params)
    session = Session(model)
    witnesses: list[Witness] = []
    figures: dict[int, dict] = {}
    dropped: list[weakref.ref] = []
    for i in range(1, TURNS + 1):
        before = {t.untyped_storage().data_ptr(): t.untyped_storage() for s in session.alive for t in state_tensors(s)}
        s = session.turn(i)
        if i in (5, 17, 33):
            witnesses.append(Witness(s, session.greedy))
        if i % 25 == 0:
            # the storages of states that just left the window must die unless something alive holds them
            live = {t.untyped_storage().data_ptr()
                    for x in [*session.alive, *(w.state for w in witnesses)] for t in state_tensors(x)}
            dropped += [weakref.ref(st) for ptr, st in before.items() if ptr not in live]
        del before
        if i % 25 == 0 and i >= 50:
            gc.collect()
            states = [*session.alive, *(w.state for w in witnesses)]
            held, needed = reachable_bytes(states)
            n_tensors, all_bytes = process_tensor_bytes(params)
            n_tensors, all_bytes = n_tensors - baseline[0], all_bytes - baseline[1]  # other tests' tensors
            figures[i] = dict(states=len(states), held=held, needed=needed, tensors=n_tensors, all=all_bytes, rss=rss_bytes(),
                              tokens=token_rows(states))
    gc.collect()
    leaked = [w for w in dropped if w() is not None]
    for w in witnesses:  # nothing that happened since changed what they read
        w.check()
    session_ops = dict(session.ops)
    del s, w, states, witnesses, session
    after = process_tensor_bytes(params)

    print(f"\nsoak: {TURNS} turns on a tiny {type(model.model).__name__}, ops {dict(session_ops)}")
    print(" turn states token-rows held(KiB) needed(KiB) held/token-row(B) tensors* all-tensors*(KiB) RSS(MiB)")
    for i, f in figures.items():
        print(f" {i:4d} {f['states']:6d} {f['tokens']:10d} {f['held'] / 1024:9.1f} {f['needed'] / 1024:11.1f} "
              f"{f['held'] / f['tokens']:17.0f} {f['tensors']:7d} {f['all'] / 1024:16.1f} {f['rss'] / 2**20:8.1f}")
    print(" *: every tensor in the process but the model's parameters, minus those alive before the session")
    print(f" storages of dropped states still alive: {len(leaked)} of {len(dropped)}; tensors outside the model: "
          f"{after[0] - baseline[0]:+d} ({(after[1] - baseline[1]) / 1024:+.1f} KiB) after dropping the session")

    assert not leaked, f"{len(leaked)} storages of dropped states are still alive"
    assert after[1] <= baseline[1], "dropping every state of the session must free all its tensors"
    assert len({f["states"] for f in figures.values()}) == 1
    first, last = figures[50], figures[TURNS]
    per_token = {i: f["held"] / f["tokens"] for i, f in figures.items()}
    # the same number of states alive holds bytes in proportion to their tokens, whatever the turn
    assert max(per_token.values()) <= 1.5 * per_token[50], per_token
    assert max(f["all"] - f["held"] for f in figures.values()) <= 64 * 1024, "tensors outside the live states"
    assert last["tensors"] <= first["tensors"] + 4 * ALIVE * 20, (first, last)  # per-state tensors, not per turn
    assert last["rss"] - first["rss"] < 64 * 2**20, (first["rss"], last["rss"])
