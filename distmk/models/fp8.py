"""FP8 weights (e4m3): the two layouts of the checkpoints deployed on Hopper, and quantizing at load.

- Blocks: each block of a weight (128 x 128 unless config.json's quantization_config.weight_block_size says
  otherwise) has a float32 `<name>_scale_inv` (Qwen3-*-FP8, DeepSeek).
- Per tensor or per output channel: a float32 `<name>_scale` of one value or one a row (AutoFP8, compressed-tensors).
  A static `input_scale` of the activations is not used: activations stay in the model's dtype (weights only).

A weight's value is its e4m3 value times its block's scale (held as a bf16 value: bf16_scales), rounded to the
model's dtype: what the reference multiplies (the reference is the spec). With kernel option stream_e4m3 the
megakernels read the e4m3 values themselves where they come in 128 x 128 blocks that a rank's slices hold whole
(`read_fp8`): the tl kernel and the weight ring dequantize them so as they load them (device/primitives.py
dequantized, device/ring.py mma_block_fp8), the engine holds them in e4m3 alone (models/shard.py RankWeights.fp8),
and prefill on Hopper multiplies them by its activations quantized to e4m3 (W8A8, scaled_mm_blocks). The
embeddings, the lm_head, the norms and the routers stay in the model's dtype unless the checkpoint stores them in
FP8."""
from __future__ import annotations

import torch

from distmk.errors import ModelError

E4M3_MAX = 448.0                    # the largest finite e4m3 value
DEFAULT_BLOCK = (128, 128)
KERNEL_BLOCK = 128                  # the blocks the ring streams (device/ring.py mma_block_fp8)


def scale_name(names, weight: str) -> str | None:
    """The scale tensor that goes with an FP8 weight (None if there is none)."""
    return next((weight + suffix for suffix in ("_scale_inv", "_scale") if weight + suffix in names), None)


def scale_block(scale_shape: tuple[int, ...], shape: tuple[int, int], block: tuple[int, int]) -> tuple[int, int]:
    """The rows and columns each scale value covers: a block grid, one value a row, or one for the tensor."""
    rows, cols = shape
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    if tuple(scale_shape) == grid:
        return block
    if tuple(scale_shape) in ((rows,), (rows, 1)):
        return 1, cols
    if tuple(scale_shape) in ((), (1,), (1, 1)):
        return rows, cols
    raise ModelError(f"an FP8 scale of shape {tuple(scale_shape)} fits neither {block[0]}x{block[1]} blocks "
                     f"{grid}, one a row ({rows}), nor one for the tensor, of a weight {tuple(shape)}")


def scale_range(name: str, dim: int, start: int, stop: int, size: int, per: int) -> tuple[int, int]:
    """The scale rows (dim 0) or columns (dim 1) of weight rows or columns start..stop: a tensor-parallel slice
    must hold whole blocks, as vLLM requires (a scale for every row or column, or one along all of them, holds any
    slice)."""
    if 1 < per < size and (start % per or (stop % per and stop != size)):
        raise ModelError(f"{name}: {'rows' if dim == 0 else 'columns'} {start}..{stop} of this rank's slice cut its "
                         f"FP8 blocks of {per}: a tensor-parallel rank must hold whole blocks (use a tp that divides "
                         f"the blocks, or the bf16 checkpoint)")
    return start // per, -(-stop // per)


def whole_blocks(start: int, stop: int, size: int, per: int = KERNEL_BLOCK) -> bool:
    """Whether rows or columns start..stop of `size` hold whole blocks of `per` (the last block may be short)."""
    return start % per == 0 and (stop % per == 0 or stop == size)


def dequantize(data: torch.Tensor, scale: torch.Tensor, per: tuple[int, int]) -> torch.Tensor:
    """float32 values of an e4m3 slice [..., rows, cols] (a stack of matrices, such as experts, or one) whose
    scales (each matrix's grid from its first row and column on) each cover `per` rows and columns."""
    *stack, rows, cols = data.shape
    scale = scale.float().reshape(*stack, -(-rows // per[0]), -(-cols // per[1]))
    full = scale.repeat_interleave(per[0], -2)[..., :rows, :].repeat_interleave(per[1], -1)[..., :cols]
    return data.float() * full


def dequantize_blocks(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype,
                      order: torch.Tensor | None = None) -> torch.Tensor:
    """An e4m3 product in 128 x 128 blocks (RankWeights.fp8) in `dtype`, each weight rounded once: what the reference
    multiplies and the kernels dequantize to. `order`: the order its values hold each 128 columns in
    (RankWeights.fp8_order), undone."""
    weights = dequantize(values, scales, DEFAULT_BLOCK)
    return (weights if order is None else in_block_order(weights, torch.argsort(order))).to(dtype)


def in_block_order(t: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """t [..., K] with each 128 columns taken in `order`: column p of a block is the block's column order[p]."""
    return t.unflatten(-1, (-1, KERNEL_BLOCK))[..., order].flatten(-2)


def bf16_scales(scales: torch.Tensor) -> torch.Tensor:
    """Block scales as every executor holds them: float32 tensors of bf16 values, since the weight ring multiplies
    its weights by them in bf16 (device/ring.py _dequantized). A checkpoint's scale moves by at most 2^-9 of itself
    (a block's weights alike), far within e4m3's own step."""
    return scales.to(torch.bfloat16).float()


def quantize(weight: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 values, float32 scale of each block) of a weight, each block's largest magnitude at e4m3's largest or
    just under: the scale the least bf16 value at or above largest / E4M3_MAX (bf16_scales holds it exactly)."""
    rows, cols = weight.shape
    w = weight.float()
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    padded = torch.zeros(grid[0] * block[0], grid[1] * block[1], dtype=torch.float32, device=w.device)
    padded[:rows, :cols] = w
    blocks = padded.view(grid[0], block[0], grid[1], block[1])
    least = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / E4M3_MAX
    scale = bf16_scales(least)
    scale = torch.where(scale < least, (scale.to(torch.bfloat16).view(torch.int16) + 1).view(torch.bfloat16).float(),
                        scale)
    values = (blocks / scale[:, None, :, None]).view_as(padded)[:rows, :cols].to(torch.float8_e4m3fn)
    return values, scale


def activation_scale(largest: torch.Tensor) -> torch.Tensor:
    """The scale of activations whose largest magnitude is `largest` (float32): the least power of two s with
    largest / s <= E4M3_MAX, at least 2^-100. A power of two makes the quantized values the activations' own
    (x / s is exact; e4m3 is a float, so precision is not lost to the rounding up) and lets the kernel compute s
    and 1 / s with bit operations (device/ring.py power_of_two_scale), exactly as here."""
    least = torch.clamp(largest.float() * torch.tensor(1 / E4M3_MAX, dtype=torch.float32), min=2.0 ** -100)
    return ((least.view(torch.int32) + 0x7FFFFF) & 0x7F800000).view(torch.float32)


def quantize_groups(x: torch.Tensor, per: int = KERNEL_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 values [..., K], float32 scales [..., K / per]) of activations x [..., K]: each row's `per` columns
    quantized with activation_scale of their largest magnitude (W8A8's input)."""
    *lead, cols = x.shape
    groups = x.float().reshape(*lead, cols // per, per)
    scale = activation_scale(groups.abs().amax(dim=-1, keepdim=True))
    values = (groups * (1 / scale)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return values.reshape(*lead, cols), scale.reshape(*lead, cols // per)


def dequantize_groups(values: torch.Tensor, scales: torch.Tensor, per: int = KERNEL_BLOCK) -> torch.Tensor:
    """quantize_groups' (values, scales) as the float32 activations they stand for."""
    return (values.float().unflatten(-1, (-1, per)) * scales[..., None]).flatten(-2)


def quantize_activations(x: torch.Tensor, per: int = KERNEL_BLOCK) -> torch.Tensor:
    """W8A8's input: x [..., K] as the weight ring's e4m3-by-e4m3 loop multiplies it (device/ring.py _w8a8_block,
    stream.py's gluon-w8a8 probe), quantize_groups dequantized (float32)."""
    return dequantize_groups(*quantize_groups(x, per), per)


@torch.library.custom_op("distmk::scaled_mm_blocks", mutates_args=())
def scaled_mm_blocks(x: torch.Tensor, x_scales: torch.Tensor, values: torch.Tensor, scales: torch.Tensor,
                     dtype: torch.dtype) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T in `dtype`, both in e4m3: x with a scale a row and 128 columns (quantize_groups),
    the weight in 128 x 128 blocks. On a GPU torch._scaled_mm's blockwise kernel (Hopper: the checkpoints' own
    recipe, as vLLM runs them), x's rows padded to a multiple of 16 (cuBLAS takes no fewer); elsewhere, and for
    shapes it does not take, the same sums in float32: cuBLAS (torch 2.11, H100) returned wrong sums, without an
    error, for every K tried that is not a multiple of 512. A custom op: torch.compile'd code calls it as it is."""
    rows, cols = x.shape
    if x.is_cuda and values.shape[0] % 128 == 0 and cols % 512 == 0:
        pad = -rows % 16
        if pad:
            x = torch.cat([x, x.new_zeros(pad, cols)])
            x_scales = torch.cat([x_scales, x_scales.new_ones(pad, x_scales.shape[1])])
        return torch._scaled_mm(x, values.t(), scale_a=x_scales.t().contiguous().t(), scale_b=scales.t(),
                                out_dtype=dtype)[:rows]
    return (dequantize_groups(x, x_scales) @ dequantize(values, scales, DEFAULT_BLOCK).t()).to(dtype)


@scaled_mm_blocks.register_fake
def _(x, x_scales, values, scales, dtype):
    return x.new_empty((x.shape[0], values.shape[0]), dtype=dtype)


def linear_weights(spec) -> set[str]:
    """The weights of the layers' products (attention, dense MLP, experts): what --quantize fp8 quantizes."""
    routers = {spec.moe_names(i, 0)[0] for i in spec.moe_layers}
    return {name for name, shape in spec.tensor_shapes().items()
            if len(shape) == 2 and name.startswith("model.layers.") and name not in routers}


class QuantizedAtLoad:
    """--quantize fp8: a bf16 (or float32) source read as its FP8 twin in blocks, so that every preset has one.
    A rank's slice is quantized on the full tensor's block grid (the blocks it touches read whole), so the twin is
    the same at every tp."""

    def __init__(self, source, spec, block: tuple[int, int] = DEFAULT_BLOCK):
        self.source, self.spec, self.block = source, spec, block
        self.quantized, self.shapes = linear_weights(spec), spec.tensor_shapes()

    def read(self, name: str, dim: int = 0, start: int = 0, stop: int | None = None) -> torch.Tensor:
        if name not in self.quantized:
            return self.source.read(name, dim, start, stop)
        size, per = self.shapes[name][dim], self.block[dim]
        stop = size if stop is None else stop
        first, last = start // per * per, min(size, -(-stop // per) * per)
        w = dequantize(*quantize(self.source.read(name, dim, first, last), self.block), self.block)
        return w[start - first:stop - first] if dim == 0 else w[:, start - first:stop - first]

    def read_fp8(self, name: str, dim: int = 0, start: int = 0, stop: int | None = None):
        """(e4m3 values, float32 scale grid) of the slice, where it holds whole kernel blocks; else None."""
        size = self.shapes[name][dim]
        stop = size if stop is None else stop
        if name not in self.quantized or self.block != DEFAULT_BLOCK or not whole_blocks(start, stop, size):
            return None
        return quantize(self.source.read(name, dim, start, stop), self.block)
