"""A row tile of the attention output projection (row-parallel): attn @ Wo[rows]^T, into the residual
stream (tp=1) or this rank's partial sum (tp>1, combined by an allreduce task)."""
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from distmk.device import ring as rg
from distmk.device.primitives import prefetch_l2
from distmk.tasks.base import TaskKind, row_parallel_gpu, row_parallel_tile


@triton.jit
def o_proj_gpu(layer, row0, nrows, mode, n, attn, wo, x, partial, H: tl.constexpr, HQ: tl.constexpr, D: tl.constexpr,
               B_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    w = wo + layer.to(tl.int64) * H * HQ * D
    row_parallel_gpu(attn, w, row0, nrows, mode, n, x, partial, HQ * D, H, B_PAD, BLOCK_N, BLOCK_K, DOT_PRECISION)


@triton.jit
def o_proj_prefetch(layer, row0, nrows, wo, H: tl.constexpr, HQ: tl.constexpr, D: tl.constexpr, PREFETCH: tl.constexpr,
                    INTERPRET: tl.constexpr):
    prefetch_l2(wo + layer.to(tl.int64) * H * HQ * D + row0 * HQ * D, nrows * HQ * D, PREFETCH, INTERPRET)


@gluon.jit
def o_proj_weights(layer, row0, nrows, wo_desc, ring, ready, empty, c, H: gl.constexpr, HQ: gl.constexpr,
                   D: gl.constexpr):
    return rg.load_rows(wo_desc, layer * H + row0, nrows, HQ * D, ring, ready, empty, c)


@gluon.jit
def o_proj_ring(row0, nrows, n, x, attn_desc, ring, ready, empty, xring, xready, c, cx, H: gl.constexpr,
                HQ: gl.constexpr, D: gl.constexpr, num_warps: gl.constexpr):
    """The tp=1 tile (ADD_RESIDUAL: the ring megakernel runs only there)."""
    return rg.add_residual_rows(attn_desc, 0, HQ * D, row0, nrows, n, x, H, ring, ready, empty, xring, xready, c, cx,
                                num_warps)


class OProj(TaskKind):
    name = "o_proj"
    args = ("row0", "nrows", "mode")
    gpu = o_proj_gpu
    gpu_prefetch = o_proj_prefetch
    ring = o_proj_ring
    ring_weights = o_proj_weights

    def cost(self, shape, layer, a):
        return shape.matmul_bytes(a[1], shape.plan.num_heads * shape.spec.head_dim)

    def run(self, ctx, layer, a):
        row0, nrows, mode = a
        row_parallel_tile(ctx, ctx.buf["attn"], ctx.weights.layers[layer].wo, row0, nrows, mode)
