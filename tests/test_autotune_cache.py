"""The autotuner's on-disk choice: keyed by GPU, model shape, tp, batch and dtype; stored and read back."""
import json

import torch

from distmk.kernels import autotune
from distmk.models.presets import PRESETS
from distmk.models.shard import plan_shard


def test_key_separates_shapes_tp_batch_and_dtype():
    spec = PRESETS["llama-3-8b"]
    keys = {autotune.tuning_key(spec, plan_shard(spec, tp, 0), batch, dtype, "cpu")
            for tp in (1, 2) for batch in (1, 8) for dtype in (torch.bfloat16, torch.float16)}
    assert len(keys) == 8
    other = autotune.tuning_key(PRESETS["qwen3-8b"], plan_shard(PRESETS["qwen3-8b"], 1, 0), 1, torch.bfloat16, "cpu")
    assert other not in keys


def test_store_and_read_back(tmp_path, monkeypatch):
    monkeypatch.setenv("DISTMK_CACHE_DIR", str(tmp_path))
    assert autotune.cached_options("k") is None
    autotune._store("k", {"options": {"num_stages": 3}, "timings_ms": {"{}": 5.0}})
    autotune._store("k2", {"options": {}, "timings_ms": {}})
    assert autotune.cached_options("k") == {"num_stages": 3}
    assert set(json.load(open(tmp_path / "autotune.json"))) == {"k", "k2"}
    (tmp_path / "autotune.json").write_text("{broken")
    assert autotune.cached_options("k") is None            # a damaged cache means: measure again
