"""Support for the server tests: a tiny model folder with a chat template, and a real server process.

The server runs as ``python -m continuum serve <folder>`` on a free local port (``PYTHONPATH`` = this
repository, so this worktree's ``continuum`` is the one served); tests talk to it with the official
``openai`` client.
"""

from __future__ import annotations

import atexit
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

from benchmarks import replicas

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = "qwen2.5-instruct.jinja"  # renders tools and <tool_call> blocks
# A ChatML template with tools, used when the fixtures are absent (a clone without ../shared/fixtures)
CHATML_TOOLS = """{%- if tools %}<|im_start|>system
Tools: {{ tools | tojson }}<|im_end|>
{% endif %}
{%- for m in messages %}<|im_start|>{{ m.role }}
{%- if m.tool_calls %}{% for c in m.tool_calls %}
<tool_call>
{{ {"name": c.function.name, "arguments": c.function.arguments} | tojson }}
</tool_call>{% endfor %}{% else %}
{{ m.content }}{% endif %}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def make_model_dir(path: Path, template_path: Path | None) -> str:
    """A tiny random Llama over a trained byte-level BPE with ChatML special tokens and a chat template
    (the fixture's, or :data:`CHATML_TOOLS` without one)."""
    from conftest import _sharpen, make_bpe_tokenizer, tiny_llama

    tok = make_bpe_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = template_path.read_text() if template_path is not None and template_path.exists() else CHATML_TOOLS
    hf = _sharpen(tiny_llama(len(tok), bos=tok.bos_token_id, eos=tok.eos_token_id, max_positions=2048))
    hf.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


_MODEL_DIRS: dict[str, str] = {}


def shared_model_dir(tmp_path_factory) -> str:
    """One model folder per test session (both server test modules serve the same one)."""
    if "dir" not in _MODEL_DIRS:
        from conftest import FIXTURES

        _MODEL_DIRS["dir"] = make_model_dir(tmp_path_factory.mktemp("serve-model"), FIXTURES / "chat_templates" / TEMPLATE)
    return _MODEL_DIRS["dir"]


KEYS = ("key-alice", "key-bob")
_SERVERS: dict[str, Server] = {}


def shared_server(tmp_path_factory, model_dir: str) -> Server:
    """One server per test session, shared by the server test modules: two API keys, and no state kept
    in memory (``--state-memory 0``), so every continuation loads its state from the store."""
    if "server" not in _SERVERS:
        server = Server(model_dir, tmp_path_factory.mktemp("serve") / "store", "--api-key", KEYS[0], "--api-key", KEYS[1],
                        "--state-memory", "0")
        atexit.register(server.stop)
        _SERVERS["server"] = server
    return _SERVERS["server"]


class Server(replicas.Server):
    """``continuum serve`` of a test: served as ``tiny``, its client sending the first test key by default."""

    def __init__(self, model_dir: str, store: Path | str, *args: str, log: Path | None = None):
        super().__init__(model_dir, store, *args, log=log, name="tiny", key=KEYS[0])


start_servers = replicas.start_servers  # (replicas on one store, started at once)


class Pet(BaseModel):
    kind: Literal["cat", "dog", "fish"]
    age: int = Field(ge=0, le=20)


class Adopt(BaseModel):
    """Adopt a pet (a nested model: its schema has $defs and a $ref): the agent tests' tool argument."""

    pet: Pet
    indoor: bool



@contextmanager
def running(*makers: Callable[[], replicas.Server]) -> Iterator[list]:
    """Servers started together (``start_servers``), stopped when the block ends, and at exit if a test run dies."""
    servers = replicas.start_servers(*makers)
    for server in servers:
        atexit.register(server.stop)
    try:
        yield servers
    finally:
        for server in servers:
            server.stop()
