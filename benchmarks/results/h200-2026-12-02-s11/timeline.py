"""Per-layer phase timeline of a traced step: for each task type, first start / last end relative to the layer's first start."""
import sys, collections, torch
from distmk.tasks import TASK_KINDS
d = torch.load(sys.argv[1])
tasks, tm = d["tasks"], d["timings"]
t0 = int(tm[:, 0].min())
kinds = [TASK_KINDS[int(t)].name for t in tasks[:, 0].tolist()]
layers = tasks[:, 1].tolist()
ph = collections.defaultdict(lambda: [1 << 62, 0, 0, 0, 0])   # (layer, kind) -> first start, last end, n, run sum, first-wait
for i, (k, l) in enumerate(zip(kinds, layers)):
    w, s, e, _ = tm[i].tolist()
    p = ph[(l, k)]
    p[0] = min(p[0], s); p[1] = max(p[1], e); p[2] += 1; p[3] += e - s
order = ["embed", "qkv", "qk_finish", "attention", "attn_reduce", "o_proj", "gate_up", "down", "router", "route", "expert_gate_up", "expert_down", "moe_combine", "lm_head", "argmax_push", "argmax"]
for l in sorted(set(layers)):
    if l not in (0, 1, 15, 31, 32): continue
    base = min(v[0] for (ll, k), v in ph.items() if ll == l)
    row = []
    for k in order:
        if (l, k) in ph:
            a, b, n, r, _ = ph[(l, k)]
            row.append(f"{k} {(a-base)/1e3:6.1f}-{(b-base)/1e3:6.1f} (n{n} {r/n/1e3:.1f})")
    print(f"L{l}: " + " | ".join(row))
# average per-layer duration of each phase: last end(kind) - last end(previous kind)
mid = [l for l in set(layers) if 2 <= l < max(layers) - 1]
seq = [k for k in order if any((l, k) in ph for l in mid)]
tot = collections.Counter()
for l in mid:
    prev = max(v[1] for (ll, k), v in ph.items() if ll == l - 1)
    for k in seq:
        a, b = ph[(l, k)][0], ph[(l, k)][1]
        tot[k + " end-gap"] += b - prev; tot[k + " start-after-prev-end"] += a - prev
        prev = b
for k in seq:
    print(f"{k:12s} last end - previous phase's last end: {tot[k+' end-gap']/len(mid)/1e3:6.2f} us; first start - prev end {tot[k+' start-after-prev-end']/len(mid)/1e3:6.2f}")
print("layer period", (max(v[1] for (ll,k),v in ph.items() if ll==max(mid)) - max(v[1] for (ll,k),v in ph.items() if ll==min(mid)-1))/len(mid)/1e3)
