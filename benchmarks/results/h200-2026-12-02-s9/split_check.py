"""Are the graph-override variants (kv_splits 8, qkv_parts 1) wrong on the GPU, or was variants.py's comparison?
Each table run by the tl megakernel and by the reference executor (same weights, same KV cache, same rows).
Run: python .scratch/split_check.py MODEL"""
import dataclasses, sys, torch
sys.path.insert(0, "benchmarks")
from harness import decode_step
from distmk.graph.lowering import compile_step
from distmk.kernels.executor import TritonExecutor
from distmk.reference.executor import ReferenceExecutor
model = sys.argv[1]
engine, step = decode_step(model, 1, 512, kernel="tl", prefetch_kb=0)
dev = engine.executor.tokens.device
tokens, positions = torch.tensor(step.rows["tokens"], device=dev), torch.tensor(step.rows["positions"], device=dev)
bt = engine.executor.block_table[:1].clone()
for over in ({}, {"kv_splits": 8}, {"qkv_parts": 1}):
    table = compile_step(engine.spec, engine.plan, dataclasses.replace(engine.config, **over))
    outs = []
    for make in (lambda: TritonExecutor(table, engine.spec, engine.weights, engine.kv, engine.comm, engine.dtype,
                                        prefetch_kb=0),
                 lambda: ReferenceExecutor(table, engine.spec, engine.weights, engine.kv, engine.comm, engine.dtype)):
        ex = make()
        outs.append(ex.step(tokens, positions, bt)["logits"][:1].float().clone())
        del ex
    err = ((outs[0] - outs[1]).norm() / outs[1].norm()).item()
    print(f"{model} {over}: tl vs reference logits rel err {err:.2e}, argmax {outs[0].argmax().item()} "
          f"{outs[1].argmax().item()}", flush=True)
