"""``continuum serve model.gguf``: a GGUF on llama.cpp behind the OpenAI-compatible server, driven by the official
``openai`` client against a real server process.

The server keeps no state in memory (``--state-memory 0``), so every continuation of a stored response reads the
state back from the store. The reference is the library in-process on the same file (``models.llamacpp``) in the
batch-invariant mode, where a reply is exactly what it gives alone.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

pytest.importorskip("llama_cpp")
pytest.importorskip("fastapi")
pytest.importorskip("openai")

from continuum import generate, models, samplers
from continuum.chat import Chat

from conftest import FIXTURES
from llamacpp_support import gguf
from serve_support import Server

MODEL = "tiny"


@pytest.fixture(scope="module")
def template():
    path = FIXTURES / "chat_templates" / "smollm2.jinja"
    if not path.exists():
        pytest.skip("chat template fixture not available")
    return path


@pytest.fixture(scope="module")
def server(tmp_path_factory, template):
    srv = Server(str(gguf("f32")), tmp_path_factory.mktemp("serve-gguf") / "store", "--chat-template", str(template),
                 "--threads", "2", "--batch-invariant")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return server.client()


@pytest.fixture(scope="module")
def lib(template):
    return models.llamacpp(gguf("f32"), n_threads=2, batch_invariant=True), template.read_text()


def _lib_turns(lib, turns: list[str], max_tokens: int) -> list[str]:
    model, template = lib
    gen = generate.text(model, samplers.greedy())
    c, out = Chat(model, template=template), []
    for u in turns:
        c = c.user(u).reply(gen, max_tokens=max_tokens)
        out.append(c.messages[-1]["content"])
    return out


def test_stateful_responses_continue_stored_sequences(client, lib):
    turns = ["Tell me about a cat.", "What did the cat do?", "And then?"]
    prev, outs, turns_ids = None, [], []
    for i, text in enumerate(turns):
        r = client.responses.create(model=MODEL, input=text, previous_response_id=prev, max_output_tokens=10, temperature=0)
        outs.append(r.output_text)
        cached = r.usage.input_tokens_details.cached_tokens
        assert (cached == 0) if i == 0 else (0 < cached < r.usage.input_tokens)  # the stored state, continued
        prev = r.id
        turns_ids.append(r.id)
    assert outs == _lib_turns(lib, turns, 10)
    fork = client.responses.create(model=MODEL, input="Was it a dog?", previous_response_id=turns_ids[1],
                                   max_output_tokens=10, temperature=0)  # a branch from an earlier stored turn
    assert fork.output_text == _lib_turns(lib, [*turns[:2], "Was it a dog?"], 10)[-1]
    assert client.responses.retrieve(prev).output_text == outs[-1]


def test_chat_completions_json_and_streaming(client):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "happy": {"type": "boolean"}},
              "required": ["name", "happy"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "cat", "schema": schema, "strict": True}}
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "The cat as JSON."}],
                                       max_tokens=60, temperature=0, response_format=fmt)
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    ref = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0, stream=True))
    assert streamed == ref.choices[0].text and ref.choices[0].text


def test_bad_gguf_options_are_refused_before_serving(tmp_path, capsys):
    from continuum.serve.cli import main

    for args, said in [([str(gguf("f32")), "--dtype", "bfloat16"], "--dtype"),
                       ([str(tmp_path / "missing.gguf")], "missing.gguf")]:
        assert main([*args, "--store", str(tmp_path / "s")]) == 2  # before anything listens
        err = capsys.readouterr().err
        assert said in err and "Traceback" not in err, err
