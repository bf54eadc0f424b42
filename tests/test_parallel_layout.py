"""Parallel layouts in one process: loading errors for ``tp_plan``, the layout in the model identity,
save/load across layouts, and ``device_map`` (each layer's KV cache on its layer's device).

What needs several processes (tensor parallelism under torchrun) is in ``test_distributed.py``.
"""

from __future__ import annotations

import pytest
import torch

from continuum import ContinuumError, models
from continuum.errors import ModelLoadError


# ---------------------------------------------------------------- loading errors
def test_tp_plan_without_torchrun_says_how_to_launch(llama_dir, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ModelLoadError, match=r"torchrun --nproc-per-node N") as info:
        models.transformers(llama_dir, tp_plan="auto")
    assert isinstance(info.value, ContinuumError) and isinstance(info.value, ValueError)
    assert models.transformers(llama_dir).model.config.num_attention_heads == 4  # nothing broken: loads without it


def test_heads_not_divisible_by_world_size(llama_dir, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")  # what torchrun --nproc-per-node 3 sets, before any process group
    with pytest.raises(ModelLoadError, match=r"4 attention heads and 2 key/value heads.*3 processes.*\[1, 2\]"):
        models.transformers(llama_dir, tp_plan="auto")


@pytest.mark.parametrize("kwargs, match", [
    ({"tp_plan": "auto", "device_map": "cpu"}, "exclusive"),
    ({"device_map": "cpu", "device": "cpu"}, "drop device="),
])
def test_conflicting_placements(llama_dir, monkeypatch, kwargs, match):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ModelLoadError, match=match):
        models.transformers(llama_dir, **kwargs)


def test_missing_checkpoint_is_a_model_load_error(tmp_path):
    with pytest.raises(ModelLoadError, match="Could not load"):
        models.transformers(str(tmp_path / "nowhere"))


# ---------------------------------------------------------------- the layout in the model identity, save/load
def _greedy(model):
    from continuum import continuous, generate, samplers

    return continuous(generate.text(model, samplers.greedy()))


def _rewrite_layout(src, dst, **layout):
    """A copy of a saved state whose recorded model identity has another layout (or none, when ``layout``
    maps keys to None: a file saved before layouts were recorded)."""
    import json

    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(src), framework="pt") as f:
        meta = json.loads(f.metadata()["continuum"])
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open is no dict
    for key, value in layout.items():
        if value is None:
            meta["model"].pop(key, None)
        else:
            meta["model"][key] = value
    save_file(tensors, str(dst), metadata={"continuum": json.dumps(meta)})


def test_single_process_fingerprint_records_its_layout(llama_model):
    fp = llama_model.fingerprint
    assert (fp.world_size, fp.rank, fp.tp_plan) == (1, 0, None) and fp.layout == "single process"
    assert fp.as_dict()["world_size"] == 1


def test_state_saved_by_a_tp_rank_is_recomputed_in_one_process(llama_model, tmp_path, caplog):
    import logging

    from continuum import SequenceState

    s = _greedy(llama_model)(["Once upon a time", "The dog"], max_tokens=5)
    s.save(tmp_path / "s.safetensors")
    # what rank 1 of a 2-process run writes: same architecture, config and (here) weights hash, another layout
    _rewrite_layout(tmp_path / "s.safetensors", tmp_path / "rank1.safetensors", world_size=2, rank=1, tp_plan="auto:0")
    with caplog.at_level(logging.WARNING, logger="continuum"):
        loaded = SequenceState.load(tmp_path / "rank1.safetensors", llama_model)
    messages = [r.getMessage() for r in caplog.records if r.name == "continuum"]
    assert any("cache is dropped" in m and "rank 1 of 2" in m for m in messages)
    assert int(loaded.cached_tokens.sum()) == 0 and list(loaded) == list(s) and torch.equal(loaded.weights, s.weights)
    expected = _greedy(llama_model)(s, max_tokens=4)
    out = _greedy(llama_model)(loaded, max_tokens=4)
    assert list(out) == list(expected)
    torch.testing.assert_close(out.weights, expected.weights, atol=1e-4, rtol=0)


def test_files_without_a_layout_are_single_process(llama_model, tmp_path, caplog):
    import logging

    from continuum import SequenceState

    s = _greedy(llama_model)("Once upon a time", max_tokens=5)
    s.save(tmp_path / "s.safetensors")
    _rewrite_layout(tmp_path / "s.safetensors", tmp_path / "old.safetensors", world_size=None, rank=None, tp_plan=None)
    with caplog.at_level(logging.WARNING, logger="continuum"):
        loaded = SequenceState.load(tmp_path / "old.safetensors", llama_model)
    assert not [r for r in caplog.records if r.name == "continuum"]
    assert torch.equal(loaded.cached_tokens, s.cached_tokens) and int(loaded.cached_tokens.min()) > 0


# ---------------------------------------------------------------- device_map: each layer's cache on its layer's device
def _two_device_kv(rows: int = 3, columns: int = 5):
    """A two-layer cache with layer 0 on the CPU and layer 1 on ``meta``: the only second device a CPU machine
    has. ``meta`` tensors have shapes and devices but no data, so this checks where every operation puts each
    layer (the values are checked on real models below and in test_cache.py)."""
    from continuum.models.hf import cache as kvcache

    k0, v0 = torch.randn(rows, 2, columns, 4), torch.randn(rows, 2, columns, 4)
    k1, v1 = torch.empty(rows, 2, columns, 4, device="meta"), torch.empty(rows, 2, columns, 4, device="meta")
    plain = ((k0, v0), (k1, v1))
    return plain, kvcache.stack_rows([plain], columns, reserve=4)  # the second one in arenas, as decoding leaves it


def test_cache_operations_keep_each_layer_on_its_device():
    from continuum.models.hf import cache as kvcache
    from continuum.models.hf import dynamic

    where = (torch.device("cpu"), torch.device("meta"))
    plain, arena = _two_device_kv()
    assert kvcache.devices(arena) == where
    cases = {}
    for name, kv in (("plain", plain), ("arena", arena)):
        cases.update({
            f"{name} rows range": kvcache.select_rows(kv, torch.tensor([1, 2])),
            f"{name} rows repeated": kvcache.select_rows(kv, torch.tensor([1, 1, 1])),
            f"{name} rows reordered": kvcache.select_rows(kv, torch.tensor([2, 0, 0])),
            f"{name} crop": kvcache.crop(kv, 3),
            f"{name} compact": kvcache.compact(kvcache.crop(kv, 1)),
            f"{name} shrink": kvcache.shrink(kv),
            f"{name} gather": kvcache.gather_columns(kv, torch.tensor([[0, 2], [1, 3], [4, 4]])),
            f"{name} stack": kvcache.stack_rows([kv, kvcache.crop(kv, 2)], 6, reserve=2),
        })
    for name, kv in cases.items():
        assert kvcache.devices(kv) == where, name
    # a forward's append (what the model's attention calls on each layer's cache) stays there too
    cache = dynamic.to_dynamic_cache(arena, _two_layer_config())
    for i, device in enumerate(where):
        k, v = cache.layers[i].update(torch.zeros(3, 2, 2, 4, device=device), torch.zeros(3, 2, 2, 4, device=device))
        assert k.device == device and k.shape[2] == 7
    assert kvcache.devices(dynamic.from_dynamic_cache(cache)) == where
    # moving a cache to a layout moves only the layers that are elsewhere
    on_cpu = (plain[0], plain[0])  # both layers on the CPU, as a file is read
    moved = kvcache.to_devices(on_cpu, where)
    assert kvcache.devices(moved) == where and moved[0][0] is plain[0][0] and kvcache.to_devices(moved, where) is moved


def _two_layer_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=8, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=2)


_CPU_MAP = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "cpu", "model.norm": "cpu",
            "model.rotary_emb": "cpu", "lm_head": "cpu"}


@pytest.mark.parametrize("offload", [False, True], ids=["cpu-map", "layer1-on-disk"])
def test_device_map_gives_the_single_device_results(llama_dir, tmp_path, offload):
    """A model loaded with an explicit device map (onto the CPU; with ``offload`` its second layer is offloaded
    to disk, so accelerate's hooks run it and the per-layer device lookup is exercised) gives the tokens and
    weights of the same checkpoint loaded plainly, through turns, slicing, forks, beams and save/load."""
    from continuum import SequenceState, continuous, generate, samplers

    plain = models.transformers(llama_dir)
    device_map = dict(_CPU_MAP, **({"model.layers.1": "disk"} if offload else {}))
    mapped = models.transformers(llama_dir, device_map=device_map, offload_folder=str(tmp_path / "offload"))
    # one device: transformers records no hf_device_map; with the disk offload, accelerate dispatched the layers
    assert getattr(mapped.model, "hf_device_map", device_map) == device_map and mapped.layer_devices == (torch.device("cpu"),) * 2

    def session(model):
        text = continuous(generate.text(model, samplers.greedy()))
        s = text(["Once upon a time", "The dog"], max_tokens=5)
        s = text(s[..., :14] + " and", max_tokens=4)
        forks = continuous(generate.text(model, samplers.multinomial(2)))(s, max_tokens=3, rng=torch.Generator().manual_seed(0))
        beams = continuous(generate.text(model, samplers.beam_search(2)))(s[0, :], max_tokens=3)
        beams = continuous(generate.text(model, samplers.beam_search(2)))(beams + " so", max_tokens=2)
        s.save(tmp_path / "s.safetensors")
        loaded = SequenceState.load(tmp_path / "s.safetensors", model)
        assert torch.equal(loaded.cached_tokens, s.cached_tokens)  # same model: the cache is kept
        resumed = text(loaded, max_tokens=3)
        assert kvcache_devices(resumed) == model.layer_devices
        return [(list(x), x.weights) for x in (s, forks, beams, resumed)]

    for (texts, weights), (texts_ref, weights_ref) in zip(session(mapped), session(plain)):
        assert texts == texts_ref
        torch.testing.assert_close(weights, weights_ref, atol=1e-4, rtol=0)


def kvcache_devices(state):

    return state._kv.devices()


# ---------------------------------------------------------------- the torchrun example, in one process
def test_torchrun_demo_runs_in_one_process(llama_dir, tmp_path, capsys):
    """``examples/torchrun_demo.py`` is the same program with or without torchrun; here without (the torchrun
    side of every feature it uses is covered by test_distributed.py)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / "torchrun_demo.py"
    spec = importlib.util.spec_from_file_location("torchrun_demo", path)
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    result = demo.main(["--model", llama_dir, "--max-tokens", "4", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "single process" in out and "saved and reloaded with its cache: True" in out
    assert len(result["texts"]) == 5 and (tmp_path / "state-rank0-of-1.safetensors").exists()
