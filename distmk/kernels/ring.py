"""A weight stream that does not stop while a worker waits: Gluon warp specialization on Hopper.

A one-warp producer partition walks the program's weight tiles in the order the consumer will use them and
copies each by TMA into a shared-memory ring, guarded by mbarriers (`ready`: the copy landed, `empty`: the
consumer is done with the slot). Weights never depend on events, so the producer runs ahead through every
wait of the consumer: at a phase boundary the ring fills instead of the pipeline draining. The consumer (the
default partition, one warpgroup) brings its input slices by TMA too, a few ahead, and multiplies with
wgmma, the weight tile as the A operand (M = tile rows) and the input slice as B (N = padded batch).

`ring_stream` is the probe of that design over a stack of layer matrices (benchmarks/stream.py): program p
owns rows [p * ROWS, (p + 1) * ROWS) of every layer, layer l + 1 reads what layer l wrote, and MODE 1 puts a
full-grid barrier between layers, as a decode step has between phases. `tl_stream` is the same loop in
plain `tl` code, pipelined by the compiler: the comparison that shows what the ring wins back. GPU only
(Gluon has no interpreter); CI compiles it for sm_90 (tests/test_megakernel_compiles.py).
"""
from __future__ import annotations

import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)

STREAM_SCALE = gl.constexpr(1 / 64)      # a layer's output scale in the probe: keeps values O(1) over 32 layers
POLL_LIMIT = gl.constexpr(5_000_000)      # a barrier that never completes gives up instead of hanging the GPU
# Gluon moves between releases: the CTA-wide barrier is thread_barrier on Triton 3.6 (the GPU image's), barrier
# from 3.7 on
cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier
# and the TMA load into shared memory async_copy_global_to_shared on 3.6, async_load from 3.7 on
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared


@gluon.jit
def _acquire(ptr):
    return gl.inline_asm_elementwise("ld.global.acquire.gpu.b32 $0, [$1];", "=r,l", [ptr], dtype=gl.int32,
                                     is_pure=False, pack=1)


@gluon.jit
def make_rings(w_desc, x_desc, BN: gl.constexpr, NBUF: gl.constexpr, XD: gl.constexpr):
    """The weight ring (NBUF slots of BN rows) and the input ring (XD slices) in shared memory, with their
    mbarriers: ready/empty per weight slot, ready per input slice."""
    BK: gl.constexpr = w_desc.block_type.shape[1]
    ring = gl.allocate_shared_memory(w_desc.dtype, [NBUF, BN, BK], w_desc.layout)
    xring = gl.allocate_shared_memory(x_desc.dtype, [XD] + x_desc.block_type.shape, x_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    xready = gl.allocate_shared_memory(gl.int64, [XD, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NBUF):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    for i in gl.static_range(XD):
        mbarrier.init(xready.index(i), count=1)
    fence_async_shared()
    return ring, ready, empty, xring, xready


@gluon.jit
def load_block(desc, row0, rows, K: gl.constexpr, ring, ready, empty, c):
    """Producer: the ring slots of one block of `rows` (<= BN) weight rows from row0, BK columns at a time, in
    boxes of the descriptor's rows, each copied as soon as the consumer frees its slot; returns the slots
    filled so far. A slot's rows past the block keep an earlier block's weights: consumers never store them."""
    NBUF: gl.constexpr = ring.type.shape[0]
    BN: gl.constexpr = ring.type.shape[1]
    BOX: gl.constexpr = desc.block_type.shape[0]
    BK: gl.constexpr = desc.block_type.shape[1]
    boxes = (gl.minimum(rows, BN) + BOX - 1) // BOX
    for k in range(0, K, BK):
        s = c % NBUF
        slot = ring.index(s)
        mbarrier.wait(empty.index(s), ((c // NBUF) & 1) ^ 1)          # slots start free (phase 1 done)
        for nb in gl.static_range(1, BN // BOX + 1):                      # expect takes a constant byte count
            mbarrier.expect(ready.index(s), nb * desc.block_type.nbytes, pred=boxes == nb)
        for b in gl.static_range(BN // BOX):
            tma_load(desc, [row0 + b * BOX, k], ready.index(s), slot.slice(b * BOX, BOX), pred=b < boxes)
        c += 1
    return c


@gluon.jit
def mma_block(x_desc, x_row, K: gl.constexpr, ring, ready, empty, xring, xready, c, cx, primed, chained,
              num_warps: gl.constexpr):
    """Consumer: acc[BN, B_PAD] = W_block @ x[x_row:x_row + B_PAD, :K]^T in float32 over the ring's next K / BK
    slots (as load_block filled them): one wgmma a slot, one in flight while the next slot is waited for. The
    input slices come by TMA, XD - 1 ahead, issued here because they may depend on the event just waited for.
    Blocks of one task read the same input: a `chained` block goes on issuing the next block's first slices
    (from its own last ones), so the next, `primed`, block starts without a round trip for its input.
    Returns the accumulator and the slots and input slices used so far."""
    NBUF: gl.constexpr = ring.type.shape[0]
    BN: gl.constexpr = ring.type.shape[1]
    XD: gl.constexpr = xring.type.shape[0]
    B_PAD: gl.constexpr = xring.type.shape[1]
    BK: gl.constexpr = xring.type.shape[2]
    KT: gl.constexpr = K // BK
    for p in gl.static_range(XD - 1):
        slot = (cx + p) % XD
        first = (p < KT) & (primed == 0)
        mbarrier.expect(xready.index(slot), x_desc.block_type.nbytes, pred=first)
        tma_load(x_desc, [x_row, (p % KT) * BK], xready.index(slot), xring.index(slot), pred=first)
    acc = gl.zeros([BN, B_PAD], gl.float32, layout=acc_layout(BN, B_PAD, num_warps))
    for it in range(KT):
        xs = (cx + it) % XD
        mbarrier.wait(xready.index(xs), ((cx + it) // XD) & 1)
        s = c % NBUF
        mbarrier.wait(ready.index(s), (c // NBUF) & 1)
        acc = warpgroup_mma(ring.index(s), xring.index(xs).permute((1, 0)), acc, use_acc=it > 0, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=[acc])
        # the previous wgmma is done: its weight slot goes back to the producer, its input slot is refilled
        mbarrier.arrive(empty.index((c + NBUF - 1) % NBUF), count=1, pred=it > 0)
        ahead = it + XD - 1
        slot = (cx + ahead) % XD
        more = (ahead < KT) | ((chained != 0) & (ahead - KT < KT))
        mbarrier.expect(xready.index(slot), x_desc.block_type.nbytes, pred=more)
        tma_load(x_desc, [x_row, (ahead % KT) * BK], xready.index(slot), xring.index(slot), pred=more)
        c += 1
    acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
    mbarrier.arrive(empty.index((c + NBUF - 1) % NBUF), count=1)
    return acc, c, cx + KT


@gluon.constexpr_function
def acc_layout(BN, B_PAD, num_warps):
    """The wgmma accumulator's register layout: weight rows along M, the padded batch along N."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, B_PAD, 16])


@gluon.jit
def load_rows(desc, row0, rows, K: gl.constexpr, ring, ready, empty, c):
    """Producer: the slots of `rows` weight rows from row0, block after block."""
    BN: gl.constexpr = ring.type.shape[1]
    for j in range(0, rows, BN):
        c = load_block(desc, row0 + j, rows - j, K, ring, ready, empty, c)
    return c


@gluon.jit
def _consume(x_desc, x_row, out, OUT_STRIDE: gl.constexpr, col0, rows, n, K: gl.constexpr, SCALE: gl.constexpr,
             ring, ready, empty, xring, xready, c, cx, num_warps: gl.constexpr):
    """out[:n, col0:col0 + rows] = SCALE * x[x_row:x_row + n] @ W^T over the slots _produce filled."""
    BN: gl.constexpr = ring.type.shape[1]
    B_PAD: gl.constexpr = xring.type.shape[1]
    layout: gl.constexpr = acc_layout(BN, B_PAD, num_warps)
    rn = gl.arange(0, BN, layout=gl.SliceLayout(1, layout))
    rb = gl.arange(0, B_PAD, layout=gl.SliceLayout(0, layout))
    for j in range(0, rows, BN):
        acc, c, cx = mma_block(x_desc, x_row, K, ring, ready, empty, xring, xready, c, cx, j > 0, j + BN < rows,
                               num_warps)
        mask = (rn < rows - j)[:, None] & (rb < n)[None, :]
        gl.store(out + rb[None, :] * OUT_STRIDE + (col0 + j + rn)[:, None], (acc * SCALE).to(out.dtype.element_ty),
                 mask=mask)
    return c, cx


@gluon.jit
def _stream_producer(w_desc, ring, ready, empty, layers, ROWS: gl.constexpr, N: gl.constexpr, K: gl.constexpr):
    """This program's rows of every layer, in the consumer's order."""
    row0 = gl.program_id(0) * ROWS
    c = 0
    for layer in range(layers):
        c = load_rows(w_desc, layer * N + row0, ROWS, K, ring, ready, empty, c)


@gluon.jit
def _stream_consumer(x_desc, y, counters, ring, ready, empty, xring, xready, layers, ROWS: gl.constexpr,
                     N: gl.constexpr, K: gl.constexpr, NPROG: gl.constexpr, MODE: gl.constexpr,
                     num_warps: gl.constexpr):
    """y[(layer + 1) % 2][:, rows] = STREAM_SCALE * y[layer % 2] @ W_layer[rows]^T for every layer, after a
    full-grid barrier (MODE 1)."""
    B_PAD: gl.constexpr = xring.type.shape[1]
    row0 = gl.program_id(0) * ROWS
    c = 0           # weight slots consumed
    cx = 0          # input slices used
    for layer in range(layers):
        if MODE == 1:
            if layer > 0:
                seen = _acquire(counters + layer - 1)
                polls = 0
                while (seen < NPROG) & (polls < POLL_LIMIT):
                    seen = _acquire(counters + layer - 1)
                    polls += 1
                cta_barrier()
        c, cx = _consume(x_desc, (layer % 2) * B_PAD, y + ((layer + 1) % 2) * B_PAD * N, N, row0, ROWS, B_PAD, K,
                         STREAM_SCALE, ring, ready, empty, xring, xready, c, cx, num_warps)
        if MODE == 1:
            cta_barrier()
            gl.atomic_add(counters + layer, 1, sem="release", scope="gpu")


@gluon.jit
def ring_stream(w_desc, x_desc, y, counters, layers, ROWS: gl.constexpr, N: gl.constexpr, K: gl.constexpr,
                NBUF: gl.constexpr, XD: gl.constexpr, NPROG: gl.constexpr, MODE: gl.constexpr,
                num_warps: gl.constexpr):
    ring, ready, empty, xring, xready = make_rings(w_desc, x_desc, w_desc.block_type.shape[0], NBUF, XD)
    gl.warp_specialize([
        (_stream_consumer, (x_desc, y, counters, ring, ready, empty, xring, xready, layers, ROWS, N, K, NPROG, MODE,
                            num_warps)),
        (_stream_producer, (w_desc, ring, ready, empty, layers, ROWS, N, K)),
    ], [1], [24])


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
    (a 2-D view), NVMMA-swizzled as wgmma reads them."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    w_layout = gl.NVMMASharedLayout.get_default_for([block_n, block_k], gl.bfloat16)
    x_layout = gl.NVMMASharedLayout.get_default_for([b_pad, block_k], gl.bfloat16)
    return (TensorDescriptor.from_tensor(w, [block_n, block_k], w_layout),
            TensorDescriptor.from_tensor(y.view(2 * b_pad, y.shape[-1]), [b_pad, block_k], x_layout))


def compile_ring_stream(rows: int, n: int, k: int, block_n: int, block_k: int, stages: int, x_stages: int,
                        programs: int, mode: int, b_pad: int = 16, arch: int = 90):
    """ring_stream compiled for CUDA compute capability `arch` without a GPU (CI's check that the Gluon path
    still builds on the Triton it installs)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    w_layout = gl.NVMMASharedLayout.get_default_for([block_n, block_k], gl.bfloat16)
    x_layout = gl.NVMMASharedLayout.get_default_for([b_pad, block_k], gl.bfloat16)
    signature = {"w_desc": f"tensordesc<bf16[{block_n}, {block_k}],{w_layout!r}>",
                 "x_desc": f"tensordesc<bf16[{b_pad}, {block_k}],{x_layout!r}>", "y": "*bf16", "counters": "*i32",
                 "layers": "i32"}
    constants = dict(ROWS=rows, N=n, K=k, NBUF=stages, XD=x_stages, NPROG=programs, MODE=mode, num_warps=4)
    signature.update({name: "constexpr" for name in constants})
    names = list(ring_stream.arg_names)
    source = GluonASTSource(ring_stream, signature, {(names.index(c),): v for c, v in constants.items()}, {})
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": 4})


# ---- The step's matmul tasks on the ring: the task table walked by both partitions ----------------------------
# Output rows of a task's weight segments come in boxes of BOX rows (the weight descriptors' box), BN rows to a
# ring slot (the wgmma M); a task has one segment (o_proj, down) or two (q/k/v: the two RoPE halves of a head
# slice; gate_up: gate and up).
SEG_NONE, SEG_QKV, SEG_O, SEG_GATE, SEG_UP, SEG_DOWN = (gl.constexpr(v) for v in range(6))


@gluon.jit
def _acquire64(ptr):
    return gl.inline_asm_elementwise("ld.global.acquire.gpu.b64 $0, [$1];", "=l,l", [ptr], dtype=gl.int64,
                                     is_pure=False, pack=1)


@gluon.jit
def task_row(rows, i, valid):
    """Row i of a task table (graph/table.py COLUMNS): type, layer, a0..a3, wait, signal; zeros unless valid."""
    row = rows + i * 8
    return (gl.load(row, mask=valid, other=0), gl.load(row + 1, mask=valid, other=0),
            gl.load(row + 2, mask=valid, other=0), gl.load(row + 3, mask=valid, other=0),
            gl.load(row + 4, mask=valid, other=0), gl.load(row + 5, mask=valid, other=0),
            gl.load(row + 6, mask=valid, other=0), gl.load(row + 7, mask=valid, other=0))


@gluon.jit
def _segment(kind, layer, a0, a1, seg: gl.constexpr, H: gl.constexpr, D: gl.constexpr, HQ: gl.constexpr,
             HKV: gl.constexpr, INTER: gl.constexpr, QKV_PARTS: gl.constexpr, QKV_ID: gl.constexpr,
             OPROJ_ID: gl.constexpr, GATEUP_ID: gl.constexpr, DOWN_ID: gl.constexpr):
    """(which matrix, its first row, rows, first output column) of segment `seg` of a task; SEG_NONE for tasks
    that read no weights. The producer and the consumer both call this: they walk the same tiles."""
    PART: gl.constexpr = D // 2 // QKV_PARTS
    which = kind * 0
    row = kind * 0
    rows = kind * 0
    col = kind * 0
    if kind == QKV_ID:
        which += SEG_QKV
        col += a0 * D + a1 * PART + seg * (D // 2)
        row += layer * (HQ + 2 * HKV) * D + col
        rows += PART
    elif kind == GATEUP_ID:
        which += SEG_GATE + seg
        row += layer * INTER + a0
        rows += a1
        col += a0 + seg * INTER
    elif seg == 0:
        if kind == OPROJ_ID:
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
                     QKV_PARTS: gl.constexpr, QKV_ID: gl.constexpr, OPROJ_ID: gl.constexpr,
                     GATEUP_ID: gl.constexpr, DOWN_ID: gl.constexpr):
    """Streams the weights of every task of this worker's queue, never waiting on an event."""
    worker = gl.program_id(0)
    c = 0
    for i in range(gl.load(queue_ptr + worker), gl.load(queue_ptr + worker + 1)):
        kind, layer, a0, a1, a2, a3, wait, signal = task_row(tasks, gl.load(queue + i), True)
        for seg in gl.static_range(2):
            which, w_row, rows, col = _segment(kind, layer, a0, a1, seg, H, D, HQ, HKV, INTER, QKV_PARTS, QKV_ID,
                                               OPROJ_ID, GATEUP_ID, DOWN_ID)
            if which == SEG_QKV:
                c = load_rows(wqkv_desc, w_row, rows, H, ring, ready, empty, c)
            elif which == SEG_O:
                c = load_rows(wo_desc, w_row, rows, HQ * D, ring, ready, empty, c)
            elif which == SEG_GATE:
                c = load_rows(wg_desc, w_row, rows, H, ring, ready, empty, c)
            elif which == SEG_UP:
                c = load_rows(wu_desc, w_row, rows, H, ring, ready, empty, c)
            elif which == SEG_DOWN:
                c = load_rows(wd_desc, w_row, rows, INTER, ring, ready, empty, c)


@gluon.jit
def _matmul_consumer(tasks, queue, queue_ptr, event_need, counters, rows_ptr, xh_desc, xa_desc, xi_desc, out_qkv,
                     out_o, out_gu, out_down, ring, ready, empty, xring, xready, H: gl.constexpr, D: gl.constexpr,
                     HQ: gl.constexpr, HKV: gl.constexpr, INTER: gl.constexpr, QKV_PARTS: gl.constexpr,
                     QKV_ID: gl.constexpr, OPROJ_ID: gl.constexpr, GATEUP_ID: gl.constexpr, DOWN_ID: gl.constexpr,
                     num_warps: gl.constexpr):
    """Walks the queue as the megakernel does: waits on each task's event (bounded), runs its segments from the
    ring, releases its signal."""
    worker = gl.program_id(0)
    n = gl.load(rows_ptr)
    c = 0
    cx = 0
    for i in range(gl.load(queue_ptr + worker), gl.load(queue_ptr + worker + 1)):
        kind, layer, a0, a1, a2, a3, wait, signal = task_row(tasks, gl.load(queue + i), True)
        if wait >= 0:
            target = gl.load(event_need + wait).to(gl.int64)
            seen = _acquire64(counters + wait)
            polls = 0
            while (seen < target) & (polls < POLL_LIMIT):
                seen = _acquire64(counters + wait)
                polls += 1
            cta_barrier()
        for seg in gl.static_range(2):
            which, w_row, rows, col = _segment(kind, layer, a0, a1, seg, H, D, HQ, HKV, INTER, QKV_PARTS, QKV_ID,
                                               OPROJ_ID, GATEUP_ID, DOWN_ID)
            if which == SEG_QKV:
                c, cx = _consume(xh_desc, 0, out_qkv, (HQ + 2 * HKV) * D, col, rows, n, H, 1.0, ring, ready, empty,
                                 xring, xready, c, cx, num_warps)
            elif which == SEG_O:
                c, cx = _consume(xa_desc, 0, out_o, H, col, rows, n, HQ * D, 1.0, ring, ready, empty, xring, xready,
                                 c, cx, num_warps)
            elif (which == SEG_GATE) | (which == SEG_UP):     # col tells gate's columns from up's
                c, cx = _consume(xh_desc, 0, out_gu, 2 * INTER, col, rows, n, H, 1.0, ring, ready, empty, xring,
                                 xready, c, cx, num_warps)
            elif which == SEG_DOWN:
                c, cx = _consume(xi_desc, 0, out_down, H, col, rows, n, INTER, 1.0, ring, ready, empty, xring, xready,
                                 c, cx, num_warps)
        if signal >= 0:
            cta_barrier()
            gl.atomic_add(counters + signal, 1, sem="release", scope="gpu")


@gluon.jit
def ring_matmuls(tasks, queue, queue_ptr, event_need, counters, rows_ptr, wqkv_desc, wo_desc, wg_desc, wu_desc,
                 wd_desc, xh_desc, xa_desc, xi_desc, out_qkv, out_o, out_gu, out_down, H: gl.constexpr,
                 D: gl.constexpr, HQ: gl.constexpr, HKV: gl.constexpr, INTER: gl.constexpr, QKV_PARTS: gl.constexpr,
                 BN: gl.constexpr, NBUF: gl.constexpr, XD: gl.constexpr, QKV_ID: gl.constexpr,
                 OPROJ_ID: gl.constexpr, GATEUP_ID: gl.constexpr, DOWN_ID: gl.constexpr, num_warps: gl.constexpr):
    """The matmul tasks of a task table (qkv, o_proj, gate_up, down; their epilogues aside: each writes its
    plain product, out = x @ W^T in float32) with the weight ring: benchmarks/stream.py runs the step's own
    tables through it, beside the megakernel."""
    ring, ready, empty, xring, xready = make_rings(wqkv_desc, xh_desc, BN, NBUF, XD)
    gl.warp_specialize([
        (_matmul_consumer, (tasks, queue, queue_ptr, event_need, counters, rows_ptr, xh_desc, xa_desc, xi_desc, out_qkv,
                            out_o, out_gu, out_down, ring, ready, empty, xring, xready, H, D, HQ, HKV, INTER,
                            QKV_PARTS, QKV_ID, OPROJ_ID, GATEUP_ID, DOWN_ID, num_warps)),
        (_matmul_producer, (tasks, queue, queue_ptr, wqkv_desc, wo_desc, wg_desc, wu_desc, wd_desc, ring, ready,
                            empty, H, D, HQ, HKV, INTER, QKV_PARTS, QKV_ID, OPROJ_ID, GATEUP_ID, DOWN_ID)),
    ], [1], [24])


def matmul_layouts(block_k: int, b_pad: int, box: int = 16):
    """Shared layouts of a weight box [box, block_k] and an input slice [b_pad, block_k] (NVMMA-swizzled)."""
    return (gl.NVMMASharedLayout.get_default_for([box, block_k], gl.bfloat16),
            gl.NVMMASharedLayout.get_default_for([b_pad, block_k], gl.bfloat16))


def compile_ring_matmuls(shape: dict, block_k: int = 256, stages: int = 4, x_stages: int = 4, b_pad: int = 16,
                         box: int = 16, arch: int = 90):
    """ring_matmuls compiled for `arch` without a GPU; `shape`: H, D, HQ, HKV, INTER, QKV_PARTS and the four
    task type ids."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    w_layout, x_layout = matmul_layouts(block_k, b_pad, box)
    w_desc = f"tensordesc<bf16[{box}, {block_k}],{w_layout!r}>"
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


# ---- Device helpers of the Gluon megakernel (kernels/ring_megakernel.py) and its tasks' `ring` functions -----
@gluon.constexpr_function
def rows_layout(num_warps):
    """The register layout of the tasks' elementwise work: a warp across 128 contiguous columns (16-byte
    accesses), the warps down the rows."""
    return gl.BlockedLayout([1, 4], [1, 32], [num_warps, 1], [1, 0])


@gluon.jit
def now_ns():
    return gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=gl.int64, is_pure=False, pack=1)


@gluon.jit
def sm_id():
    return gl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def fence_async_global():
    """Orders this thread's global memory accesses before later TMA (async proxy) ones: what other workers
    stored and this one acquired, or what this worker stored itself, reaches the TMA reads of it."""
    gl.inline_asm_elementwise("fence.proxy.async.global; mov.u32 $0, 0;", "=r", [], dtype=gl.int32, is_pure=False,
                              pack=1)


@gluon.jit
def wait_event(counter_ptr, target, abort_ptr, timeout_ns):
    """primitives.wait_event in Gluon: spin until *counter_ptr reaches target, at most timeout_ns or until a
    worker aborted the step; returns the last value seen minus target (negative: gave up)."""
    value = _acquire64(counter_ptr)
    deadline = now_ns() + timeout_ns
    aborted = _acquire64(abort_ptr)
    while (value - target < 0) & (aborted == 0) & (now_ns() < deadline):
        value = _acquire64(counter_ptr)
        aborted = _acquire64(abort_ptr)
    cta_barrier()
    if value - target < 0:          # one CTA, one verdict (see primitives.wait_event)
        value = _acquire64(counter_ptr)
    fence_async_global()
    return value - target


@gluon.jit
def signal_event(counter_ptr):
    fence_async_global()
    cta_barrier()           # every thread's stores of this task precede the release
    gl.atomic_add(counter_ptr, 1, sem="release", scope="gpu")


@gluon.constexpr_function
def next_power_of_2(n):
    return 1 << (int(n) - 1).bit_length()


@gluon.jit
def rms_norm_rows(x, n, norm_w, out, H: gl.constexpr, EPS: gl.constexpr, num_warps: gl.constexpr):
    """primitives.rms_norm_rows in Gluon: out[:n, :H] = RMSNorm(x[:n]) * norm_w, rounded once, into the worker's
    scratch rows that the tile's input slices are then copied from by TMA. A row at a time, the whole row in one
    load: no padded rows and one L2 round trip per row, where a [B_PAD, block] loop paid one per block."""
    HP: gl.constexpr = next_power_of_2(H)
    rh = gl.arange(0, HP, layout=gl.BlockedLayout([4], [32], [num_warps], [0]))
    w = gl.load(norm_w + rh, mask=rh < H, other=0.0).to(gl.float32)
    for b in range(n):
        v = gl.load(x + b * H + rh, mask=rh < H, other=0.0)
        rstd = gl.rsqrt(gl.sum(v * v, axis=0) / H + EPS)
        gl.store(out + b * H + rh, (v * rstd * w).to(out.dtype.element_ty), mask=rh < H)
    fence_async_global()
    cta_barrier()


@gluon.jit
def block_index(ring, xring, num_warps: gl.constexpr):
    """Row and batch indices of a matmul block's accumulator (mma_block's layout; the ring's padded batch)."""
    BN: gl.constexpr = ring.type.shape[1]
    B_PAD: gl.constexpr = xring.type.shape[1]
    layout: gl.constexpr = acc_layout(BN, B_PAD, num_warps)
    return (gl.arange(0, BN, layout=gl.SliceLayout(1, layout)), gl.arange(0, B_PAD, layout=gl.SliceLayout(0, layout)))


@gluon.jit
def add_residual_rows(x_desc, x_row, K: gl.constexpr, row0, rows, n, x, H: gl.constexpr, ring, ready, empty, xring,
                      xready, c, cx, num_warps: gl.constexpr):
    """x[:n, row0:row0 + rows] += x_in @ W[row0:row0 + rows]^T over the slots load_rows filled: the row-parallel
    o_proj and down tiles at tp=1. The residual is loaded before the products, so its round trip overlaps them."""
    BN: gl.constexpr = ring.type.shape[1]
    rn, rb = block_index(ring, xring, num_warps)
    for j in range(0, rows, BN):
        offs = rb[None, :] * H + (row0 + j + rn)[:, None]
        mask = (rn < rows - j)[:, None] & (rb < n)[None, :]
        residual = gl.load(x + offs, mask=mask, other=0.0)
        acc, c, cx = mma_block(x_desc, x_row, K, ring, ready, empty, xring, xready, c, cx, j > 0, j + BN < rows,
                               num_warps)
        gl.store(x + offs, (residual + acc).to(x.dtype.element_ty), mask=mask)
    return c, cx
