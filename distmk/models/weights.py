"""Where weights come from: a safetensors checkpoint directory or a preset's seeded random weights.

Both answer `read(name, dim, start, stop)` with just that slice, so a tensor-parallel rank never holds a
whole tensor it does not own: safetensors slices are read from a memory map.
"""
from __future__ import annotations

import json
import math
import os
import zlib

import torch

from distmk.errors import ModelError
from distmk.models.fp8 import (DEFAULT_BLOCK, bf16_scales, dequantize, scale_block, scale_name, scale_range,
                               whole_blocks)
from distmk.models.presets import preset
from distmk.models.spec import ModelSpec, spec_from_hf_config, with_generation_config


class CheckpointWeights:
    """A Hugging Face checkpoint directory: config.json plus one or more *.safetensors (with an index). FP8
    weights (models/fp8.py) are read dequantized, each rank's slice with its own scales."""

    def __init__(self, path: str, spec: ModelSpec, fp8_block: tuple[int, int] = DEFAULT_BLOCK):
        self.path, self.spec, self.fp8_block = path, spec, fp8_block
        self._handles = {}
        index_path = os.path.join(path, "model.safetensors.index.json")
        if os.path.exists(index_path):
            try:
                with open(index_path) as f:
                    self.file_of = dict(json.load(f)["weight_map"])
            except (ValueError, KeyError) as e:
                raise ModelError(f"{index_path}: not a valid safetensors index ({e})") from None
        else:
            files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
            if not files:
                raise ModelError(f"{path}: no *.safetensors file (distmk reads safetensors checkpoints only)")
            self.file_of = {}
            for fname in files:
                for name in self._open(fname).keys():
                    self.file_of[name] = fname
        self._check(spec)

    def _open(self, fname: str):
        if fname not in self._handles:
            from safetensors import safe_open
            full = os.path.join(self.path, fname)
            if not os.path.exists(full):
                raise ModelError(f"{self.path}: the index names {fname}, which does not exist")
            try:
                self._handles[fname] = safe_open(full, framework="pt")
            except Exception as e:  # safetensors raises its own error types for truncated/corrupt files
                raise ModelError(f"{full}: cannot read safetensors file ({e})") from None
        return self._handles[fname]

    def _check(self, spec: ModelSpec) -> None:
        """Every tensor the architecture needs is present with the right shape."""
        missing = [n for n in spec.tensor_shapes() if n not in self.file_of]
        if missing:
            raise ModelError(f"{self.path}: checkpoint lacks {len(missing)} tensor(s) that {spec.architecture} "
                             f"needs, e.g. {missing[:3]}")
        for name, shape in spec.tensor_shapes().items():
            got = tuple(self._open(self.file_of[name]).get_slice(name).get_shape())
            if got != shape:
                raise ModelError(f"{self.path}: tensor {name} has shape {got}, config.json implies {shape}")

    def read(self, name: str, dim: int = 0, start: int = 0, stop: int | None = None) -> torch.Tensor:
        sl = self._open(self.file_of[name]).get_slice(name)
        shape = tuple(sl.get_shape())
        stop = shape[dim] if stop is None else stop
        part = sl[start:stop] if dim == 0 else sl[:, start:stop]
        fp8 = part.is_floating_point() and part.dtype.itemsize == 1
        return self._dequantized(name, shape, dim, start, stop, part) if fp8 else part

    def _dequantized(self, name: str, shape, dim: int, start: int, stop: int, part: torch.Tensor) -> torch.Tensor:
        """An FP8 weight's slice times the scales of its rows or columns."""
        return dequantize(part, *self._scales(name, shape, dim, start, stop))

    def _scales(self, name: str, shape, dim: int, start: int, stop: int) -> tuple[torch.Tensor, tuple[int, int]]:
        """The scale grid of an FP8 weight's slice, and the rows and columns each value covers."""
        scale = scale_name(self.file_of, name)
        if scale is None:
            raise ModelError(f"{self.path}: {name} is FP8 but the checkpoint has no {name}_scale_inv or "
                             f"{name}_scale")
        values = self._open(self.file_of[scale]).get_tensor(scale).float()
        per = scale_block(tuple(values.shape), shape, self.fp8_block)
        grid = values.reshape(-(-shape[0] // per[0]), -(-shape[1] // per[1]))
        grid = bf16_scales(grid) if per == self.fp8_block else grid
        first, last = scale_range(name, dim, start, stop, shape[dim], per[dim])
        return (grid[first:last] if dim == 0 else grid[:, first:last]), per

    def read_fp8(self, name: str, dim: int = 0, start: int = 0, stop: int | None = None):
        """(e4m3 values, float32 scale grid) of an FP8 weight's slice stored in 128 x 128 blocks that the slice holds
        whole; else None."""
        sl = self._open(self.file_of[name]).get_slice(name)
        shape = tuple(sl.get_shape())
        stop = shape[dim] if stop is None else stop
        if sl.get_dtype() not in ("F8_E4M3", "F8_E4M3FN") or not whole_blocks(start, stop, shape[dim]):
            return None
        grid, per = self._scales(name, shape, dim, start, stop)
        if per != DEFAULT_BLOCK:
            return None
        return (sl[start:stop] if dim == 0 else sl[:, start:stop]), grid.contiguous()


class RandomWeights:
    """Seeded random weights for a preset: each tensor from its own generator, so any rank at any tp draws
    the same full tensor and keeps its slice. Drawn on `device` (fast for 8B models on a GPU): the CPU and
    CUDA generators give different numbers, so a preset is one model per device type. Scales keep activations and logits O(1), so greedy tokens are
    well separated and robust to rounding."""

    def __init__(self, spec: ModelSpec, seed: int = 0, device: str | torch.device = "cpu"):
        self.spec, self.seed, self.device = spec, seed, torch.device(device)
        self.shapes = spec.tensor_shapes()

    def full(self, name: str) -> torch.Tensor:
        shape = self.shapes[name]
        if self.device.type == "meta":           # shapes only: compiling kernels ahead, planning memory
            return torch.empty(shape, device="meta")
        gen = torch.Generator(device=self.device).manual_seed(self.seed * 1_000_003 + zlib.crc32(name.encode()))
        t = torch.randn(shape, generator=gen, device=self.device, dtype=torch.float32)
        if name.endswith("norm.weight"):
            return 1.0 + 0.1 * t
        if name.endswith(".bias"):
            return 0.1 * t
        return t / math.sqrt(shape[1])

    def read(self, name: str, dim: int = 0, start: int = 0, stop: int | None = None) -> torch.Tensor:
        return self.full(name).narrow(dim, start, (stop or self.shapes[name][dim]) - start).clone()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model under Hugging Face names (for tests and for writing checkpoints)."""
        return {name: self.full(name) for name in self.shapes}


def open_model(model: str, seed: int = 0, device: str | torch.device = "cpu"):
    """Resolve a checkpoint directory or preset name to (spec, weight source, tokenizer dir or None). A
    checkpoint's spec includes what its generation_config.json, if any, says."""
    if os.path.isdir(model):
        cfg_path = os.path.join(model, "config.json")
        if not os.path.exists(cfg_path):
            raise ModelError(f"{model}: no config.json (expected a Hugging Face checkpoint directory)")
        spec = spec_from_hf_config(_json_object(cfg_path), source=cfg_path)
        gen_path = os.path.join(model, "generation_config.json")
        if os.path.exists(gen_path):
            spec = with_generation_config(spec, _json_object(gen_path), source=gen_path)
        has_tokenizer = any(os.path.exists(os.path.join(model, f)) for f in ("tokenizer.json", "tokenizer.model"))
        block = (_json_object(cfg_path).get("quantization_config") or {}).get("weight_block_size") or DEFAULT_BLOCK
        return spec, CheckpointWeights(model, spec, tuple(block)), (model if has_tokenizer else None)
    spec = preset(model)
    return spec, RandomWeights(spec, seed=seed, device=device), None


def _json_object(path: str) -> dict:
    try:
        with open(path) as f:
            obj = json.load(f)
    except ValueError as e:
        raise ModelError(f"{path}: invalid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise ModelError(f"{path}: must hold a JSON object, not {type(obj).__name__} {json.dumps(obj)[:60]}")
    return obj
