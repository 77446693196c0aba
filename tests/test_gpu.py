"""The triton backend on a GPU against the reference executor and transformers (skipped without CUDA)."""
import json
import subprocess
import sys

import pytest
import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from distmk.device.ring import _dequantized, cta_barrier, sync_mma_layout
from distmk.graph import GraphConfig
from distmk.runtime.engine import Engine
from conftest import PROMPT, REPO, SMALL, TINY, TINY_MOE, hf_greedy

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def sms() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count


@pytest.mark.parametrize("name", TINY + TINY_MOE)
def test_tiny_float32_tokens_equal_transformers(name):
    config = GraphConfig(**{**SMALL.__dict__, "workers": sms()})
    engine = Engine(name, backend="triton", device="cuda", config=config, autotune=False)
    tokens, logits = engine.generate(PROMPT, 32, return_logits=True)
    ref_tokens, ref_logits = hf_greedy(name, weights_device="cuda")
    assert tokens == ref_tokens
    assert (logits.cpu() - ref_logits).abs().max() / ref_logits.abs().max() < 1e-4


@pytest.mark.parametrize("name", TINY + TINY_MOE)
def test_tiny_prefill_chunks_on_the_gpu_equal_transformers(name):
    """A 40-token prompt prefilled on the GPU by matrix products in chunks of 16, 16 and 8 tokens (the last one's last
    row gives the first token), then decoded by the megakernel from the KV cache the chunks wrote: transformers'
    tokens (float32)."""
    prompt = [(7 * i + 3) % 50 for i in range(40)]
    config = GraphConfig(**{**SMALL.__dict__, "workers": sms()})
    engine = Engine(name, backend="triton", device="cuda", config=config, autotune=False, prefill_chunk=16)
    tokens, logits = engine.generate(prompt, 16, return_logits=True)
    ref_tokens, ref_logits = hf_greedy(name, tuple(prompt), 16, weights_device="cuda")
    assert tokens == ref_tokens
    assert (logits.cpu() - ref_logits).abs().max() / ref_logits.abs().max() < 1e-4


@pytest.mark.parametrize("name, tile_rows", [("tiny-llama", 32), ("tiny-qwen3", 32), ("tiny-qwen3", 24)]
                         + [(name, 32) for name in TINY_MOE])
def test_tiny_bfloat16_matches_reference_executor(name, tile_rows):
    """One 16-row step (teacher forcing): bf16 rounding may flip near-ties, so agreement, not identity. Attention
    finishes the heads QKV leaves raw, each row's keys of this step from the rows before it (tasks/attention.py
    step_key_writers); tiles of 24 rows end inside tiny-qwen3's heads. For the
    mixture-of-experts presets the 16 rows choose among the experts together (tiny-mixtral: 32 choices of 4); a
    routing near-tie tipped the other way moves a row's logits far more than rounding does (bf16 against float32
    on the CPU: 1.6% of tiny-qwen3-moe's choices), so the logits are compared on the rows that every sparse layer
    routed alike (route_history; all rows of a dense model), and those must be 14 of 16 or more."""
    config = GraphConfig(batch=16, tile_rows=tile_rows, workers=sms())
    prompt = list(range(10, 26))
    outs = []
    for backend in ("reference", "triton"):
        engine = Engine(name, backend=backend, device="cuda", dtype=torch.bfloat16, config=config, autotune=False)
        assert backend == "reference" or engine.executor.kernel_name == ("ring" if hopper() else "tl")
        buf = engine.step(prompt, range(16), [engine.kv.allocate([], 16)] * 16)
        outs.append((buf["next_token"][:16].tolist(), buf["logits"][:16].clone(),
                     buf["route_history"][:, :16].sort(dim=-1).values))
    (ref_tokens, ref_logits, ref_routes), (tokens, logits, routes) = outs
    assert sum(a == b for a, b in zip(tokens, ref_tokens)) >= 15, (tokens, ref_tokens)
    alike = (routes == ref_routes).all(dim=-1).all(dim=0)                     # [16] rows routed alike everywhere
    assert alike.sum().item() >= 14, alike
    assert ((logits[alike] - ref_logits[alike]).norm() / ref_logits[alike].norm()).item() < 2e-2


def hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


@pytest.mark.skipif(not hopper(), reason="the ring megakernel needs a Hopper GPU")
@pytest.mark.parametrize("name, batch, fused, quantize", [
    ("tiny-llama", 16, 0, None), ("tiny-qwen3", 4, 0, None), ("tiny-qwen2", 1, 0, None), ("tiny-mistral", 8, 0, None),
    ("qwen3-0.6b", 8, 0, None), ("llama-3.2-1b", 1, 0, None), ("tiny-qwen3-moe", 1, 0, None),
    ("tiny-mixtral", 4, 0, None), ("qwen3-0.6b", 8, 1, None), ("tiny-qwen3-moe", 1, 1, None),
    ("llama-3.2-1b", 1, 0, "fp8"), ("qwen3-0.6b", 8, 0, "fp8")])
def test_ring_megakernel_matches_tl_megakernel(name, batch, fused, quantize):
    """The weight-ring megakernel against the tl one: the same table, weights and KV cache, one bf16 step of
    `batch` rows at different positions. Mixture-of-experts steps route alike on both (batch 1: the o_proj tiles'
    shares of the gate's logits, batch 4: router tiles and rows that share experts). `fused`: the attention
    groups combined by their last split, the route by the o_proj tile that adds the last share of the gate's logits
    (GraphConfig.fused_attn_reduce, fused_route; 0: attn_reduce and route tasks). `quantize` fp8: the ring streams
    every product in e4m3, the tl kernel reads the same weights dequantized."""
    from distmk.kernels.executor import TritonExecutor
    engine = Engine(name, backend="triton", device="cuda", dtype=torch.bfloat16, max_context=256, autotune=False,
                    config=GraphConfig(batch=batch, workers=sms(), fused_attn_reduce=fused, fused_route=fused),
                    quantize=quantize, kernel_options={"stream_e4m3": int(quantize == "fp8")})
    assert len(engine.weights.fp8) == (5 if quantize else 0)
    assert engine.executor.kernel_name == "ring"
    kv_values = torch.Generator(device="cuda").manual_seed(0)
    engine.kv.k.normal_(generator=kv_values)
    engine.kv.v.normal_(generator=kv_values)
    tokens = torch.randint(0, engine.spec.vocab_size, (batch,), generator=torch.Generator().manual_seed(1)).tolist()
    positions = [5 + 13 * b for b in range(batch)]          # < max_context
    blocks = [engine.kv.allocate([], 256) for _ in range(batch)]
    table = torch.zeros(batch, engine.kv.blocks_per_seq, dtype=torch.int64)
    for b, row in enumerate(blocks):
        table[b, :len(row)] = torch.as_tensor(row)
    outs = []
    for kernel in ("ring", "tl"):
        # made after the ring's step: it holds the e4m3 values' columns in their own order again, in place
        executor = engine.executor if kernel == "ring" else TritonExecutor(
            engine.table, engine.spec, engine.weights, engine.kv, engine.comm, engine.dtype, kernel="tl")
        buf = executor.step(torch.tensor(tokens, device="cuda"), torch.tensor(positions, device="cuda"),
                            table.cuda())
        outs.append((buf["next_token"][:batch].tolist(), buf["logits"][:batch].clone(),
                     buf["route_history"][:, :batch].clone()))
    (ring_tokens, ring_logits, ring_routes), (tl_tokens, tl_logits, tl_routes) = outs
    assert torch.equal(ring_routes, tl_routes)
    # the two differ in rounding only (the ring's attention products are exact float32, the tl one's tf32)
    assert ((ring_logits - tl_logits).norm() / tl_logits.norm()).item() < 2e-2
    # so where their greedy tokens differ, the tl logits of the two are a tie within that rounding (random weights
    # leave top-2 gaps of 0.007 on logits of 5: an unseeded KV cache once flipped 2 of 8 rows of qwen3-0.6b)
    for b, (ring_token, tl_token) in enumerate(zip(ring_tokens, tl_tokens)):
        rounding = (ring_logits[b] - tl_logits[b]).abs().max().item()
        gap = (tl_logits[b, tl_token] - tl_logits[b, ring_token]).item()
        assert ring_token == tl_token or gap <= 2 * rounding, (b, ring_token, tl_token, gap, rounding)


def test_graph_replay_equals_plain_launches():
    config = GraphConfig(batch=4, tile_rows=32, workers=sms())
    outs = [Engine("tiny-qwen2", backend="triton", device="cuda", config=config, autotune=False,
                   kernel_options={"cuda_graph": graph}).generate(PROMPT, 24) for graph in (True, False)]
    assert outs[0] == outs[1] == hf_greedy("tiny-qwen2", tuple(PROMPT), 24, weights_device="cuda")[0]


def hf_fp32_on_gpu(name):
    from transformers import AutoConfig, AutoModelForCausalLM
    from distmk.models.presets import preset
    from distmk.models.weights import RandomWeights
    spec = preset(name)
    cfg = spec.to_hf_config()
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg),
                                                 dtype=torch.float32)
    source = RandomWeights(spec, device="cuda")
    with torch.no_grad():      # the bf16 weights distmk runs, computed in float32
        for pname, param in model.named_parameters():
            param.copy_(source.full("model.embed_tokens.weight" if pname == "lm_head.weight" and
                                    spec.tie_word_embeddings else pname).to(torch.bfloat16))
    return model.eval()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama-3-8b", "qwen3-8b"])
def test_8b_bfloat16_against_float32_transformers(name):
    prompt, steps = list(range(100, 116)), 128
    hf = hf_fp32_on_gpu(name)
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=steps, do_sample=False,
                          output_logits=True, return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)
    ref_tokens = out.sequences[0, len(prompt):].tolist()
    ref_first_logits = out.logits[0][0].float()
    del hf, out
    torch.cuda.empty_cache()
    engine = Engine(name, backend="triton", device="cuda", dtype=torch.bfloat16,
                    config=GraphConfig(batch=16, workers=sms()), max_context=256, autotune=False)
    _, logits = engine.generate(prompt, 1, return_logits=True)
    rel = ((logits[0].cuda() - ref_first_logits).norm() / ref_first_logits.norm()).item()
    # greedy agreement, teacher-forced: distmk's argmax at every position of transformers' sequence
    seq = prompt + ref_tokens
    blocks = engine.kv.allocate([], len(seq))
    predicted = []
    for start in range(0, len(seq) - 1, 16):
        chunk = seq[start:min(start + 16, len(seq) - 1)]
        buf = engine.step(chunk, range(start, start + len(chunk)), [blocks] * len(chunk))
        predicted += buf["next_token"][:len(chunk)].tolist()
    agree = sum(p == t for p, t in zip(predicted[len(prompt) - 1:], ref_tokens)) / steps
    print(json.dumps({"model": name, "logits_rel_err": rel, "greedy_agreement": agree}))
    assert rel < 1e-2 and agree >= 0.95


def against_float32(engine, prompt: list[int], steps: int) -> dict:
    """A bf16 engine's logits against tests/float32_reference.py's over the engine's own weights (the float32 model
    of the same bf16-rounded weights, upcast where used, of the experts those chosen). The engine generates
    `steps` tokens greedily, then steps through its own sequence again 16 positions at a time (teacher forcing,
    as the rows of a prompt), keeping each position's greedy token and logits and every sparse layer's experts
    (the route tasks' route_history). Random weights leave many routing near-ties, which bf16 rounding upstream
    tips (float32_reference.py's docstring: on a 4-layer cut of qwen3-30b-a3b the logits moved 10%), so the
    reference runs twice: routed as the engine routed (logits_rel_err: of the first generated token; relative
    norms; greedy_agreement: of the positions from the prompt's last on) and routed by itself (own_routing_*)."""
    from float32_reference import float32_logits
    spec = engine.spec
    tokens = engine.generate(prompt, steps, stop_on_eos=False)
    seq = prompt + tokens
    blocks = engine.kv.allocate([], len(seq))
    predicted, logits, routes = [], [], []
    for start in range(0, len(seq) - 1, 16):
        chunk = seq[start:min(start + 16, len(seq) - 1)]
        buf = engine.step(chunk, range(start, start + len(chunk)), [blocks] * len(chunk))
        predicted += buf["next_token"][:len(chunk)].tolist()
        logits.append(buf["logits"][:len(chunk), :spec.vocab_size].float().clone())
        routes.append(buf["route_history"][:, :len(chunk)].clone())
    engine.kv.release(blocks)
    logits, routes = torch.cat(logits), torch.cat(routes, dim=1)       # [positions, V], [layers, positions, k]
    routes = routes if spec.moe_layers else None
    pinned = float32_logits(spec, engine.weights, seq[:-1], routes=routes)
    free, own_routes = float32_logits(spec, engine.weights, seq[:-1], return_routes=True)

    def rel(ref):
        return ((logits - ref).norm(dim=-1) / ref.norm(dim=-1)).cpu()

    first = len(prompt) - 1              # the prompt's last position predicts the first generated token
    generated = torch.tensor(predicted[first:])

    def agreement(ref):
        return (ref[first:].argmax(dim=-1).cpu() == generated).float().mean().item()

    rel_pinned, rel_free = rel(pinned), rel(free)
    same = (own_routes.sort(-1).values == routes.sort(-1).values).all(-1).float().mean().item() if routes is not None \
        else None
    return {"logits_rel_err": rel_pinned[first].item(), "greedy_agreement": agreement(pinned),
            "rel_err_median": rel_pinned[first:].median().item(), "rel_err_max": rel_pinned[first:].max().item(),
            "own_routing_logits_rel_err": rel_free[first].item(), "own_routing_greedy_agreement": agreement(free),
            "same_experts_fraction": same, "teacher_forced_equals_generated": predicted[first:] == tokens}


@pytest.mark.slow
def test_qwen3_30b_a3b_bfloat16_against_float32():
    """bf16 qwen3-30b-a3b (60 GB) against the float32 model of the same bf16-rounded weights (against_float32:
    transformers' float32 copy, 120 GB, does not fit beside distmk's): routed as distmk routed, the first token's
    logits within 1e-2 and the same greedy token at 95% of 64 teacher-forced positions. The reference routed by
    itself is printed beside them."""
    engine = Engine("qwen3-30b-a3b", backend="triton", device="cuda", dtype=torch.bfloat16,
                    config=GraphConfig(batch=16, workers=sms()), max_context=256, autotune=False)
    figures = {"model": "qwen3-30b-a3b", **against_float32(engine, list(range(100, 116)), 64)}
    print(json.dumps(figures))
    assert figures["logits_rel_err"] < 1e-2 and figures["greedy_agreement"] >= 0.95, figures


WATCHDOG_SCRIPT = """
import time, torch
from distmk.graph import GraphConfig
from distmk.kernels.executor import WatchdogTimeout
from distmk.runtime.engine import Engine
engine = Engine(MODEL, backend="triton", device=DEVICE, config=GraphConfig(batch=2, workers=WORKERS),
                dtype=DTYPE, kernel_options={"timeout_s": 0.5, "cuda_graph": False, "kernel": KERNEL}, autotune=False)
assert engine.executor.kernel_name == KERNEL or KERNEL == "auto", engine.executor.kernel_name
healthy = engine.generate([1, 2, 3], 2)
stuck = engine.table.event_names.index(EVENT)
engine.executor.dev_table.event_need[stuck] += 1             # this event can never complete now
t0 = time.time()
try:
    engine.generate([1, 2, 3], 2)
except WatchdogTimeout as e:
    print("WATCHDOG", round(time.time() - t0, 2), e)
engine.executor.dev_table.event_need[stuck] -= 1             # and the engine recovers afterwards
print("AFTER", engine.generate([1, 2, 3], 2) == healthy)
"""


def run_watchdog_script(device: str, workers: int, env=None, kernel: str = "auto", dtype: str = "float32",
                        model: str = "tiny-llama", event: str = "L0.attn") -> str:
    """Provoke a never-signalled event in a subprocess: passes only if the error arrives and nothing hangs."""
    script = (WATCHDOG_SCRIPT.replace("DEVICE", repr(device)).replace("WORKERS", str(workers))
              .replace("MODEL", repr(model)).replace("EVENT", repr(event))
              .replace("KERNEL", repr(kernel)).replace("DTYPE", f"torch.{dtype}"))
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env=env)
    assert proc.returncode == 0, proc.stderr
    assert "WATCHDOG" in proc.stdout and "the step stalled at event" in proc.stdout, proc.stdout
    assert f"'{event}' at" in proc.stdout.split("stalled at")[1]
    assert "rank 0 worker" in proc.stdout and "AFTER True" in proc.stdout
    return proc.stdout


def test_watchdog_reports_the_stuck_task_and_nothing_hangs():
    run_watchdog_script("cuda", sms())


@pytest.mark.skipif(not hopper(), reason="the ring megakernel needs a Hopper GPU")
def test_ring_watchdog_reports_the_stuck_task_and_nothing_hangs():
    """The ring kernel's mbarrier waits have no bound of their own: each waits only for this worker's own copies
    and warps. A worker whose event wait gives up runs the rest of its queue without waiting, so every ring slot
    is still consumed and the launch ends (ring_megakernel's docstring); this is that path, on the GPU."""
    run_watchdog_script("cuda", sms(), kernel="ring", dtype="bfloat16")


@pytest.mark.skipif(not hopper(), reason="the ring megakernel needs a Hopper GPU")
def test_ring_watchdog_with_a_route_that_never_comes():
    """The experts' weights wait for the route (the producer's own bounded wait, tasks/route.py routed_experts): a
    route event that never completes is reported, and the producer's verdict keeps its slots and the tasks
    partition's in step, so the launch still ends."""
    run_watchdog_script("cuda", sms(), kernel="ring", dtype="bfloat16", model="tiny-mixtral", event="L0.route")


def test_trace_records_every_task(tmp_path):
    from harness import decode_engine
    from distmk.kernels.trace import breakdown, write_trace
    engine = decode_engine("tiny-mistral", batch=2, context=64, trace=True)
    timings = engine.executor.timings()
    assert (timings[:, 2] >= timings[:, 1]).all() and (timings[:, 1] >= timings[:, 0]).all() and (timings[:, 0] > 0).all()
    write_trace(str(tmp_path / "t.json"), engine.table, timings)
    events = [e for e in json.load(open(tmp_path / "t.json"))["traceEvents"] if e["cat"] != "wait"]
    assert len(events) == engine.table.num_tasks
    assert "attention" in breakdown(engine.table, timings)


def test_autotune_measures_once_then_reads_the_cache(tmp_path, monkeypatch):
    from distmk.kernels import autotune
    monkeypatch.setenv("DISTMK_CACHE_DIR", str(tmp_path))
    config = GraphConfig(batch=2, workers=sms())
    first = Engine("tiny-mistral", backend="triton", device="cuda", dtype=torch.bfloat16, config=config)
    entry = json.load(open(autotune.cache_file()))
    (key, value), = entry.items()
    assert len(value["timings_ms"]) == len(autotune.CANDIDATES) and all(v > 0 for v in value["timings_ms"].values())
    stamp = (tmp_path / "autotune.json").stat().st_mtime_ns
    second = Engine("tiny-mistral", backend="triton", device="cuda", dtype=torch.bfloat16, config=config)
    assert (tmp_path / "autotune.json").stat().st_mtime_ns == stamp        # read, not measured again
    assert first.generate(PROMPT, 8) == second.generate(PROMPT, 8)


# ---- virtual ranks: tp ranks on this one GPU (comm/cpu.py ThreadRanks), the ring megakernel's exchanges ----

def tp_ready(name: str):
    """A tiny preset's family widened so that tp 2, 4 and 8 shard it onto the ring's 64-column slots: 8 query heads
    of 64, an MLP and experts 512 wide (the tiny presets' heads are 16-32 wide, under a slot at tp 4 and 8)."""
    import dataclasses
    from distmk.models.presets import preset
    spec = preset(name)
    return dataclasses.replace(spec, num_heads=8, head_dim=64, intermediate_size=512,
                               moe_intermediate_size=512 if spec.moe_layers else 0)


@pytest.fixture(scope="module")
def tp_ready_checkpoints(tmp_path_factory):
    """Each family's tp_ready model as a checkpoint directory (config.json, and distmk's seeded random weights
    under their checkpoint names)."""
    from safetensors.torch import save_file
    from distmk.models.weights import RandomWeights
    paths = {}
    for name in TINY + TINY_MOE:
        spec, path = tp_ready(name), tmp_path_factory.mktemp(name)
        save_file({k: v.contiguous() for k, v in RandomWeights(spec).state_dict().items()},
                  str(path / "model.safetensors"))
        (path / "config.json").write_text(json.dumps(spec.to_hf_config()))
        paths[name] = str(path)
    return paths


def virtual_ranks(tp: int, fn):
    """fn(rank, comm) on tp virtual ranks (threads of this process on this GPU); their results in rank order."""
    from distmk.comm.cpu import run_simulated_ranks
    return run_simulated_ranks(tp, fn, timeout=600)


VIRTUAL_TP = [(name, tp, 8) for name in TINY + TINY_MOE for tp in (2, 4, 8)] + \
             [(name, 2, 1) for name in TINY + TINY_MOE] + [("tiny-llama", 8, 1), ("tiny-qwen3-moe", 4, 1)]


@pytest.mark.skipif(not hopper(), reason="the ring megakernel needs a Hopper GPU")
@pytest.mark.parametrize("name, tp, batch", VIRTUAL_TP)
def test_ring_at_virtual_tp_equals_the_float32_reference(name, tp, batch, tp_ready_checkpoints):
    """tp ranks of the ring megakernel on this GPU (SMs // tp workers each, exchanges through peer pointers) step
    through a 24-token sequence `batch` rows a step (teacher forcing): every rank's residual stream and greedy tokens
    bit-identical, and each position's logits against the float32 model of the same bf16 weights
    (float32_reference.py, routed as distmk routed): within 2e-2, and the same greedy token unless the reference's
    top two are a tie within that rounding."""
    ring_against_float32(tp_ready_checkpoints[name], tp, batch)


EXPERTS = {"expert_gate", "expert_up", "expert_down"}
# at tp=2 tiny-qwen3's every K is a multiple of 128 (the others': test_ring_refuses_e4m3_products_it_cannot_stream)
FP8_RING = [(name, 1, batch) for name in TINY + TINY_MOE for batch in (1, 8)] + [("tiny-qwen3", 2, 8)]


@pytest.mark.skipif(not hopper(), reason="the ring megakernel needs a Hopper GPU")
@pytest.mark.parametrize("name, tp, batch", FP8_RING)
def test_ring_streaming_e4m3_weights_equals_the_float32_reference(name, tp, batch):
    """--quantize fp8 on the ring: the products whose rank slices hold whole 128 x 128 blocks stream in e4m3
    (device/ring.py mma_block_fp8), checked as the bf16 ring is, against the float32 model of the same dequantized
    weights."""
    streamed = ring_against_float32(name, tp, batch, quantize="fp8", stream_e4m3=1)
    assert streamed and set(streamed) <= {"wqkv", "wo", "w_gate", "w_up", "w_down", *EXPERTS}
    assert EXPERTS <= set(streamed) if name in TINY_MOE else True       # the experts' tiles stream e4m3 too


@gluon.jit
def _dequantize_part(values, scales, out):
    """out = device/ring.py _dequantized of a [64, 128] e4m3 part (values, row-major, each row's columns in the ring's
    order) with a scale a row, the part staged in shared memory and loaded as the ring's loop loads it."""
    operand: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=sync_mma_layout(4), k_width=2)
    blocked: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])
    part = gl.allocate_shared_memory(gl.float8e4nv, [64, 128],
                                     gl.NVMMASharedLayout.get_default_for([64, 128], gl.float8e4nv))
    r = gl.arange(0, 64, layout=gl.SliceLayout(1, blocked))
    c = gl.arange(0, 128, layout=gl.SliceLayout(0, blocked))
    part.store(gl.load(values + r[:, None] * 128 + c[None, :]))
    cta_barrier()
    ro = gl.arange(0, 64, layout=gl.SliceLayout(1, operand))
    co = gl.arange(0, 128, layout=gl.SliceLayout(0, operand))
    w = _dequantized(part, gl.load(scales + ro), operand)
    gl.store(out + ro[:, None] * 128 + co[None, :], w)


@pytest.mark.skipif(not hopper(), reason="the ring megakernel needs a Hopper GPU")
def test_the_ring_dequantizes_every_e4m3_code_as_the_reference_does():
    """device/ring.py _dequantized (e4m3 -> bf16 by integer operations, one bf16 multiply by the scale) on every
    e4m3 code but NaN, with scales of bf16 values from about 2^-20 to 2^6, its columns stored in the ring's order
    (part_columns): bit for bit the reference's weights (models/fp8.py dequantize, rounded once to bf16), subnormals
    and signed zeros included, each in its own column."""
    from distmk.device.ring import part_columns
    from distmk.models.fp8 import bf16_scales, dequantize, in_block_order
    codes = (torch.arange(64 * 128) * 7).remainder(256).to(torch.uint8).reshape(64, 128)     # no column alike
    codes[codes.remainder(128) == 127] = 0                  # the NaN codes 0x7f and 0xff
    values = codes.view(torch.float8_e4m3fn).cuda()
    scales = bf16_scales(2.0 ** torch.linspace(-20, 6, 64) * (1 + torch.rand(64))).cuda()
    got = torch.empty(64, 128, dtype=torch.bfloat16, device="cuda")
    stored = in_block_order(codes, torch.tensor(part_columns())).view(torch.float8_e4m3fn).cuda()
    _dequantize_part[(1,)](stored, scales, got, num_warps=4)
    expected = dequantize(values, scales[:, None], (1, 128)).to(torch.bfloat16)
    assert torch.equal(got.view(torch.int16), expected.view(torch.int16))


@pytest.mark.skipif(not hopper(), reason="the ring megakernel needs a Hopper GPU")
def test_fp8_checkpoint_on_the_ring_gives_the_tokens_of_transformers_fp8(tmp_path):
    """A block-layout FP8 checkpoint (128 x 128) as transformers runs it on a GPU (its fine-grained FP8 linear
    layers: e4m3 products with activations quantized per 128 columns) and as the ring streams it (e4m3 weights,
    bf16 activations): the same greedy tokens."""
    from transformers import AutoModelForCausalLM
    from test_fp8 import write_fp8
    # transformers' FP8 linear layers run a kernel that the `kernels` package fetches from the Hugging Face Hub
    pytest.importorskip("kernels", reason="transformers' FP8 layers on a GPU need the kernels package (and the Hub)")
    path = tmp_path / "fp8"
    write_fp8(path, "tiny-qwen3", "block", block=(128, 128))
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16, device_map="cuda")
    assert "FP8" in type(model.model.layers[0].mlp.gate_proj).__name__          # not dequantized at load
    ids = torch.tensor([PROMPT], device="cuda")
    with torch.no_grad():
        theirs = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                                pad_token_id=0, eos_token_id=None)[0, len(PROMPT):].tolist()
    del model
    engine = Engine(str(path), backend="triton", device="cuda", dtype=torch.bfloat16, max_context=64, autotune=False,
                    config=GraphConfig(batch=1, workers=sms()), kernel_options={"kernel": "ring", "stream_e4m3": 1})
    assert engine.weights.fp8
    assert engine.generate(PROMPT, 12, stop_on_eos=False) == theirs


@pytest.mark.skipif(not hopper(), reason="torch._scaled_mm's block scales need a Hopper GPU")
@pytest.mark.parametrize("rows, n, k", [(1, 6144, 4096), (7, 6144, 4096), (16, 6144, 4096), (17, 512, 512),
                                        (512, 6144, 4096), (16, 512, 128), (17, 2048, 768)])
def test_scaled_mm_blocks_on_the_gpu_is_the_float32_product_of_the_quantized_operands(rows, n, k):
    """W8A8 prefill's product (torch._scaled_mm, blocks of 128 x 128 and activations a row and 128 columns; rows
    padded to a multiple of 16, a K that is not a multiple of 512 in float32): the float32 product of
    quantize_activations' input and the dequantized weight, within bf16's rounding of it."""
    from distmk.models.fp8 import DEFAULT_BLOCK, dequantize, quantize, quantize_activations, quantize_groups, \
        scaled_mm_blocks
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    values, scales = quantize(torch.randn(n, k, device="cuda") / k ** 0.5)
    got = scaled_mm_blocks(*quantize_groups(x), values, scales, torch.bfloat16).float()
    expected = quantize_activations(x) @ dequantize(values, scales, DEFAULT_BLOCK).t()
    assert ((got - expected).norm() / expected.norm()).item() < 2 ** -8


@pytest.mark.skipif(not hopper(), reason="the ring megakernel needs a Hopper GPU")
@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-qwen3-moe"])
def test_w8a8_prefill_on_the_gpu_moves_the_cache_by_e4m3_precision(name):
    """A prompt prefilled in chunks of 16 (compiled stages, CUDA graphs where they apply) by an engine streaming e4m3
    products, W8A8 (the default on Hopper; the tiny models' K of 128 and 256 take scaled_mm_blocks' float32 sums,
    torch._scaled_mm is the test above's) against W8A16: the prompt's KV cache within e4m3's precision (as
    test_fp8's CPU test). Decode steps after it are left out: a token they choose differently writes a whole
    position apart."""
    from distmk.runtime.prefill import prefill_chunk
    prompt = [(7 * i + 3) % 50 for i in range(40)]
    caches = {}
    for mode in ("w8a16", None):
        engine = Engine(name, backend="triton", device="cuda", dtype=torch.bfloat16, max_context=64, autotune=False,
                        prefill_chunk=16, config=GraphConfig(batch=1, workers=sms()), quantize="fp8",
                        kernel_options={"kernel": "ring", "stream_e4m3": 1}, prefill_fp8=mode)
        assert engine.prefill_fp8 == (mode or "w8a8")
        blocks = engine.kv.allocate([], len(prompt))
        for start in range(0, len(prompt), 16):
            prefill_chunk(engine, prompt[start:start + 16], start, blocks)
        caches[engine.prefill_fp8] = [c.float().clone() for c in (engine.kv.k, engine.kv.v)]
    for w8a16, w8a8 in zip(caches["w8a16"], caches["w8a8"]):
        assert 0 < ((w8a8 - w8a16).norm() / w8a16.norm()).item() < 2 ** -3


def ring_against_float32(model: str, tp: int, batch: int, quantize: str | None = None,
                         stream_e4m3: int = 0) -> list[str]:
    """The ring megakernel at `tp` (virtual ranks where > 1) through a 24-token sequence `batch` rows a step against
    the float32 model of the same weights (see test_ring_at_virtual_tp_equals_the_float32_reference); returns the
    products rank 0 streamed in e4m3."""
    from float32_reference import float32_logits
    seq = [(7 * i + 3) % 500 for i in range(24)]

    def rank(r, comm):
        engine = Engine(model, tp=tp, rank=r, comm=comm, backend="triton", device="cuda", dtype=torch.bfloat16,
                        max_context=64, autotune=False, kernel_options={"kernel": "ring", "stream_e4m3": stream_e4m3},
                        config=GraphConfig(batch=batch, workers=sms() // tp), quantize=quantize)
        blocks = engine.kv.allocate([], len(seq))
        tokens, logits, routes, same = [], [], [], True
        for start in range(0, len(seq), batch):
            chunk = seq[start:start + batch]
            buf = engine.step(chunk, range(start, start + len(chunk)), [blocks] * len(chunk))
            n = len(chunk)
            tokens += buf["next_token"][:n].tolist()
            logits.append(engine.full_logits(buf, n).float())
            routes.append(buf["route_history"][:, :n].clone())
            same &= all(torch.equal(x, buf["x"][:n]) for x in comm.gather(buf["x"][:n]))
            same &= all(torch.equal(t, buf["next_token"][:n]) for t in comm.gather(buf["next_token"][:n]))
        reference = engine if tp == 1 else None     # its weights are the float32 model's (dequantized: fp8)
        return (engine.executor.kernel_name, tokens, torch.cat(logits), torch.cat(routes, dim=1), same,
                sorted(engine.weights.fp8), reference)

    results = virtual_ranks(tp, rank)
    kernel, tokens, logits, routes, _, streamed, engine = results[0]
    assert kernel == "ring" and all(r[4] for r in results)
    if engine is None:
        engine = Engine(model, backend="reference", device="cuda", dtype=torch.bfloat16, max_context=64,
                        quantize=quantize)
    ref = float32_logits(engine.spec, engine.weights, seq, routes=routes if engine.spec.moe_layers else None)
    rounding = (logits - ref).abs().max(dim=-1).values
    rel = ((logits - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item()
    assert rel < 2e-2, rel
    chosen = ref.gather(1, torch.tensor(tokens, device=ref.device)[:, None])[:, 0]
    gap = ref.max(dim=-1).values - chosen
    assert (gap <= 2 * rounding).all(), (tokens, ref.argmax(dim=-1).tolist())
    return streamed


VIRTUAL_WATCHDOG_SCRIPT = """
import time, torch
from distmk.comm.cpu import run_simulated_ranks
from distmk.graph import GraphConfig
from distmk.kernels.executor import WatchdogTimeout
from distmk.runtime.engine import Engine

def rank(r, comm):
    engine = Engine("tiny-llama", tp=2, rank=r, comm=comm, backend="triton", device="cuda", dtype=torch.bfloat16,
                    config=GraphConfig(batch=2, workers=WORKERS), autotune=False,
                    kernel_options={"timeout_s": 0.5, "cuda_graph": False, "kernel": "ring"})
    assert engine.executor.kernel_name == "ring"
    engine.generate([1, 2, 3], 2)
    if r == 0:                   # rank 0's attention can never start: both ranks' steps stall
        engine.executor.dev_table.event_need[engine.table.event_names.index("L0.qkv")] += 1
    t0 = time.time()
    try:
        engine.generate([1, 2, 3], 2)
    except WatchdogTimeout as e:
        return round(time.time() - t0, 2), str(e)
    return None

for r, report in enumerate(run_simulated_ranks(2, rank)):
    print("RANK", r, report)
"""


@pytest.mark.skipif(not hopper(), reason="the ring megakernel needs a Hopper GPU")
def test_ring_watchdog_at_virtual_tp2_names_the_rank_and_task():
    """Virtual tp=2 on the ring: one rank's event that never completes stalls both ranks' steps (the other waits for
    its pushes); each rank's watchdog reports within its bound, naming its rank and task, and nothing hangs."""
    script = VIRTUAL_WATCHDOG_SCRIPT.replace("WORKERS", str(sms() // 2))
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RANK")]
    assert len(lines) == 2 and all("waited on event" in line for line in lines), proc.stdout
    assert "rank 0 worker" in lines[0] and "'L0.qkv' at" in lines[0].split("stalled at")[1]
    assert "rank 1 worker" in lines[1]


def test_virtual_ranks_that_do_not_fit_the_gpu_are_refused():
    """Every rank's workers must be resident at once: more than the SMs is an error naming the count."""
    from distmk.errors import DistmkError

    def rank(r, comm):
        with pytest.raises(DistmkError, match=f"2 ranks x {sms()} workers cannot run on {sms()} SMs"):
            Engine("tiny-llama", tp=2, rank=r, comm=comm, backend="triton", device="cuda", autotune=False,
                   config=GraphConfig(batch=2, workers=sms()))
    virtual_ranks(2, rank)


TP2_SCRIPT = """
import json, sys, time, torch
import torch.distributed as dist
from distmk.comm.nvshmem import NvshmemComm
from distmk.dist import detect_launch, init_process_group
from distmk.graph import GraphConfig
from distmk.kernels.executor import WatchdogTimeout
from distmk.runtime.engine import Engine
launch = detect_launch()
torch.cuda.set_device(launch.local_rank)
init_process_group(launch, "nccl")
comm = NvshmemComm(launch)
report = {}
try:
    engine = Engine("tiny-llama", tp=2, rank=launch.rank, comm=comm, backend="triton", device="cuda",
                    config=GraphConfig(batch=4, workers=16), autotune=False,
                    kernel_options={"transport": TRANSPORT, "timeout_s": 1.0, "cuda_graph": False})
    report["transport"] = engine.executor.transport
    report["tokens"] = engine.generate([1, 2, 3, 4, 5, 6, 7], 32)
    x = engine.executor.buf["x"]
    report["identical"] = all(torch.equal(t, x) for t in comm.gather(x))   # the residual stream after the last step
    blocks = engine.kv.allocate([], 8)
    t0 = time.time()
    if launch.rank == 0:            # rank 1 stays away: rank 0's exchange never completes
        try:
            engine.step([1], [0], [blocks])
        except WatchdogTimeout as e:
            report["watchdog"] = str(e)
    report["watchdog_s"] = round(time.time() - t0, 2)
    dist.barrier()
finally:
    comm.close()
print("REPORT", json.dumps(report), flush=True)
"""


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("transport", ["pointer", "nvshmem"])
def test_tp2_transports_tokens_bit_identical_ranks_and_watchdog(transport, tmp_path):
    """Two ranks, one GPU each, over each exchange transport: transformers' tokens, bit-identical residual
    streams on both ranks, and a rank whose peer never pushes gets a watchdog error naming it (no hang)."""
    from conftest import torchrun
    script = tmp_path / "tp2.py"
    script.write_text(TP2_SCRIPT.replace("TRANSPORT", repr(transport)))
    proc = torchrun(2, str(script), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "not freed" not in proc.stderr
    reports = [json.loads(line.split(" ", 1)[1]) for line in proc.stdout.splitlines() if line.startswith("REPORT")]
    assert len(reports) == 2
    ref_tokens = hf_greedy("tiny-llama", weights_device="cuda")[0]
    for r in reports:
        assert r["transport"] == transport and r["identical"] and r["tokens"] == ref_tokens
    watchdog = [r["watchdog"] for r in reports if "watchdog" in r]
    assert len(watchdog) == 1 and watchdog[0].startswith("rank 0 worker") and "waited on event" in watchdog[0]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3"])
def test_tp2_megakernel_over_nvshmem_matches_transformers(name):
    """Two ranks, one GPU each: exchanges through NVSHMEM symmetric memory inside the megakernel."""
    from conftest import torchrun
    from test_cli import only_json_line
    proc = torchrun(2, "-m", "distmk.generate", "--model", name, "--prompt-ids", "1,2,3,4,5,6,7",
                    "--max-new-tokens", "32", "--backend", "triton", "--device", "cuda", "--dtype", "float32",
                    "--json", timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "not freed" not in proc.stderr
    assert only_json_line(proc.stdout)["tokens"] == hf_greedy(name, weights_device="cuda")[0]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.skipif(__import__("shutil").which("mpirun") is None, reason="needs Open MPI's mpirun")
def test_tp2_megakernel_under_mpirun_matches_transformers():
    """The same two-GPU generation started by Open MPI (launch/mpirun.sh): NVSHMEM bootstraps over the
    process group that mpi4py's rendezvous set up."""
    from conftest import run_cli
    from test_cli import only_json_line
    proc = run_cli("bash", "launch/mpirun.sh", "2", "distmk.generate", "--model", "tiny-llama", "--prompt-ids",
                   "1,2,3,4,5,6,7", "--max-new-tokens", "32", "--backend", "triton", "--device", "cuda", "--dtype",
                   "float32", "--json", env={"DISTMK_PYTHON": sys.executable}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert only_json_line(proc.stdout)["tokens"] == hf_greedy("tiny-llama", weights_device="cuda")[0]
