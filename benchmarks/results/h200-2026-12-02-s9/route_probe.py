"""Route task in isolation (one program, 4 warps, in-kernel loop of R calls, globaltimer): is its 6.8 us in the
megakernel its own compute? Variants: the task's route_gpu; top-k by tl.topk of packed (probability, index) keys;
8 rounds of argmax; and the sum of [TILES, E] partial logits (the router-partials plan) before the topk variant.
Variant 0 calls route_gpu as it was at 6a92d34, where this ran (its signature changed at ca27d04).
Run: python route_probe.py (with that commit's distmk on the path)"""
import torch, triton, triton.language as tl
from distmk.tasks.route import route_gpu

E, K = 128, 8


@triton.jit
def topk_route(n, logits_ptr, route_expert, route_weight, EXPERTS: tl.constexpr, TOP_K: tl.constexpr,
               NORM: tl.constexpr, PARTIAL_TILES: tl.constexpr):
    re = tl.arange(0, EXPERTS)
    for b in range(n):
        if PARTIAL_TILES > 0:
            rt = tl.arange(0, PARTIAL_TILES)
            part = tl.load(logits_ptr + (rt[:, None] * n + b) * EXPERTS + re[None, :])
            logits = tl.sum(part, axis=0)
        else:
            logits = tl.load(logits_ptr + b * EXPERTS + re)
        p = tl.exp(logits - tl.max(logits, axis=0))
        p = p / tl.sum(p, axis=0)
        key = (p.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (EXPERTS - 1 - re).to(tl.int64)
        top = tl.topk(key, TOP_K, dim=0)
        rk = tl.arange(0, TOP_K)
        w = (top >> 32).to(tl.int32).to(tl.float32, bitcast=True)
        if NORM:
            w = w / tl.sum(w, axis=0)
        tl.store(route_expert + b * TOP_K + rk, (EXPERTS - 1 - (top & 0xFFFFFFFF)))
        tl.store(route_weight + b * TOP_K + rk, w)


@triton.jit
def argmax_route(n, logits_ptr, route_expert, route_weight, EXPERTS: tl.constexpr, TOP_K: tl.constexpr):
    re = tl.arange(0, EXPERTS)
    for b in range(n):
        logits = tl.load(logits_ptr + b * EXPERTS + re)
        p = tl.exp(logits - tl.max(logits, axis=0))
        p = p / tl.sum(p, axis=0)
        total = 0.0
        for k in tl.static_range(TOP_K):
            m = tl.max(p, axis=0)
            e = tl.min(tl.where(p == m, re, EXPERTS), axis=0)
            tl.store(route_expert + b * TOP_K + k, e.to(tl.int64))
            tl.store(route_weight + b * TOP_K + k, m)
            total += m
            p = tl.where(re == e, -1.0, p)


@triton.jit(do_not_specialize=["n", "zero"])
def probe(R, n, zero, logits, partials, route_expert, route_weight, route_slot, route_unique, route_count, route_history,
          out, VARIANT: tl.constexpr, EXPERTS: tl.constexpr, TOP_K: tl.constexpr):
    t0 = tl.extra.cuda.globaltimer()
    for r in range(R):
        if VARIANT == 0:
            route_gpu(zero, n, logits, route_expert, route_weight, route_slot, route_unique, route_count, route_history,
                      EXPERTS, EXPERTS, TOP_K, 16, True, 1)
        elif VARIANT == 1:
            topk_route(n, logits, route_expert, route_weight, EXPERTS, TOP_K, True, 0)
        elif VARIANT == 2:
            argmax_route(n, logits, route_expert, route_weight, EXPERTS, TOP_K)
        elif VARIANT == 3:
            topk_route(n, partials, route_expert, route_weight, EXPERTS, TOP_K, True, 128)
        elif VARIANT == 4:
            topk_route(n, partials, route_expert, route_weight, EXPERTS, TOP_K, True, 16)
        tl.debug_barrier()
    t1 = tl.extra.cuda.globaltimer()
    tl.store(out, (t1 - t0) / R)


def main():
    dev = "cuda"
    logits = torch.randn(1, E, device=dev)
    partials = torch.randn(128, 1, E, device=dev) / 11
    i64 = dict(dtype=torch.int64, device=dev)
    bufs = [torch.zeros(1, K, **i64), torch.zeros(1, K, device=dev), torch.zeros(1, K, **i64), torch.zeros(K, **i64),
            torch.zeros(1, **i64), torch.zeros(1, 1, K, **i64)]
    out = torch.zeros(1, dtype=torch.float64, device=dev)
    ref = torch.topk(torch.softmax(logits, -1), K).indices
    refp = torch.topk(torch.softmax(partials.sum(0), -1), K).indices
    for variant in range(5):
        for warps in (4, 8):
            probe[(1,)](200, 1, 0 * E, logits, partials, *bufs, out, VARIANT=variant, EXPERTS=E, TOP_K=K, num_warps=warps)
            probe[(1,)](200, 1, 0 * E, logits, partials, *bufs, out, VARIANT=variant, EXPERTS=E, TOP_K=K, num_warps=warps)
            torch.cuda.synchronize()
            want = refp if variant in (3, 4) else ref
            same = torch.equal(bufs[0].cpu(), want.cpu()) if variant != 4 else "n/a"
            print(f"variant {variant} warps {warps}: {out.item() / 1000:.2f} us per route, experts match {same}",
                  flush=True)


if __name__ == "__main__":
    main()
