"""lm-eval itself against ``continuum serve`` (issue 31, section 4): its ``local-completions`` model scores a
20-question multiple-choice task from the server's echoed prompt log-probs, and each option's
log-likelihood and the accuracy equal the library's exact choice scoring (``generate.choice``).

Served model: the real stories260K when the fixture is present (a Llama tokenizer that adds BOS), else the
shared tiny model. The task (examples/lmeval_task.py) is a local JSONL file written in ``tmp_path``.
Skipped without lm-eval (``pip install "lm-eval[api]"``: docs/serve.md)."""

from __future__ import annotations

import importlib.util

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
evaluator = pytest.importorskip("lm_eval.evaluator")
lm_eval_tasks = pytest.importorskip("lm_eval.tasks")
pytest.importorskip("tenacity")  # lm-eval's API models need its "api" extra

from conftest import FIXTURES  # noqa: E402
from serve_support import ROOT, Server, shared_model_dir  # noqa: E402

STORIES = FIXTURES / "models" / "stories260K"


def _task_module():
    spec = importlib.util.spec_from_file_location("lmeval_task", ROOT / "examples" / "lmeval_task.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(model folder, server) for stories260K, or the shared tiny model without the fixture."""
    model_dir = str(STORIES) if STORIES.exists() else shared_model_dir(tmp_path_factory)
    server = Server(model_dir, tmp_path_factory.mktemp("lmeval") / "store")
    yield model_dir, server
    server.stop()


def test_lmeval_local_completions_equals_library_scoring(served, tmp_path):
    """lm-eval's real loglikelihood path (``simple_evaluate`` with ``local-completions``, token-id
    requests, its own tokenizer and its own slicing of ``echo`` log-probs) gives, per option, the
    library's exact choice score within 1e-4, the same pick on every question, and the same accuracy."""
    from transformers import AutoTokenizer

    from continuum import models

    model_dir, server = served
    task = _task_module()
    folder = task.write(tmp_path / "task", cache_dir=tmp_path / "datasets")
    tok = AutoTokenizer.from_pretrained(model_dir)
    adds_bos = tok.bos_token_id is not None and tok("a").input_ids[:1] == [tok.bos_token_id]
    out = evaluator.simple_evaluate(
        model="local-completions",
        model_args={"model": "tiny", "base_url": f"{server.url}/completions", "tokenizer_backend": "huggingface",
                    "tokenizer": model_dir, "add_bos_token": adds_bos, "max_retries": 1},
        tasks=[task.NAME], task_manager=lm_eval_tasks.TaskManager(include_path=str(folder), include_defaults=False),
        log_samples=True, bootstrap_iters=0,
        random_seed=None, numpy_random_seed=None, torch_random_seed=None, fewshot_random_seed=None)  # (global RNGs untouched)
    samples = out["samples"][task.NAME]
    assert len(samples) == 20
    # lm-eval's continuation tokens (its whole encoding past the context's) are the library's option tokens
    lib = models.transformers(model_dir)
    for s in samples:
        for c in s["doc"]["choices"]:
            ctx, whole = tok(s["doc"]["context"]).input_ids, tok(s["doc"]["context"] + " " + c).input_ids
            assert whole[:len(ctx)] == ctx and whole[len(ctx):] == lib.tokenizer.encode_continuation(" " + c)
    got = task.compare(samples, lib)
    assert got["max_abs_diff"] < 1e-4
    assert got["same_pick"] == 20
    assert out["results"][task.NAME]["acc,none"] == got["acc_lmeval"] == got["acc_library"]
    if model_dir == str(STORIES):  # docs/serve.md's figure; without prompt log-probs lm-eval got 0.25
        assert got["acc_library"] == 0.8
