"""python -m distmk.graph --model M --tp N: compile one rank's decode step and print its summary."""
import argparse
import collections
import sys
import time

from distmk.errors import DistmkError
from distmk.flags import COUNT, NON_NEGATIVE
from distmk.graph.flags import add_graph_args, graph_config
from distmk.graph.lowering import GraphConfig, compile_step
from distmk.graph.table import TYPE
from distmk.models.shard import plan_shard
from distmk.models.weights import open_model
from distmk.tasks import TASK_KINDS


def summary(table, spec, plan) -> str:
    counts = collections.Counter(TASK_KINDS[t].name for t in table.tasks[:, TYPE].tolist())
    qlen = (table.queue_ptr[1:] - table.queue_ptr[:-1]).tolist()
    c, s = table.config, table.schedule
    lines = [
        f"model {spec.architecture} layers={spec.num_layers} hidden={spec.hidden_size} heads={spec.num_heads}"
        f"/{spec.num_kv_heads} head_dim={spec.head_dim}",
        f"rank {plan.rank}/{plan.tp}: q heads {plan.num_heads}, kv heads {plan.num_kv_heads}, "
        f"intermediate {plan.inter}, vocab rows {plan.vocab}",
        *([f"sparse layers {len(spec.moe_layers)}: top {spec.experts_per_token} of {spec.num_experts} experts, "
           f"{plan.expert_inter} rows of each on this rank"] if spec.moe_layers else []),
        f"config: batch={c.batch} kv_splits={c.kv_splits} tile_rows={c.tile_rows} "
        f"lm_tile_rows={c.lm_tile_rows} workers={c.workers} context={c.context}",
        f"tasks: {table.num_tasks}   events: {len(table.event_need)}   "
        f"bytes: {int(table.cost.sum()) / 1e6:.1f} MB",
        "tasks per type:",
        *(f"  {k.name:<12} {counts[k.name]:>7}" for k in TASK_KINDS if counts[k.name]),
        f"queue length: min {min(qlen)}  mean {sum(qlen) / len(qlen):.1f}  max {max(qlen)}",
        f"estimated busy time per worker: {s['busy_s_min'] * 1e3:.3f} .. {s['busy_s_max'] * 1e3:.3f} ms",
        f"critical path (unlimited workers): {s['critical_path_s'] * 1e3:.3f} ms",
        f"estimated step time (schedule makespan): {s['makespan_s'] * 1e3:.3f} ms",
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m distmk.graph", description=__doc__)
    p.add_argument("--model", required=True, help="preset name or Hugging Face checkpoint directory")
    p.add_argument("--tp", type=COUNT, default=1)
    p.add_argument("--rank", type=NON_NEGATIVE, default=0)
    p.add_argument("--batch", type=COUNT, default=1)
    add_graph_args(p, str(GraphConfig.workers))
    p.add_argument("--context", type=COUNT, default=512, help="context length the cost model assumes")
    args = p.parse_args(argv)
    try:
        t0 = time.perf_counter()
        spec = open_model(args.model)[0]
        plan = plan_shard(spec, args.tp, args.rank)
        config = graph_config(args, batch=args.batch, workers=args.workers or GraphConfig.workers,
                              context=args.context)
        table = compile_step(spec, plan, config)
    except DistmkError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(summary(table, spec, plan))
    print(f"compiled in {time.perf_counter() - t0:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
