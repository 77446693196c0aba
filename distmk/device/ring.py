"""The Gluon (Hopper) pieces of the weight-ring megakernel (kernels/ring_megakernel.py) that the task types'
`ring` and `ring_weights` functions are written with.

A one-warp producer partition walks the program's weight tiles in the order the consumer will use them and
copies each by TMA into a shared-memory ring, guarded by mbarriers (`ready`: the copy landed, `empty`: the
consumer is done with the slot). Weights never depend on events, so the producer runs ahead through every
wait of the consumer, with a few slots in flight at a time while it fills the ring ahead of a task
(_claim_slot). The consumer (the default partition, one warpgroup) brings its input slices by TMA too, a few
ahead, and multiplies with wgmma (e4m3 weights converted in registers: mma.sync), the weight tile as the A
operand (M = tile rows) and the input slice as B (N = padded batch). Below them: the event wait and signal, the
RMSNorm's scale of the residual stream, index helpers.
GPU only (Gluon has no interpreter); CI compiles the kernels that use them for sm_90.
"""
from __future__ import annotations

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)

from distmk.models import fp8

# Gluon moves between releases: the CTA-wide barrier is thread_barrier on Triton 3.6 (the GPU image's), barrier
# from 3.7 on
cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier
# and the TMA load into shared memory async_copy_global_to_shared on 3.6, async_load from 3.7 on
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared


# and shared memory seen as another type and shape is _reinterpret on 3.6, reinterpret from 3.7 on: one name here
if not hasattr(gl.shared_memory_descriptor, "reinterpret"):
    gl.shared_memory_descriptor.reinterpret = gl.shared_memory_descriptor._reinterpret


PART = gl.constexpr(128)        # a block scale's columns: the e4m3 loops convert one part at a time


@gluon.jit
def as_boxes(smem, desc, N: gl.constexpr):
    """Shared memory seen as N boxes of a descriptor's."""
    return smem.reinterpret(smem.dtype, [N] + desc.block_type.shape, desc.layout)


@gluon.jit
def make_rings(w_desc, x_desc, BN: gl.constexpr, NBUF: gl.constexpr, XD: gl.constexpr, SLOT_K: gl.constexpr = 0,
               CONSUMERS: gl.constexpr = 1):
    """The weight ring (NBUF slots of BN rows) and the input ring (XD slices) in shared memory, with their
    mbarriers: ready/empty per weight slot (empty: once each of CONSUMERS partitions released it), ready per input
    slice. A slot holds as many bytes a row as SLOT_K bf16 columns (0: an input slice's): its columns in bf16
    weights, twice as many in e4m3 ones (mma_block_fp8); an input slice is one slot or several (mma_block)."""
    SLOT: gl.constexpr = SLOT_K if SLOT_K > 0 else x_desc.block_type.shape[1]
    BK: gl.constexpr = SLOT * 2 // w_desc.dtype.itemsize    # a weight box is narrower
    ring = gl.allocate_shared_memory(w_desc.dtype, [NBUF, BN, BK], w_desc.layout)
    xring = gl.allocate_shared_memory(x_desc.dtype, [XD] + x_desc.block_type.shape, x_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    xready = gl.allocate_shared_memory(gl.int64, [XD, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NBUF):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=CONSUMERS)
    for i in gl.static_range(XD):
        mbarrier.init(xready.index(i), count=1)
    fence_async_shared()
    return ring, ready, empty, xring, xready


@gluon.jit
def make_xq(xring):
    """W8A8's double buffer of quantized input slices (_quantize_slice): e4m3 [2 * SUB, B_PAD, 128] (a slice of SUB
    128-column parts), and their scales, float32 [2 * SUB, B_PAD]."""
    B_PAD: gl.constexpr = xring.type.shape[1]
    SUB: gl.constexpr = xring.type.shape[2] // PART
    xq = gl.allocate_shared_memory(gl.float8e4nv, [2 * SUB, B_PAD, PART],
                                   gl.NVMMASharedLayout.get_default_for([B_PAD, PART], gl.float8e4nv))
    xq_scale = gl.allocate_shared_memory(gl.float32, [2 * SUB, B_PAD], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    return xq, xq_scale


@gluon.jit
def make_handoff():
    """The mbarrier the tasks partition arrives on after signalling a task that read weights: the producer begins
    the next such task's weights after it (wait_handoff), so the release is not issued behind their copies."""
    released = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    mbarrier.init(released.index(0), count=1)
    fence_async_shared()
    return released


@gluon.jit
def wait_handoff(released, fed):
    """Producer: before the weights of its `fed`-th task that reads any, wait until the tasks partition has
    signalled the one before. It is never more than one phase ahead (it needs this task's weights to get further),
    so the phase parity cannot alias."""
    mbarrier.wait(released.index(0), (fed - 1) & 1, pred=fed > 0)


@gluon.jit
def make_count_handoff():
    """Where the producer hands the tasks partition the count it read before a routed task's weights (the route's
    distinct experts, tasks/route.py routed_experts): an int in shared memory and its mbarrier."""
    count = gl.allocate_shared_memory(gl.int32, [1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    mbarrier.init(bar.index(0), count=1)
    fence_async_shared()
    return count, bar


@gluon.jit
def publish_count(count, bar, value):
    """Producer (one warp): hand over `value`. The tasks partition has taken the previous one: the producer begins
    a task's weights only after the tasks partition signalled the task before (wait_handoff)."""
    count.store(gl.full([1], value, gl.int32, layout=gl.BlockedLayout([1], [32], [1], [0])))
    cta_barrier()
    mbarrier.arrive(bar.index(0), count=1)


@gluon.jit
def take_count(count, bar, taken, num_warps: gl.constexpr):
    """Tasks partition: the producer's `taken`-th count."""
    mbarrier.wait(bar.index(0), taken & 1)
    return gl.max(count.load(gl.BlockedLayout([1], [32], [num_warps], [0])), axis=0)


@gluon.jit
def _expect_pieces(bar, boxes, PIECES: gl.constexpr, desc, MOST: gl.constexpr):
    """The slot's mbarrier expects `boxes` boxes of rows of PIECES copies of the descriptor each (expect takes a
    constant byte count)."""
    for nb in gl.static_range(1, MOST + 1):
        mbarrier.expect(bar, nb * PIECES * desc.block_type.nbytes, pred=boxes == nb)


@gluon.jit
def _claim_slot(ready, empty, c, first, NBUF: gl.constexpr, INFLIGHT: gl.constexpr):
    """Producer: wait until slot c, of a task whose first slot is `first`, may be copied into: the consumer freed
    it, and (INFLIGHT > 0) while the ring fills ahead of the task (its first NBUF slots, copied while the task may
    still wait for its event) the copies of slot c - INFLIGHT have landed, so that at most INFLIGHT slots of this
    worker are in flight. A ring filling at full depth on every worker queues the task's event poll and first input
    copies behind up to 160 KB a worker, delaying most the tiles whose rows fill a slot (QKV, gate/up) rather
    than half of one (o_proj, down); past the fill the stream runs
    uncapped. Slot c - INFLIGHT is refilled only after slot c is issued, so its phase cannot alias."""
    s = c % NBUF
    mbarrier.wait(empty.index(s), ((c // NBUF) & 1) ^ 1)              # slots start free (phase 1 done)
    if (INFLIGHT > 0) & (INFLIGHT < NBUF):
        landed = gl.maximum(c - INFLIGHT, 0)
        mbarrier.wait(ready.index(landed % NBUF), (landed // NBUF) & 1, pred=(c >= INFLIGHT) & (c < first + NBUF))
    return s


@gluon.jit
def weight_view(ring, w_desc):
    """The ring (allocated for bf16 weights: make_rings) as slots of w_desc's element type: an e4m3 slot holds the
    same bytes, twice the columns."""
    if w_desc.dtype == ring.dtype:
        view = ring
    else:
        view = ring.reinterpret(w_desc.dtype, [ring.type.shape[0], ring.type.shape[1],
                                               ring.type.shape[2] * ring.dtype.itemsize // w_desc.dtype.itemsize],
                                w_desc.layout)
    return view


@gluon.jit
def layer_scales(w_scale, layer, ROWS: gl.constexpr, K: gl.constexpr):
    """Layer `layer`'s block scales of a stacked [layers, ROWS, K] weight (kernels/layout.py: [layers, ROWS / 128,
    K / 128])."""
    return w_scale + layer * ((ROWS + 127) // 128) * ((K + 127) // 128)


@gluon.jit
def mma_rows(w_desc, w_scale, w_row, rows, x_desc, x_row, K: gl.constexpr, ring, ready, empty, xring, xready, c, cx,
             primed, chained, num_warps: gl.constexpr, PACK: gl.constexpr = False):
    """A block of rows w_row.. of a matrix (of `rows` left) times the input, by mma_block, or by mma_block_fp8 where
    w_desc streams e4m3 weights (w_scale: the matrix's block scales; PACK: load_block's)."""
    if w_desc.dtype.itemsize == 1:
        acc, c, cx = mma_block_fp8(x_desc, x_row, K, w_scale, w_row, rows, weight_view(ring, w_desc), ready, empty,
                                   xring, xready, c, cx, primed, chained, num_warps, PACK=PACK)
    else:
        acc, c, cx = mma_block(x_desc, x_row, K, ring, ready, empty, xring, xready, c, cx, primed, chained, num_warps)
    return acc, c, cx


@gluon.jit
def gate_and_up(gate_desc, up_desc, gate_scales, up_scales, w_row, rows, x_desc, K: gl.constexpr, ring, ready, empty,
                xring, xready, c, cx, chained, num_warps: gl.constexpr):
    """The gate and the up projection's blocks of rows w_row.., each of `rows` left (the producer copies both into
    the ring, gate's first), by one mma_rows call site in a loop of two (the matmul loop is inlined wherever it is
    called: benchmarks/code_size.py). `chained`: whether a block follows them."""
    gl.static_assert(gate_desc.dtype == up_desc.dtype, "gate and up stream in one type: one call multiplies both")
    BN: gl.constexpr = ring.type.shape[1]
    B_PAD: gl.constexpr = xring.type.shape[1]
    gate = gl.zeros([BN, B_PAD], gl.float32, layout=acc_layout(BN, B_PAD, num_warps))
    acc = gate
    for part in range(2):
        scales = up_scales if part == 1 else gate_scales
        acc, c, cx = mma_rows(gate_desc, scales, w_row, rows, x_desc, 0, K, ring, ready, empty, xring, xready, c, cx,
                              True, (part == 0) | chained, num_warps)
        gate = gl.where(part == 0, acc, gate)
    return gate, acc, c, cx


@gluon.constexpr_function
def packs_halves(w_dtype, rows, K, ring_type):
    """Whether blocks of at most `rows` rows of a matrix of K columns (of w_dtype) stream two column ranges a slot of
    the ring (of ring_type), one in each half (load_block, mma_block_fp8): an e4m3 slot costs its conversion to bf16
    whatever rows it holds, so a block of half a slot (the row-parallel tiles at tp=1) would convert as much padding
    as weights. A compile-time choice: Triton 3.6 cannot build the W8A16 loop under a branch taken at run time."""
    slot_bytes = ring_type.shape[2] * ring_type.element_ty.primitive_bitwidth // 8
    return w_dtype.primitive_bitwidth == 8 and rows <= ring_type.shape[1] // 2 and K % (2 * slot_bytes) == 0


@gluon.jit
def load_block(desc, row0, rows, K: gl.constexpr, ring, ready, empty, c, first, INFLIGHT: gl.constexpr,
               PACK: gl.constexpr = False):
    """Producer: the ring slots of one block of `rows` (<= BN) weight rows from row0, BK columns at a time, in
    boxes of the descriptor's rows, each copied as soon as the consumer frees its slot (and, while the ring
    fills ahead of the task whose first slot is `first`, at most INFLIGHT slots are in flight: _claim_slot);
    returns the slots filled so far. A slot's rows past the block keep an earlier block's weights: consumers never
    store them. The descriptor's box is [16 rows, one 128-byte swizzle line of columns], one TMA copy, all issued
    from one loop: boxes as wide as the slot were a copy per 128 bytes, unrolled at every call (96 copy sites, 22 KB
    of qwen3-30b-a3b's kernel; a kernel's code is time of its latency-bound tasks: benchmarks/code_size.py). PACK
    (packs_halves): the slot's bottom half holds the block's rows again, each swizzle line of the slot the next
    line of columns of the top half's: a line is then two 128-column parts of the input, its top rows times one and
    its bottom rows times the next (_w8a16_packed)."""
    ring = weight_view(ring, desc)
    NBUF: gl.constexpr = ring.type.shape[0]
    BN: gl.constexpr = ring.type.shape[1]
    BK: gl.constexpr = ring.type.shape[2]
    BOX: gl.constexpr = desc.block_type.shape[0]
    LINE: gl.constexpr = desc.block_type.shape[1]
    LINES: gl.constexpr = BK // LINE
    MOST: gl.constexpr = BN // BOX
    gl.static_assert((LINE * desc.dtype.itemsize == 128) | (MOST == 1),
                     "a weight box is one swizzle line wide or a whole slot")
    gl.static_assert((BOX * 2 <= BN) | (not PACK), "a slot's halves are whole boxes")
    # the slot is laid out a swizzle line of columns after another ([LINES, BN, LINE]): as boxes, [line, box]
    boxes_of = as_boxes(ring, desc, NBUF * LINES * MOST)
    HALVES: gl.constexpr = 2 if PACK else 1       # PACK: the bottom half holds the block's next columns
    boxes = (gl.minimum(rows, BN) + BOX - 1) // BOX
    for k in range(0, K, HALVES * BK):
        s = _claim_slot(ready, empty, c, first, NBUF, INFLIGHT)
        _expect_pieces(ready.index(s), HALVES * boxes, LINES, desc, MOST)
        for half in gl.static_range(HALVES):
            for piece in range(boxes * LINES):
                line = piece % LINES
                box = piece // LINES
                tma_load(desc, [row0 + box * BOX, k + (line * HALVES + half) * LINE], ready.index(s),
                         boxes_of.index((s * LINES + line) * MOST + half * (MOST // 2) + box))
        c += 1
    return c


@gluon.jit
def _first_inputs(x_desc, x_row, KT: gl.constexpr, xring, xready, cx, issue):
    """TMA copies of a block's first XD - 1 input slices (those of them it has), where `issue`."""
    XD: gl.constexpr = xring.type.shape[0]
    BK: gl.constexpr = xring.type.shape[2]
    for p in gl.static_range(XD - 1):
        slot = (cx + p) % XD
        first = (p < KT) & issue
        mbarrier.expect(xready.index(slot), x_desc.block_type.nbytes, pred=first)
        tma_load(x_desc, [x_row, (p % KT) * BK], xready.index(slot), xring.index(slot), pred=first)


@gluon.jit
def prime_inputs(x_desc, x_row, K: gl.constexpr, xring, xready, cx):
    """Consumer: issue the first input slices of a task's first block before mma_block(primed=1) runs it, so that
    their round trip overlaps what the task does in between (norm_rstd's loads)."""
    XD: gl.constexpr = xring.type.shape[0]
    BK: gl.constexpr = xring.type.shape[2]
    KT: gl.constexpr = K // BK
    _first_inputs(x_desc, x_row, KT, xring, xready, cx, KT >= XD - 1)    # else mma_block issues them itself


@gluon.jit
def _refill_input(x_desc, x_row, KT: gl.constexpr, xring, xready, cx, it, chained, CHAIN: gl.constexpr, pred=True):
    """At input slice `it` of a block, once slice it - 1's product is done: the TMA copy of slice it + XD - 1 into its
    slot, or (a `chained` block, past its own slices) of the next block's first ones; none unless `pred`."""
    XD: gl.constexpr = xring.type.shape[0]
    BK: gl.constexpr = xring.type.shape[2]
    ahead = it + XD - 1
    slot = (cx + ahead) % XD
    issue = ((ahead < KT) | (CHAIN & (chained != 0) & (ahead - KT < KT))) & pred
    mbarrier.expect(xready.index(slot), x_desc.block_type.nbytes, pred=issue)
    tma_load(x_desc, [x_row, (ahead % KT) * BK], xready.index(slot), xring.index(slot), pred=issue)


@gluon.jit
def mma_block(x_desc, x_row, K: gl.constexpr, ring, ready, empty, xring, xready, c, cx, primed, chained,
              num_warps: gl.constexpr):
    """Consumer: acc[BN, B_PAD] = W_block @ x[x_row:x_row + B_PAD, :K]^T in float32 over the ring's next slots (as
    load_block filled them): one wgmma a slot, one in flight while the next slot is waited for. The input slices
    (a slot's columns, or several slots') come by TMA, XD - 1 ahead, issued here because they may depend on the
    event just waited for. Blocks of one task read the same input: a `chained` block goes on issuing the next
    block's first slices (from its own last ones), so the next, `primed`, block starts without a round trip for
    its input. Returns the accumulator and the slots and input slices used so far."""
    NBUF: gl.constexpr = ring.type.shape[0]
    BN: gl.constexpr = ring.type.shape[1]
    XD: gl.constexpr = xring.type.shape[0]
    B_PAD: gl.constexpr = xring.type.shape[1]
    KT: gl.constexpr = K // xring.type.shape[2]
    # a block of fewer than XD - 1 slices cannot issue all of the next block's first ones: no chaining then
    CHAIN: gl.constexpr = KT >= XD - 1
    _first_inputs(x_desc, x_row, KT, xring, xready, cx, (primed == 0) | (not CHAIN))
    acc = gl.zeros([BN, B_PAD], gl.float32, layout=acc_layout(BN, B_PAD, num_warps))
    for it in range(K // ring.type.shape[2]):
        s = c % NBUF
        mbarrier.wait(ready.index(s), (c // NBUF) & 1)
        acc = _mma_part(ring.index(s), acc, x_desc, x_row, KT, xring, xready, cx, it, chained, CHAIN)
        # the previous wgmma is done: its weight slot goes back to the producer
        mbarrier.arrive(empty.index((c + NBUF - 1) % NBUF), count=1, pred=it > 0)
        c += 1
    acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
    mbarrier.arrive(empty.index((c + NBUF - 1) % NBUF), count=1)
    return acc, c, cx + KT


@gluon.jit
def _dequantized(half, scale, operand: gl.constexpr):
    """An e4m3 [rows, 128] part, its columns in the ring's order (part_columns), times its rows' block scale (a bf16
    value: models/fp8.py bf16_scales), rounded once to bf16, in the mma operand layout. A thread's 32 values of a
    row are 32 consecutive bytes in that order: two 16-byte shared loads a row (part_layout) rather than sixteen of
    two bytes. Converted by integer operations rather than conversion instructions: each 4 bytes become two pairs of
    bf16 holding e4m3's fields (prmt spreads the bytes and replicates their signs, the shift and mask place sign,
    exponent and mantissa: the value times 2^-120, the two biases' difference, subnormals included), then one bf16
    multiply by the scale times 2^120. Reshaped from the load's order to the columns' own, which moves no data:
    the two layouts hold the same registers."""
    ROWS: gl.constexpr = half.type.shape[0]
    raw = half.load(part_layout(ROWS, gl.num_warps())).to(gl.int8, bitcast=True)
    bits = gl.inline_asm_elementwise(E4M3_QUAD_AS_BF16, "=r,=r,r", [raw], dtype=gl.bfloat16, is_pure=True, pack=4)
    # stored column p = (b6 .. b0) is column (b4 b3 b2 b1 b6 b5 b0) (part_columns)
    bits = gl.permute(gl.reshape(bits, [ROWS, 2, 2, 2, 2, 2, 2, 2]), [0, 3, 4, 5, 6, 1, 2, 7])
    bits = gl.convert_layout(gl.reshape(bits, [ROWS, PART]), operand)
    return bits * (scale * 2.0 ** 120).to(gl.bfloat16)[:, None]


# four e4m3 bytes (a 32-bit register) -> two bf16 pairs times 2^-120: bytes b0, sign(b0), b1, sign(b1) (and b2, b3
# alike), shifted left 4, masked to each half's sign, exponent and mantissa bits
E4M3_QUAD_AS_BF16 = gl.constexpr(
    "{ .reg .b32 lo, hi; prmt.b32 lo, $2, 0, 0x9180; prmt.b32 hi, $2, 0, 0xB3A2; shl.b32 lo, lo, 4; "
    "shl.b32 hi, hi, 4; and.b32 $0, lo, 0x87f087f0; and.b32 $1, hi, 0x87f087f0; }")


@gluon.constexpr_function
def part_layout(rows, num_warps):
    """The register layout _dequantized loads a part with: the mma operand layout of its [rows, 128] bf16 values
    (sync_mma_layout's or acc_layout's, k_width 2: the same registers) with a thread's columns of a row side by side
    in the ring's column order. In that operand layout a thread of lane l holds rows l / 4 (+ 8, + 16 w for warp w,
    + 64 r) and, a row, columns 16 j + 8 h + 2 (l % 4) + s for j < 8, h, s < 2: stored at 32 (l % 4) + 4 j + 2 h + s
    (part_columns)."""
    assert num_warps == 4 and rows % 64 == 0, "a warpgroup's parts of 64 rows"
    more_rows = [[r, 0] for r in (64, 128, 256) if r < rows]
    return gl.DistributedLinearLayout(reg_bases=[[0, 1], [0, 2], [8, 0], [0, 4], [0, 8], [0, 16]] + more_rows,
                                      lane_bases=[[0, 32], [0, 64], [1, 0], [2, 0], [4, 0]],
                                      warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[rows, 128])


def part_columns() -> list[int]:
    """The order the ring holds each 128 columns of e4m3 weights in (RankWeights.order_fp8): stored column p, of bits
    b6 .. b0, is column b0 + 2 b5 + 4 b6 + 8 (b1 + 2 b2 + 4 b3 + 8 b4), the order of a thread's operand values
    (part_layout)."""
    return [(p & 1) | (p >> 5 & 3) << 1 | (p >> 1 & 15) << 3 for p in range(128)]


@gluon.jit
def _next_slice(x_desc, x_row, KT: gl.constexpr, xring, xready, cx, it, chained, CHAIN: gl.constexpr):
    """Wait for input slice `it` and refill the slot of slice it - 1 (its product is done); returns slice it's
    slot."""
    XD: gl.constexpr = xring.type.shape[0]
    xs = (cx + it) % XD
    mbarrier.wait(xready.index(xs), ((cx + it) // XD) & 1)
    _refill_input(x_desc, x_row, KT, xring, xready, cx, it, chained, CHAIN)
    return xs


@gluon.jit
def mma_block_fp8(x_desc, x_row, K: gl.constexpr, scale, row0, rows, ring, ready, empty, xring, xready, c, cx, primed,
                  chained, num_warps: gl.constexpr, xq=None, xq_scale=None, PACK: gl.constexpr = False):
    """mma_block over e4m3 weights whose 128 x 128 blocks each have a float32 scale (models/fp8.py; `scale`: the
    matrix's grid [ceil(R / 128), K / 128], `row0`: the block's first row, of `rows`). A slot holds 128-column parts
    (make_rings), an input slice one part or two. W8A16: the slot dequantized to bf16 in registers a part (one block
    scale a row) at a time, as the reference's weights are (_w8a16_block). With `xq` and `xq_scale` (make_xq), W8A8:
    the input quantized to e4m3 with a scale a row and part, and the e4m3 wgmma straight from the slot
    (_w8a8_block). PACK (W8A16, a block of half a slot): the slot's bottom half holds further columns
    of the block (load_block, _w8a16_packed)."""
    BN: gl.constexpr = ring.type.shape[1]
    XD: gl.constexpr = xring.type.shape[0]
    B_PAD: gl.constexpr = xring.type.shape[1]
    BK: gl.constexpr = xring.type.shape[2]
    gl.static_assert((BK == 128) | (BK == 256), "e4m3 weights take input slices of 128 or 256 columns")
    KT: gl.constexpr = K // BK
    CHAIN: gl.constexpr = KT >= XD - 1
    _first_inputs(x_desc, x_row, KT, xring, xready, cx, (primed == 0) | (not CHAIN))
    layout: gl.constexpr = acc_layout(BN, B_PAD, num_warps)
    rn = gl.arange(0, BN, layout=gl.SliceLayout(1, layout))
    row = rn % (BN // 2) if PACK else rn        # PACK: the bottom half holds the block's rows again (load_block)
    valid = row < rows
    scales = scale + ((row0 + row) // 128) * (K // 128)     # each row's scales, one a 128-column part
    if xq is None:
        if PACK:        # the bottom half's columns are a part further
            acc, c = _w8a16_packed(x_desc, x_row, KT, scales + rn // (BN // 2), valid, ring, ready, empty,
                                   xring, xready, c, cx, chained, CHAIN, layout)
        else:
            acc, c = _w8a16_block(x_desc, x_row, KT, scales, valid, ring, ready, empty, xring, xready, c, cx,
                                  chained, CHAIN, layout)
    else:
        acc, c = _w8a8_block(x_desc, x_row, KT, scales, valid, ring, ready, empty, xring, xready, xq, xq_scale, c, cx,
                             chained, CHAIN, layout, num_warps)
    return acc, c, cx + KT


@gluon.jit
def _mma_part(a, acc, x_desc, x_row, KT: gl.constexpr, xring, xready, cx, q, chained, CHAIN: gl.constexpr):
    """acc += weight slot a @ part q of the input, an input slice SUB slots' columns: part q % SUB of slice q // SUB.
    Its wgmma is left in flight once the one before is done: then, at a slice's first part, the slot of the slice
    before is refilled."""
    XD: gl.constexpr = xring.type.shape[0]
    B_PAD: gl.constexpr = xring.type.shape[1]
    A_K: gl.constexpr = a.type.shape[1]
    SUB: gl.constexpr = xring.type.shape[2] // A_K
    parts = xring.reinterpret(xring.dtype, [XD * SUB, B_PAD, A_K], xring.layout)    # a slice: [SUB, B_PAD, A_K]
    it = q // SUB
    xs = (cx + it) % XD
    first = q % SUB == 0
    mbarrier.wait(xready.index(xs), ((cx + it) // XD) & 1, pred=first)
    acc = warpgroup_mma(a, parts.index(xs * SUB + q % SUB).permute((1, 0)), acc, use_acc=q > 0, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=1, deps=[acc])
    _refill_input(x_desc, x_row, KT, xring, xready, cx, it, chained, CHAIN, first)
    return acc


@gluon.constexpr_function
def sync_mma_layout(num_warps):
    """The accumulator layout of the W8A16 loops' mma.sync (m16n8k16, a warp's 16 weight rows along M, the padded
    batch along N): each warp multiplies the part it converted on its own, with no warpgroup-wide wgmma holding its
    registers. Its A operand (k_width 2) holds the same registers as the wgmma's."""
    return gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, 8])


@gluon.jit
def _slice_taken(x_desc, x_row, KT: gl.constexpr, xring, xready, cx, it, chained, CHAIN: gl.constexpr, empty, c,
                 QT: gl.constexpr, PARTS: gl.constexpr, REFILL: gl.constexpr = True):
    """At input slice `it` of a W8A16 loop: once every warp has slice it - 1's input and weight parts in registers
    (an mma.sync warp runs apart from the others: a barrier), the weight slots whose last part was in it go back to
    the producer and (REFILL) the input slot is refilled (_refill_input)."""
    NBUF: gl.constexpr = empty.type.shape[0]
    SUB: gl.constexpr = xring.type.shape[2] // PART
    cta_barrier()
    for p in gl.static_range(SUB):
        q = (it - 1) * SUB + p
        last = (q % PARTS == PARTS - 1) | (q + 1 == QT)
        mbarrier.arrive(empty.index((c + q // PARTS) % NBUF), count=1, pred=(it > 0) & last)
    if REFILL:
        _refill_input(x_desc, x_row, KT, xring, xready, cx, it, chained, CHAIN)


@gluon.jit
def _group_taken(x_desc, x_row, KT: gl.constexpr, xring, xready, cx, it, G: gl.constexpr, chained,
                 CHAIN: gl.constexpr, empty, slot0, SLOTS: gl.constexpr, release):
    """At input slice `it`, the first of a group of G (a W8A16 loop of slices of whole slots): once every warp has the
    group before in registers (one barrier), its SLOTS weight slots from slot0 go back to the producer (where
    `release`) and its G input slots are refilled (_refill_input of slices it - G + 1 .. it, of the block's)."""
    NBUF: gl.constexpr = empty.type.shape[0]
    gl.static_assert(G <= xring.type.shape[0], "a group's input slices are in the input ring at once")
    cta_barrier()
    for k in gl.static_range(SLOTS):
        mbarrier.arrive(empty.index((slot0 + k) % NBUF), count=1, pred=release)
    for r in gl.static_range(G):
        ahead = it - G + 1 + r
        _refill_input(x_desc, x_row, KT, xring, xready, cx, ahead, chained, CHAIN, (ahead >= 0) & (ahead < KT))


@gluon.jit
def _input_part(xring, xready, cx, it, sub, layout: gl.constexpr):
    """Part `sub` of input slice `it` (waited for at its first part), [128, padded batch] in `layout`."""
    XD: gl.constexpr = xring.type.shape[0]
    B_PAD: gl.constexpr = xring.type.shape[1]
    SUB: gl.constexpr = xring.type.shape[2] // PART
    parts = xring.reinterpret(xring.dtype, [XD * SUB, B_PAD, PART], xring.layout)
    xs = (cx + it) % XD
    if sub == 0:
        mbarrier.wait(xready.index(xs), ((cx + it) // XD) & 1)
    return parts.index(xs * SUB + sub).permute((1, 0)).load(layout)


@gluon.jit
def _w8a16_part(weights, q, it, sub: gl.constexpr, scale, scales, valid, QT: gl.constexpr, xring, xready, cx, even,
                odd):
    """Part q of a block (its weights, of part `sub` of input slice `it`) dequantized with its rows' `scale` and
    multiplied into the even or the odd accumulator (by sub); returns them and part q + 1's scales, loaded first so
    that their round trip overlaps the conversion."""
    mma: gl.constexpr = sync_mma_layout(gl.num_warps())
    next_scale = gl.load(scales + q + 1, mask=valid & (q + 1 < QT), other=0.0)
    a = _dequantized(weights, scale, gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2))
    b = _input_part(xring, xready, cx, it, sub, gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2))
    if sub % 2 == 0:
        even = mma_v2(a, b, even)
    else:
        odd = mma_v2(a, b, odd)
    return even, odd, next_scale


@gluon.jit
def _w8a16_block(x_desc, x_row, KT: gl.constexpr, scales, valid, ring, ready, empty, xring, xready, c, cx, chained,
                 CHAIN: gl.constexpr, layout: gl.constexpr):
    """mma_block_fp8's loop, the weights dequantized to bf16 in registers a 128-column part at a time (its rows'
    scales loaded a part ahead) and multiplied by mma.sync, a slice's even and odd parts into accumulators of their
    own. The loop walks input slices and writes out each of a slice's parts, so that which part of the slice it
    reads is known at compile time (chosen at run time, it slowed the loop more than the code it saves). Slices of
    whole slots go in groups of two slots: one barrier, release and refill a group (_group_taken) rather than a
    slice, each of them costing the warp a CTA barrier; longer groups made the loop faster alone and the step slower,
    as the loop is inlined at every matmul call site and a kernel's code is time of its latency-bound tasks
    (benchmarks/code_size.py)."""
    NBUF: gl.constexpr = ring.type.shape[0]
    BN: gl.constexpr = ring.type.shape[1]
    PARTS: gl.constexpr = ring.type.shape[2] // PART        # a slot's
    SUB: gl.constexpr = xring.type.shape[2] // PART          # an input slice's
    QT: gl.constexpr = KT * SUB                               # the block's
    B_PAD: gl.constexpr = xring.type.shape[1]
    mma: gl.constexpr = sync_mma_layout(gl.num_warps())
    operand: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    parts = ring.reinterpret(ring.dtype, [NBUF * PARTS, BN, PART], ring.layout)     # a slot: [PARTS, BN, PART]
    scales = gl.convert_layout(scales, gl.SliceLayout(1, operand))
    valid = gl.convert_layout(valid, gl.SliceLayout(1, operand))
    scale = gl.load(scales, mask=valid, other=0.0)
    even = gl.zeros([BN, B_PAD], gl.float32, layout=mma)
    odd = gl.zeros([BN, B_PAD], gl.float32, layout=mma)
    # groups of two slots (of one where the block has an odd number)
    G: gl.constexpr = 2 if (SUB % PARTS == 0) & (KT % 2 == 0) else 1
    if SUB % PARTS == 0:
        SLOTS: gl.constexpr = G * SUB // PARTS
        for g in range(KT // G):
            _group_taken(x_desc, x_row, KT, xring, xready, cx, g * G, G, chained, CHAIN, empty, c + (g - 1) * SLOTS,
                         SLOTS, g > 0)
            for r in gl.static_range(G):
                it = g * G + r
                for sub in gl.static_range(SUB):
                    q = it * SUB + sub
                    slot = c + q // PARTS
                    s = slot % NBUF
                    if sub % PARTS == 0:
                        mbarrier.wait(ready.index(s), (slot // NBUF) & 1)
                    even, odd, scale = _w8a16_part(parts.index(s * PARTS + q % PARTS), q, it, sub, scale, scales,
                                                   valid, QT, xring, xready, cx, even, odd)
        _group_taken(x_desc, x_row, KT, xring, xready, cx, KT, G, chained, CHAIN, empty, c + (KT // G - 1) * SLOTS,
                     SLOTS, True)
    else:
        for it in range(KT):
            for sub in gl.static_range(SUB):        # the part of the input slice known at compile time
                q = it * SUB + sub
                if sub == 0:
                    _slice_taken(x_desc, x_row, KT, xring, xready, cx, it, chained, CHAIN, empty, c, QT, PARTS)
                slot = c + q // PARTS
                s = slot % NBUF
                mbarrier.wait(ready.index(s), (slot // NBUF) & 1, pred=q % PARTS == 0)
                even, odd, scale = _w8a16_part(parts.index(s * PARTS + q % PARTS), q, it, sub, scale, scales, valid,
                                               QT, xring, xready, cx, even, odd)
        _slice_taken(x_desc, x_row, KT, xring, xready, cx, KT, chained, CHAIN, empty, c, QT, PARTS, False)
    return gl.convert_layout(even + odd, layout), c + (QT + PARTS - 1) // PARTS


@gluon.constexpr_function
def paired_mma_layout(num_warps):
    """The accumulator layout of _w8a16_packed's batched mma.sync ([2, rows, padded batch]): half of the warps
    multiply a slot part's top rows by one input part, the other half its bottom rows by the next. Its A operand
    holds the registers of sync_mma_layout's over the slot part's [2 x rows, 128]."""
    return gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[2, num_warps // 2, 1], instr_shape=[1, 16, 8])


@gluon.constexpr_function
def _part_pairs(layout, rows):
    """The input ring's [slices, 2, rows, 128] view (an input slice of two 128-column parts): each part held as the
    ring's NVMMA layout (128-byte swizzle, bf16) holds [rows, 128] there, 64-column halves one after the other, the
    second part after the first. An NVMMA layout of rank 3 would interleave the parts' halves."""
    assert layout.swizzle_byte_width == 128 and layout.element_bitwidth == 16 and not layout.transposed, \
        f"input slices in a 128-byte-swizzled bf16 layout (matmul_layouts), not {layout}"
    bases = [[0, 0, 1 << i] for i in range(6)] + [[0, 1 << i, 8 << i] for i in range(3)]
    bases += [[0, r, 0] for r in (8, 16, 32, 64) if r < rows] + [[0, 0, 64], [1, 0, 0]]
    return gl.SharedLinearLayout(offset_bases=bases, alignment=1024)


@gluon.jit
def _input_pair(xring, xready, cx, hh, layout: gl.constexpr):
    """Input parts 2 hh and 2 hh + 1, waited for, as the [2, 128, padded batch] B operand of `layout`
    (paired_mma_layout): slice hh's two, a warp loading its half's part; or, where a slice is one part, slices 2 hh
    and 2 hh + 1 (which may wrap around the ring), every warp loading both and keeping its own."""
    XD: gl.constexpr = xring.type.shape[0]
    B_PAD: gl.constexpr = xring.type.shape[1]
    SUB: gl.constexpr = xring.type.shape[2] // PART
    operand: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=layout, k_width=2)
    if SUB == 2:
        xs = (cx + hh) % XD
        mbarrier.wait(xready.index(xs), ((cx + hh) // XD) & 1)
        pair = xring.reinterpret(xring.dtype, [XD, 2, B_PAD, PART], _part_pairs(xring.layout, B_PAD)).index(xs)
        return pair.permute((0, 2, 1)).load(operand)
    else:
        half = gl.arange(0, 2, layout=gl.SliceLayout(1, gl.SliceLayout(2, operand)))[:, None, None]
        one = _input_part(xring, xready, cx, 2 * hh, 0, gl.SliceLayout(0, operand))
        other = _input_part(xring, xready, cx, 2 * hh + 1, 0, gl.SliceLayout(0, operand))
        return gl.where(half == 0, gl.expand_dims(one, 0), gl.expand_dims(other, 0))


@gluon.jit
def _w8a16_packed(x_desc, x_row, KT: gl.constexpr, scales, valid, ring, ready, empty, xring, xready, c, cx, chained,
                  CHAIN: gl.constexpr, layout: gl.constexpr):
    """_w8a16_block over slots whose bottom half holds the block's rows again (load_block): a 128-column part of the
    slot, converted once, is two parts of the input, its top rows' product with the first and its bottom rows' with
    the second one batched mma.sync (paired_mma_layout: each warp multiplies its own rows by its own half's part),
    the halves summed at the end. A slot takes two input slices' worth of parts or more: its barrier, release and
    refills are one group (_group_taken)."""
    NBUF: gl.constexpr = ring.type.shape[0]
    BN: gl.constexpr = ring.type.shape[1]
    PARTS: gl.constexpr = ring.type.shape[2] // PART
    SUB: gl.constexpr = xring.type.shape[2] // PART
    QT: gl.constexpr = KT * SUB
    B_PAD: gl.constexpr = xring.type.shape[1]
    operand: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=sync_mma_layout(gl.num_warps()), k_width=2)
    paired: gl.constexpr = paired_mma_layout(gl.num_warps())
    gl.static_assert(QT % (2 * PARTS) == 0, "a block's slots are whole")
    parts = ring.reinterpret(ring.dtype, [NBUF * PARTS, BN, PART], ring.layout)
    scales = gl.convert_layout(scales, gl.SliceLayout(1, operand))
    valid = gl.convert_layout(valid, gl.SliceLayout(1, operand))
    scale = gl.load(scales, mask=valid, other=0.0)
    acc = gl.zeros([2, BN // 2, B_PAD], gl.float32, layout=paired)
    G: gl.constexpr = 2 * PARTS // SUB      # a slot's input slices
    for j in range(QT // (2 * PARTS)):
        _group_taken(x_desc, x_row, KT, xring, xready, cx, j * G, G, chained, CHAIN, empty, c + j - 1, 1, j > 0)
        slot = c + j
        s = slot % NBUF
        mbarrier.wait(ready.index(s), (slot // NBUF) & 1)
        for p in gl.static_range(PARTS):    # a slot part: input parts 2 hh (a slice's first) and 2 hh + 1
            hh = j * PARTS + p
            next_scale = gl.load(scales + hh * 2 + 2, mask=valid & (hh * 2 + 2 < QT), other=0.0)
            a = _dequantized(parts.index(s * PARTS + p), scale, operand)
            a = gl.convert_layout(gl.reshape(a, [2, BN // 2, PART]),
                                  gl.DotOperandLayout(operand_index=0, parent=paired, k_width=2))
            acc = mma_v2(a, _input_pair(xring, xready, cx, hh, paired), acc)
            scale = next_scale
    _group_taken(x_desc, x_row, KT, xring, xready, cx, KT, G, chained, CHAIN, empty, c + QT // (2 * PARTS) - 1, 1, True)
    # rows r of the sum, in the block's layout: rows past BN / 2 (the block's padding: never stored) repeat them
    total = gl.expand_dims(gl.sum(acc, axis=0), 0) + gl.zeros([2, BN // 2, B_PAD], gl.float32, layout=paired)
    return gl.convert_layout(gl.reshape(total, [BN, B_PAD]), layout), c + QT // (2 * PARTS)


E4M3_MAX = gl.constexpr(fp8.E4M3_MAX)        # an input row's largest magnitude maps within it


@gluon.jit
def power_of_two_scale(largest):
    """models/fp8.py activation_scale: the least power of two s with largest / s <= E4M3_MAX (at least 2^-100),
    and 1 / s, both exact: bit operations, no division."""
    least = gl.maximum(largest * (1 / E4M3_MAX), 2.0 ** -100)
    bits = (least.to(gl.int32, bitcast=True) + 0x7FFFFF) & 0x7F800000
    return bits.to(gl.float32, bitcast=True), (0x7F000000 - bits).to(gl.float32, bitcast=True)


@gluon.jit
def _quantize_slice(x_desc, x_row, KT: gl.constexpr, xring, xready, cx, it, chained, CHAIN: gl.constexpr, xq, xq_scale,
                    num_warps: gl.constexpr):
    """W8A8: input slice `it` quantized into buffer it % 2 of xq ([2 * SUB, B_PAD, PART] e4m3), a scale per row and
    128-column part (power_of_two_scale of the row's largest magnitude over it) into xq_scale ([2 * SUB, B_PAD]
    float32), as models/fp8.py quantize_activations; the slot of slice it - 1 (quantized before) is refilled. Every
    warp's stores are visible to the wgmma and to every warp's scale loads on return."""
    XD: gl.constexpr = xring.type.shape[0]
    B_PAD: gl.constexpr = xring.type.shape[1]
    SUB: gl.constexpr = xring.type.shape[2] // PART
    x_layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])
    parts = xring.reinterpret(xring.dtype, [XD * SUB, B_PAD, PART], xring.layout)
    xs = _next_slice(x_desc, x_row, KT, xring, xready, cx, it, chained, CHAIN)
    buf = it % 2
    for sub in gl.static_range(SUB):
        xv = parts.index(xs * SUB + sub).load(x_layout).to(gl.float32)
        scale, inverse = power_of_two_scale(gl.max(gl.abs(xv), axis=1))
        xq.index(buf * SUB + sub).store((xv * inverse[:, None]).to(gl.float8e4nv))
        xq_scale.index(buf * SUB + sub).store(scale)
    fence_async_shared()
    cta_barrier()


@gluon.jit
def _w8a8_block(x_desc, x_row, KT: gl.constexpr, scales, valid, ring, ready, empty, xring, xready, xq, xq_scale, c,
                cx, chained, CHAIN: gl.constexpr, layout: gl.constexpr, num_warps: gl.constexpr):
    """mma_block_fp8's loop with e4m3 activations: each input slice quantized into a double buffer a slice ahead
    (_quantize_slice, while the wgmma before it is in flight), then for each 128-column part an e4m3 wgmma straight
    from the weight slot into an accumulator of its own, added into the block's times the part's weight-row and
    input-row scales once done, while the next part's wgmma runs: the block scales are per part, and a wgmma's e4m3
    sums are short. The products are summed in the e4m3 wgmma's layout, converted once a block. stream.py's probe
    measures it beside the W8A16 loop (benchmarks/results/h100-2026-12-06-bf2ceb1); the megakernel streams W8A16."""
    NBUF: gl.constexpr = ring.type.shape[0]
    BN: gl.constexpr = ring.type.shape[1]
    PARTS: gl.constexpr = ring.type.shape[2] // PART        # a slot's
    SUB: gl.constexpr = xring.type.shape[2] // PART          # an input slice's
    QT: gl.constexpr = KT * SUB                               # the block's
    B_PAD: gl.constexpr = xring.type.shape[1]
    layout8: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                      instr_shape=[16, B_PAD, 32])
    parts = ring.reinterpret(ring.dtype, [NBUF * PARTS, BN, PART], ring.layout)     # a slot: [PARTS, BN, PART]
    scales = gl.convert_layout(scales, gl.SliceLayout(1, layout8))
    valid = gl.convert_layout(valid, gl.SliceLayout(1, layout8))
    zero = gl.zeros([BN, B_PAD], gl.float32, layout=layout8)
    acc = zero
    _quantize_slice(x_desc, x_row, KT, xring, xready, cx, 0, chained, CHAIN, xq, xq_scale, num_warps)
    done = zero         # the product of the part before, in flight
    done_scale = zero
    for it in range(KT):
        for sub in gl.static_range(SUB):
            q = it * SUB + sub
            slot = c + q // PARTS
            s = slot % NBUF
            mbarrier.wait(ready.index(s), (slot // NBUF) & 1, pred=q % PARTS == 0)
            b = (it % 2) * SUB + sub
            product = warpgroup_mma(parts.index(s * PARTS + q % PARTS), xq.index(b).permute((1, 0)), zero,
                                    use_acc=False, is_async=True)
            scale = (gl.load(scales + q, mask=valid, other=0.0)[:, None]
                     * xq_scale.index(b).load(gl.SliceLayout(0, layout8))[None, :])
            product, done = warpgroup_mma_wait(num_outstanding=1, deps=[product, done])
            acc += done * done_scale       # part q - 1's (zero at q = 0)
            # part q - 1 done: its slot goes back once it was the slot's last
            mbarrier.arrive(empty.index((slot + NBUF - 1) % NBUF), count=1, pred=(q > 0) & (q % PARTS == 0))
            if sub == SUB - 1:      # slice it - 1's products are done: its buffer takes slice it + 1
                if it + 1 < KT:
                    _quantize_slice(x_desc, x_row, KT, xring, xready, cx, it + 1, chained, CHAIN, xq, xq_scale,
                                    num_warps)
            done = product
            done_scale = scale
    done = warpgroup_mma_wait(num_outstanding=0, deps=[done])
    acc += done * done_scale
    slots = (QT + PARTS - 1) // PARTS
    mbarrier.arrive(empty.index((c + slots - 1) % NBUF), count=1)
    return gl.convert_layout(acc, layout), c + slots


@gluon.constexpr_function
def acc_layout(BN, B_PAD, num_warps):
    """The wgmma accumulator's register layout: weight rows along M, the padded batch along N."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, B_PAD, 16])


@gluon.jit
def load_rows(desc, row0, rows, K: gl.constexpr, ring, ready, empty, c, INFLIGHT: gl.constexpr,
              PACK: gl.constexpr = False):
    """Producer: the slots of a task's `rows` weight rows from row0, block after block (PACK: load_block's)."""
    BN: gl.constexpr = ring.type.shape[1]
    first = c
    for j in range(0, rows, BN):
        c = load_block(desc, row0 + j, rows - j, K, ring, ready, empty, c, first, INFLIGHT, PACK)
    return c


@gluon.constexpr_function
def _load64_asm(order, system):
    return f"ld.global.{order}.{'sys' if system else 'gpu'}.b64 $0, [$1];"


@gluon.jit
def _load64(ptr, ORDER: gl.constexpr, SYSTEM: gl.constexpr = False):
    """A 64-bit load of an event counter or the abort flag, `ORDER` (acquire, relaxed) at GPU scope, or at system
    scope where peers on other GPUs write it."""
    return gl.inline_asm_elementwise(_load64_asm(ORDER, SYSTEM), "=l,l", [ptr], dtype=gl.int64, is_pure=False,
                                     pack=1)


@gluon.jit
def task_row(rows, i, valid, WIDTH: gl.constexpr):
    """Row i of a task table of rows of WIDTH columns, graph/table.py's COLUMNS in order: type, layer, a0..a3,
    wait, signal; zeros unless valid."""
    row = rows + i * WIDTH
    return (gl.load(row, mask=valid, other=0), gl.load(row + 1, mask=valid, other=0),
            gl.load(row + 2, mask=valid, other=0), gl.load(row + 3, mask=valid, other=0),
            gl.load(row + 4, mask=valid, other=0), gl.load(row + 5, mask=valid, other=0),
            gl.load(row + 6, mask=valid, other=0), gl.load(row + 7, mask=valid, other=0))


def matmul_layouts(block_k: int, b_pad: int, box: int = 16):
    """Shared layouts of a weight box [box, 64] (a 128-byte swizzle line: load_block) and an input slice [b_pad,
    block_k] (NVMMA-swizzled)."""
    return (gl.NVMMASharedLayout.get_default_for([box, 64], gl.bfloat16),
            gl.NVMMASharedLayout.get_default_for([b_pad, block_k], gl.bfloat16))


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
def wait_event(counter_ptr, target, abort_ptr, timeout_us, SYSTEM: gl.constexpr):
    """primitives.wait_event in Gluon: spin until *counter_ptr reaches target, at most timeout_us or until a
    worker aborted the step; returns the last value seen minus target (negative: gave up). The abort flag is read
    relaxed and first: an acquire load waits for its own return before any later load is issued (CCTL.IVALL),
    so two acquires made every look two round trips to L2, even at an event long complete. SYSTEM: peers on
    other GPUs signal events (acquire at system scope)."""
    aborted = _load64(abort_ptr, "relaxed")
    value = _load64(counter_ptr, "acquire", SYSTEM)
    deadline = now_ns() + timeout_us.to(gl.int64) * 1000
    while (value - target < 0) & (aborted == 0) & (now_ns() < deadline):
        aborted = _load64(abort_ptr, "relaxed")
        value = _load64(counter_ptr, "acquire", SYSTEM)
    cta_barrier()
    if value - target < 0:          # one CTA, one verdict (see primitives.wait_event)
        value = _load64(counter_ptr, "acquire", SYSTEM)
    fence_async_global()
    return value - target


@gluon.jit
def signal_event(counter_ptr):
    fence_async_global()
    cta_barrier()           # every thread's stores of this task precede the release
    gl.atomic_add(counter_ptr, 1, sem="release", scope="gpu")


@gluon.jit
def signal_all_ranks(counter_peers, event, WORLD: gl.constexpr, SYSTEM: gl.constexpr, num_warps: gl.constexpr):
    """primitives.signal_all_ranks in Gluon: bump `event` on every rank through the peer pointers of the symmetric
    counters, a release at system scope where peers are other GPUs (SYSTEM), else at GPU scope (ranks that share
    one device: virtual ranks). One lane a rank, so the ranks' releases are in flight together."""
    cta_barrier()
    P: gl.constexpr = next_power_of_2(WORLD)
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
    p = gl.arange(0, P, layout=layout)
    peers = gl.load(counter_peers + p, mask=p < WORLD, other=0).to(gl.pointer_type(gl.int64))
    one = gl.full([P], 1, gl.int64, layout=layout)       # Triton 3.6's Gluon broadcasts no scalar here
    if SYSTEM:
        gl.atomic_add(peers + event, one, mask=p < WORLD, sem="release", scope="sys")
    else:
        gl.atomic_add(peers + event, one, mask=p < WORLD, sem="release", scope="gpu")


@gluon.jit
def peer_pointer(peers, p, dtype: gl.constexpr):
    """Rank p's copy of a symmetric buffer, from the int64 addresses `peers` (comm's symmetric())."""
    return gl.load(peers + p).to(gl.pointer_type(dtype))


@gluon.constexpr_function
def next_power_of_2(n):
    return triton.next_power_of_2(int(n))


@gluon.jit
def norm_rstd(x, n, H: gl.constexpr, EPS: gl.constexpr, ring, xring, num_warps: gl.constexpr):
    """primitives.norm_rstd in Gluon: the RMSNorm's scale of the residual stream's rows b < n (1 past n), in the
    layout of a block's batch index (block_index), to multiply the block's product of the scaled stream by. A row
    at a time, the whole row in one load, the next row's load issued before this one is reduced: one L2 round
    trip in all rather than one a row (a round trip a row lengthened QKV and gate/up tiles with every row of the batch).
    Call it after prime_inputs, so that the round trip of its loads overlaps the input slices'."""
    HP: gl.constexpr = next_power_of_2(H)
    rh = gl.arange(0, HP, layout=gl.BlockedLayout([4], [32], [num_warps], [0]))
    _, rb = block_index(ring, xring, num_warps)
    rstd = gl.full(rb.type.shape, 1.0, gl.float32, layout=rb.type.layout)
    v = gl.load(x + rh, mask=(rh < H) & (n > 0), other=0.0)
    for b in range(n):
        v_next = gl.load(x + (b + 1) * H + rh, mask=(rh < H) & (b + 1 < n), other=0.0)
        rstd = gl.where(rb == b, gl.rsqrt(gl.sum(v * v, axis=0) / H + EPS), rstd)
        v = v_next
    return rstd


@gluon.jit
def block_index(ring, xring, num_warps: gl.constexpr):
    """Row and batch indices of a matmul block's accumulator (mma_block's layout; the ring's padded batch)."""
    BN: gl.constexpr = ring.type.shape[1]
    B_PAD: gl.constexpr = xring.type.shape[1]
    layout: gl.constexpr = acc_layout(BN, B_PAD, num_warps)
    return (gl.arange(0, BN, layout=gl.SliceLayout(1, layout)), gl.arange(0, B_PAD, layout=gl.SliceLayout(0, layout)))


@gluon.jit
def store_residual_ring(x, xs, offs, mask, values, next_norm_w):
    """tasks/base.py store_residual_gpu in Gluon: the residual stream's elements at offs become `values` (float32),
    the scaled stream's the stored values times next_norm_w (broadcast against `values`), rounded once."""
    stored = values.to(x.dtype.element_ty)
    gl.store(x + offs, stored, mask=mask)
    gl.store(xs + offs, (stored.to(gl.float32) * next_norm_w).to(xs.dtype.element_ty), mask=mask)


@gluon.jit
def exchange_region(row0, output, src, H: gl.constexpr, B_PAD: gl.constexpr, WORLD: gl.constexpr,
                    EXCHANGE_SLOTS: gl.constexpr):
    """device/exchange.py exchange_region in Gluon: where rank src's rows of a tile of `output` are."""
    return ((output % EXCHANGE_SLOTS) * WORLD + src).to(gl.int64) * B_PAD * H + row0 * B_PAD


@gluon.constexpr_function
def exchange_layout(num_warps):
    """A tile's rows of the exchange: the batch down the warps, a warp across the columns."""
    return gl.BlockedLayout([1, 4], [8, 4], [num_warps, 1], [1, 0])


@gluon.jit
def push_block(values, packed, mask, exchange_peers, WORLD: gl.constexpr):
    """device/exchange.py push_block's pointer transport in Gluon: float32 `values` stored at offsets `packed` of
    every rank's exchange (NVSHMEM's put-with-signal stays on the tl kernel)."""
    for p in gl.static_range(WORLD):
        gl.store(peer_pointer(exchange_peers, p, gl.float32) + packed, values, mask=mask)


@gluon.jit
def deliver_sums(total, x, xs, offs, mask, residual, next_norm_w, partial, push, packed, exchange_peers,
                 WORLD: gl.constexpr):
    """Where a row-parallel tile's float32 sums go: at tp=1 added to the residual stream (`residual` and the next
    RMSNorm's weight `next_norm_w`, broadcast against `total`, loaded before the products: store_residual_ring), at
    tp > 1 pushed into every rank's exchange at offsets `packed` (push: the lowering's PUSH_PARTIAL) or stored as
    this rank's partial sum."""
    if WORLD == 1:
        store_residual_ring(x, xs, offs, mask, residual + total, next_norm_w)
    elif push:
        push_block(total, packed, mask, exchange_peers, WORLD)
    else:
        gl.store(partial + offs, total, mask=mask)


@gluon.jit
def row_parallel_rows(w_desc, w_scale, x_desc, x_row, K: gl.constexpr, row0, rows, n, x, xs, next_norm_w, partial,
                      push, region, signal, exchange_peers, counter_peers, H: gl.constexpr, WORLD: gl.constexpr,
                      SYSTEM_SCOPE: gl.constexpr, ring, ready, empty, xring, xready, c, cx, num_warps: gl.constexpr,
                      PACK: gl.constexpr = False):
    """Rows [row0, row0 + rows) of x_in @ W^T over the slots load_rows filled: the row-parallel o_proj and down
    tiles. At tp=1 added to the residual stream x[:n] and the scaled stream's columns with it (next_norm_w: the next
    RMSNorm's weight; tasks/base.py store_residual), the residual and the norm's weight loaded before the products
    so that their round trip overlaps them; at tp > 1 this rank's partial sum, pushed from the accumulator into every
    rank's exchange at `region` and event `signal` bumped on every rank after the last block (push: the lowering's
    PUSH_PARTIAL), or only stored (WRITE_PARTIAL). The weights are w_desc's rows of one layer's matrix (w_scale: its
    block scales, e4m3 weights; mma_rows, PACK: load_block's)."""
    BN: gl.constexpr = ring.type.shape[1]
    rn, rb = block_index(ring, xring, num_warps)
    for j in range(0, rows, BN):
        cols = row0 + j + rn
        offs = rb[None, :] * H + cols[:, None]
        mask = (rn < rows - j)[:, None] & (rb < n)[None, :]
        residual = None
        g = None
        if WORLD == 1:
            residual = gl.load(x + offs, mask=mask, other=0.0).to(gl.float32)
            g = gl.load(next_norm_w + cols, mask=rn < rows - j, other=0.0).to(gl.float32)[:, None]
        acc, c, cx = mma_rows(w_desc, w_scale, row0 + j, rows - j, x_desc, x_row, K, ring, ready, empty, xring,
                              xready, c, cx, j > 0, j + BN < rows, num_warps, PACK)
        packed = region + rb[None, :] * rows + (j + rn)[:, None]
        deliver_sums(acc, x, xs, offs, mask, residual, g, partial, push, packed, exchange_peers, WORLD)
    if WORLD > 1:
        if push:
            signal_all_ranks(counter_peers, signal, WORLD, SYSTEM_SCOPE, num_warps)
    return c, cx
