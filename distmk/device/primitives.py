"""Device helpers shared by the task kernels: the matmul tile every projection is made of, the RMSNorm's
scale of the residual stream, L2 prefetch, and the event wait/signal that orders tasks across workers (event
counters are int64, the width of NVSHMEM signals).

Ordering: a task's threads store their outputs, meet at a CTA barrier, then one release atomic bumps the
event counter (gpu scope). A waiting worker polls the counter with acquire loads, then meets its own
barrier before any thread reads the producer's data. Under TRITON_INTERPRET (CPU tests) programs run one
after another, so polling uses atomics and the wait bound counts polls instead of nanoseconds.
"""
import triton
import triton.language as tl


@triton.jit
def norm_rstd(x, n, H: tl.constexpr, EPS: tl.constexpr, B_PAD: tl.constexpr, NORM_BLOCK: tl.constexpr):
    """The RMSNorm's scale of the residual stream's rows, rsqrt(mean(x[b]^2) + eps) for b < n ([B_PAD] float32,
    1 past n): a tile that reads the normed stream multiplies its product of the scaled stream xs by it
    (tasks/base.py normed_stream). A row at a time, the whole row (NORM_BLOCK >= H columns) in one load, the next
    row's load issued before this one is reduced: one L2 round trip at batch 1."""
    rb = tl.arange(0, B_PAD)
    rh = tl.arange(0, NORM_BLOCK)
    rstd = tl.full((B_PAD,), 1.0, dtype=tl.float32)
    v = tl.load(x + rh, mask=rh < H * (n > 0), other=0.0).to(tl.float32)
    for b in range(n):
        v_next = tl.load(x + (b + 1) * H + rh, mask=rh < H * (b + 1 < n), other=0.0).to(tl.float32)
        rstd = tl.where(rb == b, tl.math.rsqrt(tl.sum(v * v, axis=0) / H + EPS), rstd)
        v = v_next
    return rstd


@triton.jit
def layer_scales(scale, layer, ROWS: tl.constexpr, K: tl.constexpr):
    """Layer `layer`'s block scales of a stacked [layers, ROWS, K] e4m3 weight (kernels/layout.py: [layers,
    ROWS / 128, K / 128])."""
    return scale + layer.to(tl.int64) * tl.cdiv(ROWS, 128) * tl.cdiv(K, 128)


@triton.jit
def dequantized(wt, scale, rows, kk, K: tl.constexpr, mask, dtype: tl.constexpr):
    """A tile of e4m3 weights (rows `rows`, columns `kk` of the matrix) times their 128 x 128 blocks' scales, rounded
    to `dtype` as the reference's dequantized weights are (models/fp8.py); other weights as they are."""
    if wt.dtype == tl.float8e4nv:
        s = tl.load(scale + (rows // 128)[:, None] * tl.cdiv(K, 128) + (kk // 128)[None, :], mask=mask, other=0.0)
        wt = (wt.to(tl.float32) * s).to(dtype)
    return wt


@triton.jit
def matmul_block(inp, w, n, row0, rows_valid, K: tl.constexpr, B_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr, scale=None):
    """acc[B_PAD, BLOCK_N] = inp[:n, :K] @ w[row0:row0 + BLOCK_N, :K]^T in float32 (e4m3 weights: `scale`, their
    block scales, dequantized).

    Batch rows >= n and weight rows >= rows_valid read as zero. Weights stream once, K-contiguous, so
    each thread issues wide coalesced loads; the batch (padded to the mma minimum) rides along."""
    rb = tl.arange(0, B_PAD)
    rn = tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((B_PAD, BLOCK_N), dtype=tl.float32)
    w_rows = w + (row0 + rn)[:, None].to(tl.int64) * K
    for k in range(0, K, BLOCK_K):
        kk = k + rk
        x = tl.load(inp + rb[:, None] * K + kk[None, :], mask=(rb[:, None] < n) & (kk[None, :] < K), other=0.0)
        wmask = (rn[:, None] < rows_valid) & (kk[None, :] < K)
        wt = dequantized(tl.load(w_rows + kk[None, :], mask=wmask, other=0.0), scale, row0 + rn, kk, K, wmask,
                         x.dtype)
        acc += tl.dot(x.to(wt.dtype), tl.trans(wt), input_precision=DOT_PRECISION)
    return acc


@triton.jit
def matmul_pair(inp, w1, w2, n, row0, rows_valid, K: tl.constexpr, B_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr, scale1=None, scale2=None):
    """Two matmul_blocks over the same input in one K loop (gate and up; the two halves of a head): twice
    the weight bytes in flight per step, one pipeline fill instead of two."""
    rb = tl.arange(0, B_PAD)
    rn = tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc1 = tl.zeros((B_PAD, BLOCK_N), dtype=tl.float32)
    acc2 = tl.zeros((B_PAD, BLOCK_N), dtype=tl.float32)
    rows = (row0 + rn)[:, None].to(tl.int64) * K
    for k in range(0, K, BLOCK_K):
        kk = k + rk
        x = tl.load(inp + rb[:, None] * K + kk[None, :], mask=(rb[:, None] < n) & (kk[None, :] < K), other=0.0)
        wmask = (rn[:, None] < rows_valid) & (kk[None, :] < K)
        wt1 = dequantized(tl.load(w1 + rows + kk[None, :], mask=wmask, other=0.0), scale1, row0 + rn, kk, K, wmask,
                          x.dtype)
        wt2 = dequantized(tl.load(w2 + rows + kk[None, :], mask=wmask, other=0.0), scale2, row0 + rn, kk, K, wmask,
                          x.dtype)
        acc1 += tl.dot(x.to(wt1.dtype), tl.trans(wt1), input_precision=DOT_PRECISION)
        acc2 += tl.dot(x.to(wt1.dtype), tl.trans(wt2), input_precision=DOT_PRECISION)
    return acc1, acc2


@triton.jit
def prefetch_l2(ptr, count, LIMIT_BYTES: tl.constexpr, INTERPRET: tl.constexpr):
    """Ask L2 for the first min(count elements, LIMIT_BYTES) at ptr, without waiting (sm_90 bulk prefetch).
    Issued before a task waits on its event: weights do not depend on it, so HBM keeps streaming while
    the worker waits, and the task's first loads hit L2."""
    if LIMIT_BYTES > 0 and not INTERPRET:
        elem: tl.constexpr = ptr.dtype.element_ty.primitive_bitwidth // 8
        total = tl.minimum(count.to(tl.int64) * elem, LIMIT_BYTES)
        lane = tl.arange(0, 128)
        chunk = (total + 128 * 16 - 1) // (128 * 16) * 16           # bytes per lane, a multiple of 16
        size = tl.minimum(tl.maximum(total - lane * chunk, 0), chunk).to(tl.int32)
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.b32 $0, 0; }",
            "=r,l,r", [ptr + lane * (chunk // elem), size], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def now_ns():
    return tl.extra.cuda.globaltimer()


@triton.jit
def load_acquire(ptr, INTERPRET: tl.constexpr, SYSTEM: tl.constexpr):
    """Acquire load of an (int64: NVSHMEM signals are 64-bit) event counter; system scope when other GPUs
    signal it."""
    if INTERPRET:
        value = tl.atomic_add(ptr, 0, sem="acquire", scope="sys")
    elif SYSTEM:
        value = tl.inline_asm_elementwise("ld.global.acquire.sys.b64 $0, [$1];", "=l,l", [ptr],
                                          dtype=tl.int64, is_pure=False, pack=1)
    else:
        value = tl.inline_asm_elementwise("ld.global.acquire.gpu.b64 $0, [$1];", "=l,l", [ptr],
                                          dtype=tl.int64, is_pure=False, pack=1)
    return value


@triton.jit
def wait_event(counter_ptr, target, abort_ptr, timeout_us, INTERPRET: tl.constexpr, SYSTEM: tl.constexpr):
    """Spin until *counter_ptr reaches target. Returns the last value seen minus target: negative means the
    wait gave up (timeout, or another worker already aborted the step). Differences, not plain comparisons,
    so that a wrap-around of counters and targets on very long runs stays harmless. The abort flag is loaded
    before the counter: an acquire load waits for its own return before any later load is issued, so a look
    would otherwise be two round trips."""
    if INTERPRET:
        value = load_acquire(counter_ptr, INTERPRET, SYSTEM)
        polls = 0
        while (value - target < 0) & (polls < timeout_us):     # polls when interpreted
            value = load_acquire(counter_ptr, INTERPRET, SYSTEM)
            polls += 1
    else:
        aborted = tl.load(abort_ptr, volatile=True)
        value = load_acquire(counter_ptr, INTERPRET, SYSTEM)
        deadline = now_ns() + timeout_us.to(tl.int64) * 1000
        while (value - target < 0) & (aborted == 0) & (now_ns() < deadline):
            aborted = tl.load(abort_ptr, volatile=True)
            value = load_acquire(counter_ptr, INTERPRET, SYSTEM)
    tl.debug_barrier()
    # Threads poll on their own and may leave the loop differently (one by the deadline or the abort flag,
    # another just after the event completed). A thread that gave up looks again after the barrier: if
    # any thread saw the event complete, the counter reached the target before that barrier, so it sees it
    # too, and the whole CTA takes one branch (a split CTA would hang at the task's next barrier).
    if value - target < 0:
        value = load_acquire(counter_ptr, INTERPRET, SYSTEM)
    return value - target


@triton.jit
def signal_event(counter_ptr):
    tl.debug_barrier()   # every thread's stores of this task precede the release
    tl.atomic_add(counter_ptr, 1, sem="release", scope="gpu")


@triton.jit
def signal_all_ranks(counter_peers, event, WORLD: tl.constexpr):
    """Bump `event` on every rank (the exchange tasks' signal): a release at system scope into each peer's
    counters, through the peer pointers of the symmetric counter array."""
    tl.debug_barrier()
    for p in tl.static_range(WORLD):
        peer = tl.load(counter_peers + p).to(tl.pointer_type(tl.int64))
        tl.atomic_add(peer + event, 1, sem="release", scope="sys")
