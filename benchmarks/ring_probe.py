"""Probes of the weight ring (benchmarks/stream.py), built from distmk.device.ring's pieces.

`ring_stream` streams a stack of layer matrices: program p owns rows [p * ROWS, (p + 1) * ROWS) of every layer,
layer l + 1 reads what layer l wrote, and MODE 1 puts a full-grid barrier between layers, as a decode step has
between phases. `tl_stream` is the same loop in plain `tl` code, pipelined by the compiler: the comparison that
shows what the ring wins back. `ring_matmuls` runs a step's own matmul tasks (their epilogues aside) through the
ring. CI compiles them for sm_90 (tests/test_megakernel_compiles.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

from distmk.device.ring import (PART, _dequantized, _load64, acc_layout, cta_barrier, load_rows, make_rings, make_xq,
                                matmul_layouts, mma_block, mma_block_fp8, packs_halves, sync_mma_layout, task_row,
                                tma_load)
from distmk.graph.table import COLUMNS
from distmk.kernels.ring_megakernel import E4M3_SLOT_K, RING_ROWS

ROW_WIDTH = gl.constexpr(len(COLUMNS))

E4M3_SLOT_ROWS = gl.constexpr(RING_ROWS)
E4M3_SLOT_COLUMNS = gl.constexpr(E4M3_SLOT_K)
STREAM_SCALE = gl.constexpr(1 / 64)      # a layer's output scale in the probe: keeps values O(1) over 32 layers
POLL_LIMIT = gl.constexpr(5_000_000)      # a barrier that never completes gives up instead of hanging the GPU


@gluon.jit
def _acquire(ptr):
    return gl.inline_asm_elementwise("ld.global.acquire.gpu.b32 $0, [$1];", "=r,l", [ptr], dtype=gl.int32,
                                     is_pure=False, pack=1)


@gluon.jit
def _wait_layer(counters, layer, NPROG: gl.constexpr):
    """MODE 1: until every program has finished layer `layer` - 1 (bounded)."""
    if layer > 0:
        seen = _acquire(counters + layer - 1)
        polls = 0
        while (seen < NPROG) & (polls < POLL_LIMIT):
            seen = _acquire(counters + layer - 1)
            polls += 1


@gluon.jit
def _consume(x_desc, x_row, out, OUT_STRIDE: gl.constexpr, col0, rows, n, K: gl.constexpr, SCALE: gl.constexpr,
             w_scale, ring, ready, empty, xring, xready, c, cx, num_warps: gl.constexpr, xq=None, xq_scale=None,
             PACK: gl.constexpr = False):
    """out[:n, col0:col0 + rows] = SCALE * x[x_row:x_row + n] @ W^T over the slots _produce filled (e4m3 weights
    with the block scales `w_scale` where the ring holds e4m3; with `xq` and `xq_scale`, e4m3 activations too; PACK:
    two column ranges a slot, device/ring.py packs_halves)."""
    BN: gl.constexpr = ring.type.shape[1]
    B_PAD: gl.constexpr = xring.type.shape[1]
    layout: gl.constexpr = acc_layout(BN, B_PAD, num_warps)
    rn = gl.arange(0, BN, layout=gl.SliceLayout(1, layout))
    rb = gl.arange(0, B_PAD, layout=gl.SliceLayout(0, layout))
    for j in range(0, rows, BN):
        if ring.dtype.itemsize == 1:
            acc, c, cx = mma_block_fp8(x_desc, x_row, K, w_scale, col0 + j, rows - j, ring, ready, empty, xring,
                                       xready, c, cx, j > 0, j + BN < rows, num_warps, xq, xq_scale, PACK)
        else:
            acc, c, cx = mma_block(x_desc, x_row, K, ring, ready, empty, xring, xready, c, cx, j > 0, j + BN < rows,
                                   num_warps)
        mask = (rn < rows - j)[:, None] & (rb < n)[None, :]
        gl.store(out + rb[None, :] * OUT_STRIDE + (col0 + j + rn)[:, None], (acc * SCALE).to(out.dtype.element_ty),
                 mask=mask)
    return c, cx


@gluon.jit
def _stream_producer(w_desc, ring, ready, empty, layers, ROWS: gl.constexpr, N: gl.constexpr, K: gl.constexpr,
                     A8: gl.constexpr):
    """This program's rows of every layer, in the consumer's order."""
    row0 = gl.program_id(0) * ROWS
    c = 0
    for layer in range(layers):
        c = load_rows(w_desc, layer * N + row0, ROWS, K, ring, ready, empty, c, 0,
                      packs_halves(w_desc.dtype, ROWS, K, ring.type) and not A8)


@gluon.jit
def _stream_consumer(x_desc, y, w_scale, counters, ring, ready, empty, xring, xready, xq, xq_scale, layers,
                     ROWS: gl.constexpr, N: gl.constexpr, K: gl.constexpr, NPROG: gl.constexpr, MODE: gl.constexpr,
                     A8: gl.constexpr, num_warps: gl.constexpr):
    """y[(layer + 1) % 2][:, rows] = STREAM_SCALE * y[layer % 2] @ W_layer[rows]^T for every layer, after a
    full-grid barrier (MODE 1)."""
    B_PAD: gl.constexpr = xring.type.shape[1]
    row0 = gl.program_id(0) * ROWS
    c = 0           # weight slots consumed
    cx = 0          # input slices used
    for layer in range(layers):
        if MODE == 1:
            if layer > 0:
                _wait_layer(counters, layer, NPROG)
                cta_barrier()
        out = y + ((layer + 1) % 2) * B_PAD * N
        scales = w_scale + layer * (N // 128) * (K // 128)
        if A8:
            c, cx = _consume(x_desc, (layer % 2) * B_PAD, out, N, row0, ROWS, B_PAD, K, STREAM_SCALE, scales, ring,
                             ready, empty, xring, xready, c, cx, num_warps, xq, xq_scale)
        else:
            c, cx = _consume(x_desc, (layer % 2) * B_PAD, out, N, row0, ROWS, B_PAD, K, STREAM_SCALE, scales, ring,
                             ready, empty, xring, xready, c, cx, num_warps,
                             PACK=packs_halves(ring.dtype, ROWS, K, ring.type))
        if MODE == 1:
            cta_barrier()
            gl.atomic_add(counters + layer, 1, sem="release", scope="gpu")


@gluon.jit
def ring_stream(w_desc, x_desc, y, w_scale, counters, layers, ROWS: gl.constexpr, N: gl.constexpr, K: gl.constexpr,
                NBUF: gl.constexpr, XD: gl.constexpr, NPROG: gl.constexpr, MODE: gl.constexpr, A8: gl.constexpr,
                num_warps: gl.constexpr):
    """w_scale: the e4m3 weights' block scales [layers * N / 128, K / 128] (bf16 weights: unused); A8: e4m3
    activations too (device/ring.py _w8a8_block)."""
    # a slot of bf16 weights is one box; e4m3 boxes are 16 rows (stream_descriptors), the megakernel's slots 64 rows
    # of 256 columns
    e4m3: gl.constexpr = w_desc.dtype.itemsize == 1
    BN: gl.constexpr = E4M3_SLOT_ROWS if e4m3 else w_desc.block_type.shape[0]
    ring, ready, empty, xring, xready = make_rings(w_desc, x_desc, BN, NBUF, XD, E4M3_SLOT_COLUMNS if e4m3 else 0)
    xq, xq_scale = make_xq(xring)
    gl.warp_specialize([
        (_stream_consumer, (x_desc, y, w_scale, counters, ring, ready, empty, xring, xready, xq, xq_scale, layers, ROWS,
                            N, K, NPROG, MODE, A8, num_warps)),
        (_stream_producer, (w_desc, ring, ready, empty, layers, ROWS, N, K, A8)),
    ], [1], [24])


# ---- W8A16 on two consumer warpgroups (stream.py's gluon-fp8-2wg) ---------------------------------------------------
# ring_stream's W8A16 loop is one warpgroup that converts, multiplies and copies the input slices, one warp an SM
# sub-partition: each waits out its own latencies, and every TMA copy it issues costs it a barrier and a memory
# fence. Here each of two warpgroups converts and multiplies one of a 256-column slice's two parts (its own
# accumulator, the second's added by the first at the end of a block, through shared memory), and a warp of its own
# copies the input slices, each once both have read the slice it replaces: what the megakernel's e4m3 matmuls would
# become.

@gluon.jit
def _input_copies(x_desc, xring, xready, xfree, counters, layers, ROWS: gl.constexpr, K: gl.constexpr,
                  BN: gl.constexpr, NPROG: gl.constexpr, MODE: gl.constexpr):
    """The input slices the consumers read, in their order (each block of BN rows reads all of them), each into a
    slot both consumers have released (xfree; slots start free); MODE 1: a layer's once every program finished the
    layer before."""
    XD: gl.constexpr = xring.type.shape[0]
    B_PAD: gl.constexpr = xring.type.shape[1]
    BK: gl.constexpr = xring.type.shape[2]
    g = 0
    for layer in range(layers):
        if MODE == 1:
            _wait_layer(counters, layer, NPROG)
        for j in range(0, ROWS, BN):
            for it in range(K // BK):
                xs = g % XD
                mbarrier.wait(xfree.index(xs), ((g // XD) & 1) ^ 1)
                mbarrier.expect(xready.index(xs), x_desc.block_type.nbytes)
                tma_load(x_desc, [(layer % 2) * B_PAD, it * BK], xready.index(xs), xring.index(xs))
                g += 1


@gluon.jit
def _half_block(K: gl.constexpr, scales, valid, ring, ready, empty, xring, xready, xfree, c, cx, HALF: gl.constexpr,
                num_warps: gl.constexpr):
    """Part HALF of every slice of a block: dequantized (device/ring.py _dequantized) and multiplied by mma.sync,
    its rows' scales loaded a slice ahead; the weight slot and the input slot released after each."""
    NBUF: gl.constexpr = ring.type.shape[0]
    BN: gl.constexpr = ring.type.shape[1]
    XD: gl.constexpr = xring.type.shape[0]
    B_PAD: gl.constexpr = xring.type.shape[1]
    SUB: gl.constexpr = xring.type.shape[2] // PART
    gl.static_assert((SUB == 2) & (ring.type.shape[2] == 2 * PART), "a slot and a slice are two 128-column parts")
    KT: gl.constexpr = K // xring.type.shape[2]
    mma: gl.constexpr = sync_mma_layout(num_warps)
    operand: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    parts = ring.reinterpret(ring.dtype, [NBUF * SUB, BN, PART], ring.layout)
    inputs = xring.reinterpret(xring.dtype, [XD * SUB, B_PAD, PART], xring.layout)
    scale = gl.load(scales + HALF, mask=valid, other=0.0)
    acc = gl.zeros([BN, B_PAD], gl.float32, layout=mma)
    for it in range(KT):
        s = (c + it) % NBUF
        xs = (cx + it) % XD
        mbarrier.wait(ready.index(s), ((c + it) // NBUF) & 1)
        mbarrier.wait(xready.index(xs), ((cx + it) // XD) & 1)
        next_scale = gl.load(scales + (it + 1) * SUB + HALF, mask=valid & (it + 1 < KT), other=0.0)
        a = _dequantized(parts.index(s * SUB + HALF), scale, operand)
        b = inputs.index(xs * SUB + HALF).permute((1, 0)).load(gl.DotOperandLayout(operand_index=1, parent=mma,
                                                                                    k_width=2))
        acc = mma_v2(a, b, acc)
        scale = next_scale
        cta_barrier()       # every warp has its operands in registers
        mbarrier.arrive(empty.index(s), count=1)
        mbarrier.arrive(xfree.index(xs), count=1)
    return acc, c + KT, cx + KT


@gluon.jit
def _half_consumer(y, w_scale, counters, ring, ready, empty, xring, xready, xfree, partial, handed, taken, layers,
                   ROWS: gl.constexpr, N: gl.constexpr, K: gl.constexpr, MODE: gl.constexpr, HALF: gl.constexpr,
                   num_warps: gl.constexpr):
    """Warpgroup HALF's part of every block; HALF 1 hands its sums over in `partial` (handed / taken), HALF 0 adds
    them to its own and stores the block (MODE 1: and counts the layer done)."""
    BN: gl.constexpr = ring.type.shape[1]
    B_PAD: gl.constexpr = xring.type.shape[1]
    mma: gl.constexpr = sync_mma_layout(num_warps)
    rows = gl.arange(0, BN, layout=gl.SliceLayout(1, gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)))
    rn = gl.arange(0, BN, layout=gl.SliceLayout(1, mma))
    rb = gl.arange(0, B_PAD, layout=gl.SliceLayout(0, mma))
    row0 = gl.program_id(0) * ROWS
    c = 0
    cx = 0
    blocks = 0
    for layer in range(layers):
        out = y + ((layer + 1) % 2) * B_PAD * N
        for j in range(0, ROWS, BN):
            scales = w_scale + (layer * (N // 128) + (row0 + j + rows) // 128) * (K // 128)
            acc, c, cx = _half_block(K, scales, rows < ROWS - j, ring, ready, empty, xring, xready, xfree, c, cx,
                                     HALF, num_warps)
            if HALF == 1:
                mbarrier.wait(taken.index(0), (blocks & 1) ^ 1)
                partial.store(acc)
                cta_barrier()
                mbarrier.arrive(handed.index(0), count=1)
            else:
                mbarrier.wait(handed.index(0), blocks & 1)
                acc += partial.load(mma)
                cta_barrier()
                mbarrier.arrive(taken.index(0), count=1)
                gl.store(out + rb[None, :] * N + (row0 + j + rn)[:, None], (acc * STREAM_SCALE).to(gl.bfloat16),
                         mask=(rn < ROWS - j)[:, None])
            blocks += 1
        if (MODE == 1) & (HALF == 0):
            cta_barrier()
            gl.atomic_add(counters + layer, 1, sem="release", scope="gpu")


@gluon.jit
def ring_stream_2wg(w_desc, x_desc, y, w_scale, counters, layers, ROWS: gl.constexpr, N: gl.constexpr,
                    K: gl.constexpr, NBUF: gl.constexpr, XD: gl.constexpr, NPROG: gl.constexpr, MODE: gl.constexpr,
                    A8: gl.constexpr, num_warps: gl.constexpr):
    """ring_stream over e4m3 weights (W8A16) on two consumer warpgroups and an input warp (A8 unused: ring_stream's
    signature)."""
    gl.static_assert((w_desc.dtype.itemsize == 1) & (ROWS % E4M3_SLOT_ROWS == 0), "e4m3 weights, whole blocks")
    BN: gl.constexpr = E4M3_SLOT_ROWS
    ring, ready, empty, xring, xready = make_rings(w_desc, x_desc, BN, NBUF, XD, E4M3_SLOT_COLUMNS, CONSUMERS=2)
    xfree = gl.allocate_shared_memory(gl.int64, [XD, 1], mbarrier.MBarrierLayout())
    handed = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    taken = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    partial = gl.allocate_shared_memory(gl.float32, [BN, x_desc.block_type.shape[0]],
                                        gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    for i in gl.static_range(XD):
        mbarrier.init(xfree.index(i), count=2)
    mbarrier.init(handed.index(0), count=1)
    mbarrier.init(taken.index(0), count=1)
    fence_async_shared()
    gl.warp_specialize([
        (_half_consumer, (y, w_scale, counters, ring, ready, empty, xring, xready, xfree, partial, handed, taken,
                          layers, ROWS, N, K, MODE, 0, num_warps)),
        (_half_consumer, (y, w_scale, counters, ring, ready, empty, xring, xready, xfree, partial, handed, taken,
                          layers, ROWS, N, K, MODE, 1, 4)),
        (_stream_producer, (w_desc, ring, ready, empty, layers, ROWS, N, K, False)),
        (_input_copies, (x_desc, xring, xready, xfree, counters, layers, ROWS, K, BN, NPROG, MODE)),
    ], [4, 1, 1], [232, 24, 24])


@triton.jit
def _tl_acquire(ptr):
    return tl.inline_asm_elementwise("ld.global.acquire.gpu.b32 $0, [$1];", "=r,l", [ptr], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def tl_stream(w, y, counters, layers, ROWS: tl.constexpr, N: tl.constexpr, K: tl.constexpr, BN: tl.constexpr,
              BK: tl.constexpr, B_PAD: tl.constexpr, NPROG: tl.constexpr, STAGES: tl.constexpr, MODE: tl.constexpr):
    """ring_stream's loop in plain tl code (the megakernel's matmul tiles are written this way)."""
    pid = tl.program_id(0)
    rb = tl.arange(0, B_PAD)
    rn = tl.arange(0, BN)
    rk = tl.arange(0, BK)
    for layer in range(layers):
        wl = w + layer.to(tl.int64) * N * K
        inp = y + (layer % 2) * B_PAD * N
        out = y + ((layer + 1) % 2) * B_PAD * N
        if MODE == 1:
            if layer > 0:
                seen = _tl_acquire(counters + layer - 1)
                polls = 0
                while (seen < NPROG) & (polls < POLL_LIMIT):
                    seen = _tl_acquire(counters + layer - 1)
                    polls += 1
                tl.debug_barrier()
        for j in range(0, ROWS, BN):
            rows = (pid * ROWS + j + rn).to(tl.int64) * K
            acc = tl.zeros((B_PAD, BN), dtype=tl.float32)
            for k in tl.range(0, K, BK, num_stages=STAGES):
                xt = tl.load(inp + rb[:, None] * N + (k + rk)[None, :])
                wt = tl.load(wl + rows[:, None] + (k + rk)[None, :])
                acc += tl.dot(xt, tl.trans(wt))
            tl.store(out + rb[:, None] * N + (pid * ROWS + j + rn)[None, :],
                     (acc * STREAM_SCALE).to(out.dtype.element_ty))
        if MODE == 1:
            tl.debug_barrier()
            tl.atomic_add(counters + layer, 1, sem="release", scope="gpu")


def stream_descriptors(w, y, block_n: int, block_k: int, b_pad: int):
    """TMA descriptors of the stacked weights [layers * N, K] and the two activation buffers y [2, b_pad, N]
    (a 2-D view), NVMMA-swizzled as wgmma reads them. e4m3 weights come in boxes of 16 rows and 128 columns (one
    swizzle line; a slot is two, input slices of block_k 128 or 256 one or two slots), as the megakernel's
    (device/ring.py load_block)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    fp8 = w.dtype == torch.float8_e4m3fn
    w_box = [16, 128] if fp8 else [block_n, block_k]
    w_layout = gl.NVMMASharedLayout.get_default_for(w_box, gl.float8e4nv if fp8 else gl.bfloat16)
    x_layout = gl.NVMMASharedLayout.get_default_for([b_pad, block_k], gl.bfloat16)
    return (TensorDescriptor.from_tensor(w, w_box, w_layout),
            TensorDescriptor.from_tensor(y.view(2 * b_pad, y.shape[-1]), [b_pad, block_k], x_layout))


def compile_ring_stream(rows: int, n: int, k: int, block_n: int, block_k: int, stages: int, x_stages: int,
                        programs: int, mode: int, b_pad: int = 16, arch: int = 90, fp8: bool = False,
                        a8: bool = False, two_warpgroups: bool = False):
    """ring_stream (two_warpgroups: ring_stream_2wg) compiled for CUDA compute capability `arch` without a GPU
    (CI's check that the Gluon path still builds on the Triton it installs); `fp8`: e4m3 weights (weight boxes of
    16 x 128, input slices of block_k 128 or 256)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    w_type, w_box = (gl.float8e4nv, [16, 128]) if fp8 else (gl.bfloat16, [block_n, block_k])
    w_layout = gl.NVMMASharedLayout.get_default_for(w_box, w_type)
    x_layout = gl.NVMMASharedLayout.get_default_for([b_pad, block_k], gl.bfloat16)
    signature = {"w_desc": f"tensordesc<{'fp8e4nv' if fp8 else 'bf16'}[{w_box[0]}, {w_box[1]}],{w_layout!r}>",
                 "x_desc": f"tensordesc<bf16[{b_pad}, {block_k}],{x_layout!r}>", "y": "*bf16", "w_scale": "*fp32",
                 "counters": "*i32", "layers": "i32"}
    constants = dict(ROWS=rows, N=n, K=k, NBUF=stages, XD=x_stages, NPROG=programs, MODE=mode, A8=a8, num_warps=4)
    signature.update({name: "constexpr" for name in constants})
    kernel = ring_stream_2wg if two_warpgroups else ring_stream
    names = list(kernel.arg_names)
    source = GluonASTSource(kernel, signature, {(names.index(c),): v for c, v in constants.items()}, {})
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": 4})


# ---- The step's matmul tasks on the ring: the task table walked by both partitions ----------------------------
# Output rows of a task's weight segments come in boxes of BOX rows (the weight descriptors' box), BN rows to a
# ring slot (the wgmma M); a task has one segment (qkv, o_proj, down) or two (gate_up: gate and up).
SEG_NONE, SEG_QKV, SEG_O, SEG_GATE, SEG_UP, SEG_DOWN = (gl.constexpr(v) for v in range(6))


@gluon.jit
def _segment(kind, layer, a0, a1, seg: gl.constexpr, H: gl.constexpr, D: gl.constexpr, HQ: gl.constexpr,
             HKV: gl.constexpr, INTER: gl.constexpr, QKV_ID: gl.constexpr, OPROJ_ID: gl.constexpr,
             GATEUP_ID: gl.constexpr, DOWN_ID: gl.constexpr):
    """(which matrix, its first row, rows, first output column) of segment `seg` of a task; SEG_NONE for tasks
    that read no weights. The producer and the consumer both call this: they walk the same tiles."""
    which = kind * 0
    row = kind * 0
    rows = kind * 0
    col = kind * 0
    if kind == GATEUP_ID:
        which += SEG_GATE + seg
        row += layer * INTER + a0
        rows += a1
        col += a0 + seg * INTER
    elif seg == 0:
        if kind == QKV_ID:
            which += SEG_QKV
            row += layer * (HQ + 2 * HKV) * D + a0
            rows += a1
            col += a0
        elif kind == OPROJ_ID:
            which += SEG_O
            row += layer * H + a0
            rows += a1
            col += a0
        elif kind == DOWN_ID:
            which += SEG_DOWN
            row += layer * H + a0
            rows += a1
            col += a0
    return which, row, rows, col


@gluon.jit
def _matmul_producer(tasks, queue, queue_ptr, wqkv_desc, wo_desc, wg_desc, wu_desc, wd_desc, ring, ready, empty,
                     H: gl.constexpr, D: gl.constexpr, HQ: gl.constexpr, HKV: gl.constexpr, INTER: gl.constexpr,
                     QKV_ID: gl.constexpr, OPROJ_ID: gl.constexpr,
                     GATEUP_ID: gl.constexpr, DOWN_ID: gl.constexpr):
    """Streams the weights of every task of this worker's queue, never waiting on an event."""
    worker = gl.program_id(0)
    c = 0
    for i in range(gl.load(queue_ptr + worker), gl.load(queue_ptr + worker + 1)):
        kind, layer, a0, a1, a2, a3, wait, signal = task_row(tasks, gl.load(queue + i), True, ROW_WIDTH)
        for seg in gl.static_range(2):
            which, w_row, rows, col = _segment(kind, layer, a0, a1, seg, H, D, HQ, HKV, INTER, QKV_ID,
                                               OPROJ_ID, GATEUP_ID, DOWN_ID)
            if which == SEG_QKV:
                c = load_rows(wqkv_desc, w_row, rows, H, ring, ready, empty, c, 0)
            elif which == SEG_O:
                c = load_rows(wo_desc, w_row, rows, HQ * D, ring, ready, empty, c, 0)
            elif which == SEG_GATE:
                c = load_rows(wg_desc, w_row, rows, H, ring, ready, empty, c, 0)
            elif which == SEG_UP:
                c = load_rows(wu_desc, w_row, rows, H, ring, ready, empty, c, 0)
            elif which == SEG_DOWN:
                c = load_rows(wd_desc, w_row, rows, INTER, ring, ready, empty, c, 0)


@gluon.jit
def _matmul_consumer(tasks, queue, queue_ptr, event_need, counters, rows_ptr, xh_desc, xa_desc, xi_desc, out_qkv,
                     out_o, out_gu, out_down, ring, ready, empty, xring, xready, H: gl.constexpr, D: gl.constexpr,
                     HQ: gl.constexpr, HKV: gl.constexpr, INTER: gl.constexpr,
                     QKV_ID: gl.constexpr, OPROJ_ID: gl.constexpr, GATEUP_ID: gl.constexpr, DOWN_ID: gl.constexpr,
                     num_warps: gl.constexpr):
    """Walks the queue as the megakernel does: waits on each task's event (bounded), runs its segments from the
    ring, releases its signal."""
    worker = gl.program_id(0)
    n = gl.load(rows_ptr)
    c = 0
    cx = 0
    for i in range(gl.load(queue_ptr + worker), gl.load(queue_ptr + worker + 1)):
        kind, layer, a0, a1, a2, a3, wait, signal = task_row(tasks, gl.load(queue + i), True, ROW_WIDTH)
        if wait >= 0:
            target = gl.load(event_need + wait).to(gl.int64)
            seen = _load64(counters + wait, "acquire")
            polls = 0
            while (seen < target) & (polls < POLL_LIMIT):
                seen = _load64(counters + wait, "acquire")
                polls += 1
            cta_barrier()
        for seg in gl.static_range(2):
            which, w_row, rows, col = _segment(kind, layer, a0, a1, seg, H, D, HQ, HKV, INTER, QKV_ID,
                                               OPROJ_ID, GATEUP_ID, DOWN_ID)
            if which == SEG_QKV:
                c, cx = _consume(xh_desc, 0, out_qkv, (HQ + 2 * HKV) * D, col, rows, n, H, 1.0, None, ring, ready,
                                 empty, xring, xready, c, cx, num_warps)
            elif which == SEG_O:
                c, cx = _consume(xa_desc, 0, out_o, H, col, rows, n, HQ * D, 1.0, None, ring, ready, empty, xring,
                                 xready, c, cx, num_warps)
            elif (which == SEG_GATE) | (which == SEG_UP):     # col tells gate's columns from up's
                c, cx = _consume(xh_desc, 0, out_gu, 2 * INTER, col, rows, n, H, 1.0, None, ring, ready, empty, xring,
                                 xready, c, cx, num_warps)
            elif which == SEG_DOWN:
                c, cx = _consume(xi_desc, 0, out_down, H, col, rows, n, INTER, 1.0, None, ring, ready, empty, xring,
                                 xready, c, cx, num_warps)
        if signal >= 0:
            cta_barrier()
            gl.atomic_add(counters + signal, 1, sem="release", scope="gpu")


@gluon.jit
def ring_matmuls(tasks, queue, queue_ptr, event_need, counters, rows_ptr, wqkv_desc, wo_desc, wg_desc, wu_desc,
                 wd_desc, xh_desc, xa_desc, xi_desc, out_qkv, out_o, out_gu, out_down, H: gl.constexpr,
                 D: gl.constexpr, HQ: gl.constexpr, HKV: gl.constexpr, INTER: gl.constexpr,
                 BN: gl.constexpr, NBUF: gl.constexpr, XD: gl.constexpr, QKV_ID: gl.constexpr,
                 OPROJ_ID: gl.constexpr, GATEUP_ID: gl.constexpr, DOWN_ID: gl.constexpr, num_warps: gl.constexpr):
    """The matmul tasks of a task table (qkv, o_proj, gate_up, down; their epilogues aside: each writes its
    plain product, out = x @ W^T in float32) with the weight ring: benchmarks/stream.py runs the step's own
    tables through it, beside the megakernel."""
    ring, ready, empty, xring, xready = make_rings(wqkv_desc, xh_desc, BN, NBUF, XD)
    gl.warp_specialize([
        (_matmul_consumer, (tasks, queue, queue_ptr, event_need, counters, rows_ptr, xh_desc, xa_desc, xi_desc, out_qkv,
                            out_o, out_gu, out_down, ring, ready, empty, xring, xready, H, D, HQ, HKV, INTER,
                            QKV_ID, OPROJ_ID, GATEUP_ID, DOWN_ID, num_warps)),
        (_matmul_producer, (tasks, queue, queue_ptr, wqkv_desc, wo_desc, wg_desc, wu_desc, wd_desc, ring, ready,
                            empty, H, D, HQ, HKV, INTER, QKV_ID, OPROJ_ID, GATEUP_ID, DOWN_ID)),
    ], [1], [24])


def compile_ring_matmuls(shape: dict, block_k: int = 256, stages: int = 4, x_stages: int = 4, b_pad: int = 16,
                         box: int = 16, arch: int = 90):
    """ring_matmuls compiled for `arch` without a GPU; `shape`: H, D, HQ, HKV, INTER and the four task type
    ids."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    w_layout, x_layout = matmul_layouts(block_k, b_pad, box)
    w_desc = f"tensordesc<bf16[{box}, 64],{w_layout!r}>"     # a swizzle line wide (ring.py load_block)
    x_desc = f"tensordesc<bf16[{b_pad}, {block_k}],{x_layout!r}>"
    signature = {"tasks": "*i32", "queue": "*i32", "queue_ptr": "*i32", "event_need": "*i32", "counters": "*i64",
                 "rows_ptr": "*i32", **{d: w_desc for d in ("wqkv_desc", "wo_desc", "wg_desc", "wu_desc", "wd_desc")},
                 **{d: x_desc for d in ("xh_desc", "xa_desc", "xi_desc")},
                 **{o: "*fp32" for o in ("out_qkv", "out_o", "out_gu", "out_down")}}
    constants = dict(shape, BN=64, NBUF=stages, XD=x_stages, num_warps=4)
    signature.update({name: "constexpr" for name in constants})
    names = list(ring_matmuls.arg_names)
    source = GluonASTSource(ring_matmuls, signature, {(names.index(c),): v for c, v in constants.items()}, {})
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": 4})
