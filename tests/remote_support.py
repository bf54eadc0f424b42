"""Shared pieces of the ``models.remote`` tests (``test_remote_programs.py``, ``test_remote_faults.py``): a real
``continuum serve`` of stories260K on loopback (two API keys, ``--state-memory 0``: every continuation loads its
handle's state from the store, as after a restart), the remote model on it, the local model (the same checkpoint,
transformers in this process), and :func:`same`, the comparison of a remote state with a local one.

A test module binds the fixtures to their names in its namespace (``server, remote, local = remote_support.server,
...``: pytest finds fixtures there); each module starts its own server (module scope).
"""

from __future__ import annotations

import os

import pytest
import torch

from conftest import FIXTURES

MODEL = str(FIXTURES / "models" / "stories260K")
KEYS = ("remote-key-a", "remote-key-b")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from benchmarks import replicas

    os.environ["CONTINUUM_REMOTE_CACHE"] = str(tmp_path_factory.mktemp("remote-tokenizers"))
    srv = replicas.Server(MODEL, tmp_path_factory.mktemp("remote") / "store", "--api-key", KEYS[0], "--api-key",
                          KEYS[1], "--state-memory", "0", name="stories260K", key=KEYS[0])
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def remote(server):
    from continuum import models

    return models.remote(server.base, api_key=KEYS[0])


@pytest.fixture(scope="module")
def local():
    from continuum import models

    return models.transformers(MODEL)


def same(a, b, values: bool = True) -> None:
    """Two states (remote, local) equal: ids, masks, texts, cached counts, weights and log-probs within 1e-4."""
    assert torch.equal(a.token_ids, b.token_ids)
    assert torch.equal(a.attention_masks, b.attention_masks)
    assert list(a) == list(b)
    assert torch.equal(a.cached_tokens, b.cached_tokens)
    assert torch.allclose(a.weights, b.weights, atol=1e-4)
    assert torch.allclose(a.token_logprobs, b.token_logprobs, atol=1e-4, equal_nan=True)
    if values:
        assert a.value == b.value
        assert a.finish_reasons == b.finish_reasons
