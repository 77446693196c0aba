"""The autotuner's on-disk choice: keyed by GPU, model shape, tp, batch, dtype and task table; stored and read
back."""
import json

import torch

from distmk.graph import GraphConfig, compile_step
from distmk.kernels import autotune
from distmk.models.presets import PRESETS
from distmk.models.shard import plan_shard


def key(name, tp=1, batch=1, dtype=torch.bfloat16, **graph):
    spec = PRESETS[name]
    plan = plan_shard(spec, tp, 0)
    return autotune.tuning_key(spec, plan, compile_step(spec, plan, GraphConfig(batch=batch, **graph)), dtype, "cpu")


def test_key_separates_shapes_tp_batch_dtype_and_tiling():
    keys = {key("llama-3-8b", tp, batch, dtype) for tp in (1, 2) for batch in (1, 8)
            for dtype in (torch.bfloat16, torch.float16)}
    assert len(keys) == 8
    assert key("llama-3-8b") == key("llama-3-8b")
    assert key("qwen3-8b") not in keys
    assert key("llama-3-8b", tile_rows=64) not in keys         # the same model cut into other tiles


def test_store_and_read_back(tmp_path, monkeypatch):
    monkeypatch.setenv("DISTMK_CACHE_DIR", str(tmp_path))
    assert autotune.cached_options("k") is None
    autotune._store("k", {"options": {"num_stages": 3}, "timings_ms": {"{}": 5.0}})
    autotune._store("k2", {"options": {}, "timings_ms": {}})
    assert autotune.cached_options("k") == {"num_stages": 3}
    assert set(json.load(open(tmp_path / "autotune.json"))) == {"k", "k2"}
    (tmp_path / "autotune.json").write_text("{broken")
    assert autotune.cached_options("k") is None            # a damaged cache means: measure again
