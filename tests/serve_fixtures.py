"""The module-scoped fixtures every server test module shares: the tiny model's folder, ONE server on it
(``serve_support.shared_server``), an ``openai`` client, and the in-process model (the reference).
A test module imports them by name (pytest finds fixtures in a module's namespace)."""

from __future__ import annotations

import pytest

from serve_support import shared_model_dir, shared_server


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return shared_model_dir(tmp_path_factory)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    return shared_server(tmp_path_factory, model_dir)


@pytest.fixture(scope="module")
def client(server):
    return server.client()


@pytest.fixture(scope="module")
def lib(model_dir):
    from continuum import models

    return models.transformers(model_dir)
