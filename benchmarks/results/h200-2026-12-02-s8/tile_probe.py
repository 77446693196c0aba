"""Per-tile streaming of the MoE step's matmul tiles: each of 132 programs runs L tiles one after another
(distinct weights, no waits), per-block loop (as tasks/*.py today) against one flattened (block, k) loop.
Run: python .scratch/tile_probe.py [shape ...]"""
import itertools, sys, json
import torch, triton, triton.language as tl

B_PAD = tl.constexpr(16)


@triton.jit
def tiles_blocked(w, w2, x, y, ROWS: tl.constexpr, K: tl.constexpr, L: tl.constexpr, BN: tl.constexpr,
                  BK: tl.constexpr, STAGES: tl.constexpr, PAIR: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    rb = tl.arange(0, B_PAD); rn = tl.arange(0, BN); rk = tl.arange(0, BK)
    for t in range(L):
        base = (t * nprog + pid).to(tl.int64) * ROWS * K
        for j in range(0, ROWS, BN):
            rows = base + (j + rn).to(tl.int64)[:, None] * K
            acc = tl.zeros((B_PAD, BN), dtype=tl.float32)
            acc2 = tl.zeros((B_PAD, BN), dtype=tl.float32)
            for k in tl.range(0, K, BK, num_stages=STAGES):
                xt = tl.load(x + rb[:, None] * K + (k + rk)[None, :], mask=(rb < 1)[:, None], other=0.0)
                wt = tl.load(w + rows + (k + rk)[None, :], mask=(j + rn < ROWS)[:, None], other=0.0)
                acc += tl.dot(xt, tl.trans(wt))
                if PAIR:
                    wt2 = tl.load(w2 + rows + (k + rk)[None, :], mask=(j + rn < ROWS)[:, None], other=0.0)
                    acc2 += tl.dot(xt, tl.trans(wt2))
            if PAIR:
                acc = acc * tl.sigmoid(acc) * acc2
            tl.store(y + pid * B_PAD * ROWS + rb[:, None] * ROWS + (j + rn)[None, :], acc.to(y.dtype.element_ty),
                     mask=(rb < 1)[:, None] & (j + rn < ROWS)[None, :])


@triton.jit
def tiles_flat(w, w2, x, y, ROWS: tl.constexpr, K: tl.constexpr, L: tl.constexpr, BN: tl.constexpr,
               BK: tl.constexpr, STAGES: tl.constexpr, PAIR: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    rb = tl.arange(0, B_PAD); rn = tl.arange(0, BN); rk = tl.arange(0, BK)
    KT: tl.constexpr = (K + BK - 1) // BK
    NB: tl.constexpr = (ROWS + BN - 1) // BN
    for t in range(L):
        base = (t * nprog + pid).to(tl.int64) * ROWS * K
        acc = tl.zeros((B_PAD, BN), dtype=tl.float32)
        acc2 = tl.zeros((B_PAD, BN), dtype=tl.float32)
        for it in tl.range(0, NB * KT, num_stages=STAGES):
            j = (it // KT) * BN
            k = (it % KT) * BK
            rows = base + (j + rn).to(tl.int64)[:, None] * K
            xt = tl.load(x + rb[:, None] * K + (k + rk)[None, :], mask=(rb < 1)[:, None], other=0.0)
            wt = tl.load(w + rows + (k + rk)[None, :], mask=(j + rn < ROWS)[:, None], other=0.0)
            acc += tl.dot(xt, tl.trans(wt))
            if PAIR:
                wt2 = tl.load(w2 + rows + (k + rk)[None, :], mask=(j + rn < ROWS)[:, None], other=0.0)
                acc2 += tl.dot(xt, tl.trans(wt2))
            if it % KT == KT - 1:
                out = acc
                if PAIR:
                    out = acc * tl.sigmoid(acc) * acc2
                tl.store(y + pid * B_PAD * ROWS + rb[:, None] * ROWS + (j + rn)[None, :], out.to(y.dtype.element_ty),
                         mask=(rb < 1)[:, None] & (j + rn < ROWS)[None, :])
                acc = tl.zeros((B_PAD, BN), dtype=tl.float32)
                acc2 = tl.zeros((B_PAD, BN), dtype=tl.float32)


SHAPES = {   # name: rows of a tile, K, pair, tiles a program runs (layers)
    "qwen_down": (128, 768, False, 48),
    "qwen_oproj": (16, 4096, False, 48),
    "qwen_gateup": (48, 2048, True, 48),
    "qwen_qkv": (40, 2048, False, 48),
    "mixtral_down": (64, 14336, False, 32),
    "mixtral_gateup": (224, 4096, True, 32),
}


def variants(name):
    ROWS, K, PAIR, L = SHAPES[name]
    out = [("blocked", BN, 256, 4) for BN in (16, 32, 64)]
    out += [("flat", BN, BK, S) for BN, BK, S in itertools.product((16, 32, 64), (128, 256, 512), (4, 6))]
    return [v for v in out if not (v[1] > ROWS or v[2] > K or v[1] * v[2] > 16384 or (PAIR and v[1] * v[2] > 8192))]


def compile_one(job):
    name, (kern, BN, BK, S) = job
    ROWS, K, PAIR, L = SHAPES[name]
    fn = tiles_blocked if kern == "blocked" else tiles_flat
    t = torch.empty(16, device="cuda", dtype=torch.bfloat16)
    try:
        fn.warmup(t, t, t, t, ROWS, K, L, BN, BK, S, PAIR, num_warps=4, grid=(1,))
    except Exception as e:
        return f"{name} {kern} {BN} {BK} {S}: {type(e).__name__} {str(e)[:200]}"
    return None


def main():
    import multiprocessing as mp
    names = sys.argv[1:] or list(SHAPES)
    jobs = [(n, v) for n in names for v in variants(n)]
    with mp.get_context("spawn").Pool(14) as pool:
        for err in pool.map(compile_one, jobs):
            if err:
                print("compile:", err, flush=True)
    print(f"compiled {len(jobs)} variants", flush=True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    big = torch.empty(int(4.2e9), device="cuda", dtype=torch.bfloat16)
    ms = triton.testing.do_bench(lambda: big.sum(dtype=torch.float32), warmup=3, rep=40)
    print(f"read ceiling {big.numel() * 2 / ms / 1e6:.0f} GB/s", flush=True)
    del big
    results = []
    for name in names:
        ROWS, K, PAIR, L = SHAPES[name]
        numel = L * sms * ROWS * K
        w = torch.randn(numel, device="cuda", dtype=torch.bfloat16)
        w2 = torch.randn(numel, device="cuda", dtype=torch.bfloat16) if PAIR else w
        x = torch.randn(16, K, device="cuda", dtype=torch.bfloat16)
        y = torch.empty(sms * 16 * ROWS, device="cuda", dtype=torch.bfloat16)
        gb = numel * 2 * (2 if PAIR else 1) / 1e9
        rows = []
        for kern, BN, BK, S in variants(name):
            fn = tiles_blocked if kern == "blocked" else tiles_flat
            try:
                ms = triton.testing.do_bench(lambda: fn[(sms,)](w, w2, x, y, ROWS, K, L, BN, BK, S, PAIR, num_warps=4),
                                             warmup=3, rep=30, return_mode="median")
            except Exception as e:
                print(f"{name} {kern} BN={BN} BK={BK} S={S}: {type(e).__name__} {str(e)[:100]}", flush=True)
                continue
            rows.append((ms, kern, BN, BK, S))
        rows.sort()
        for kern in ("blocked", "flat"):
            mine = [r for r in rows if r[1] == kern]
            for ms, _, BN, BK, S in mine[:4]:
                print(f"{name:15s} {kern:7s} BN={BN:3d} BK={BK:3d} S={S}: {ms * 1e3 / L:6.2f} us/tile "
                      f"{gb / ms * 1e3:6.0f} GB/s", flush=True)
            cur = [r for r in mine if r[2] == 16 and r[3] == 256 and r[4] == 4]
            if cur:
                print(f"{name:15s} {kern:7s} BN=16 BK=256 S=4 (today's): {cur[0][0] * 1e3 / L:6.2f} us/tile", flush=True)
        results.append({"shape": name, "rows": [dict(zip(("ms", "kern", "BN", "BK", "S"), r)) for r in rows]})
        del w, w2
    json.dump(results, open(sys.argv[0].replace(".py", ".json") if False else "/tmp/tile_probe.json", "w"))


if __name__ == "__main__":
    main()
