"""The megakernel compiles for Hopper (sm_90) from this machine: Triton ships ptxas, so CI catches compile
errors and shared-memory overruns without a GPU. Shapes come from meta tensors, so 8B models cost nothing."""
import json
import pathlib
import subprocess
import sys

import pytest
import torch

from distmk.graph import GraphConfig
from distmk.graph.hardware import DEFAULT_WORKERS       # an H100 / H200's SM count: one program per SM
from distmk.runtime.engine import Engine

HOPPER_SHARED_BYTES = 227 * 1024


@pytest.mark.parametrize("name, dtype, batch, fused_route", [
    ("tiny-llama", torch.float32, 4, 0), ("tiny-qwen3", torch.float32, 4, 0), ("tiny-qwen2", torch.bfloat16, 8, 0),
    ("tiny-mistral", torch.bfloat16, 1, 0), ("llama-3-8b", torch.bfloat16, 1, 0), ("qwen3-8b", torch.bfloat16, 8, 0),
    ("qwen2.5-7b", torch.bfloat16, 64, 0), ("tiny-qwen3-moe", torch.float32, 4, 0),
    ("tiny-mixtral", torch.bfloat16, 8, 0), ("qwen3-30b-a3b", torch.bfloat16, 64, 0),
    ("mixtral-8x7b", torch.bfloat16, 1, 0), ("qwen3-30b-a3b", torch.bfloat16, 1, 0),
    ("mixtral-8x7b", torch.bfloat16, 8, 0),      # benchmarks/decode.py's too
    ("qwen3-30b-a3b", torch.bfloat16, 1, 1),     # the o_proj tile that adds the last share routes
])
def test_megakernel_compiles_for_sm90(name, dtype, batch, fused_route):
    engine = Engine(name, backend="triton", device="meta", dtype=dtype, max_context=1024,
                    config=GraphConfig(batch=batch, workers=DEFAULT_WORKERS, fused_route=fused_route))
    compiled = engine.executor.compile_ahead(arch=90)
    assert compiled.metadata.shared <= HOPPER_SHARED_BYTES
    assert "megakernel" in compiled.asm["ptx"]


def test_tl_megakernel_reading_e4m3_products_fits_in_hopper_shared_memory():
    """The tl kernel's tiles that dequantize e4m3 products as they load them (stream_e4m3 on the tl kernel) fit in
    Hopper's shared memory: at the default four pipeline stages they did not (252 KB, llama-3.2-1b on an H100)."""
    engine = Engine("llama-3.2-1b", backend="triton", device="meta", dtype=torch.bfloat16, max_context=256,
                    config=GraphConfig(batch=1, workers=DEFAULT_WORKERS), quantize="fp8",
                    kernel_options={"kernel": "tl", "stream_e4m3": 1})
    assert engine.executor.kernel_name == "tl" and len(engine.weights.fp8) == 5
    compiled = engine.executor.compile_ahead(arch=90)
    assert compiled.metadata.shared <= HOPPER_SHARED_BYTES


def converts_e4m3(ptx: str) -> bool:
    """Whether a ring kernel's PTX holds device/ring.py's e4m3 -> bf16 conversion (E4M3_QUAD_AS_BF16's byte spread)
    of parts loaded 16 bytes at a time (part_layout)."""
    return "0, 0x9180;" in ptx and "0, 0xB3A2;" in ptx and "ld.shared.v4" in ptx


@pytest.mark.parametrize("name, batch, fused_route, quantize", [
    ("tiny-qwen2", 16, 0, None), ("llama-3-8b", 1, 0, None), ("qwen3-8b", 8, 0, None), ("tiny-mixtral", 8, 0, None),
    ("qwen3-30b-a3b", 1, 0, "fp8"), ("qwen3-30b-a3b", 1, 1, None), ("llama-3-8b", 1, 0, "fp8")])
def test_ring_megakernel_compiles_for_sm90(name, batch, fused_route, quantize):
    """The Gluon megakernel (kernels/ring_megakernel.py) builds on the Triton CI installs: qkv bias, plain
    RoPE, q/k-norm finished by attention; mixture-of-experts steps with router tiles (batch 8) and with the o_proj
    tiles' shares of the gate's logits (batch 1), routed by a route task or by the tile that adds the last share;
    e4m3 products (--quantize fp8), the experts' too."""
    engine = Engine(name, backend="triton", device="meta", dtype=torch.bfloat16, max_context=1024,
                    config=GraphConfig(batch=batch, workers=DEFAULT_WORKERS, fused_route=fused_route),
                    kernel_options={"kernel": "ring", "stream_e4m3": int(quantize == "fp8")}, quantize=quantize)
    assert len(engine.weights.fp8) == (5 if quantize else 0)
    # attention passes of 2 keys where the kernel is large (MoE) or its matmul loops convert e4m3 (4 spilled)
    assert engine.executor.args["RING_ATTN_KEYS"] == (2 if quantize or engine.spec.num_experts else 0)
    # six input slices where e4m3 slots use them up, unless a block is too short to chain (qwen3-30b-a3b's experts)
    assert engine.executor.args["XD"] == (6 if quantize and not engine.spec.num_experts else 4)
    compiled = engine.executor.compile_ahead(arch=90)
    assert compiled.metadata.shared <= HOPPER_SHARED_BYTES
    assert "wgmma" in compiled.asm["ptx"] and "cp.async.bulk.tensor" in compiled.asm["ptx"]
    assert converts_e4m3(compiled.asm["ptx"]) == bool(quantize)


@pytest.mark.parametrize("name, tp, batch", [("llama-3-8b", 2, 1), ("qwen3-30b-a3b", 4, 8)])
def test_tensor_parallel_ring_megakernel_compiles_for_sm90(name, tp, batch):
    """The ring megakernel's exchanges (row-parallel tiles' pushes, allreduce, argmax_push over peer pointers) at
    tp > 1, as virtual ranks run them (GPU-scope events) and ranks of one node (system scope)."""
    from distmk.comm.cpu import run_simulated_ranks

    def compile_rank(rank, comm):
        comm.peers_on_device = rank == 0        # rank 0 compiles the virtual ranks' kernel, rank 1 a node's
        engine = Engine(name, tp=tp, rank=rank, comm=comm, backend="triton", device="meta", dtype=torch.bfloat16,
                        max_context=1024, config=GraphConfig(batch=batch, workers=DEFAULT_WORKERS // tp),
                        kernel_options={"kernel": "ring"})
        if rank > 1:
            return None
        compiled = engine.executor.compile_ahead(arch=90)
        return compiled.metadata.shared, compiled.asm["ptx"], comm.peers_on_device

    for shared, ptx, on_device in filter(None, run_simulated_ranks(tp, compile_rank, timeout=600)):
        assert shared <= HOPPER_SHARED_BYTES and "wgmma" in ptx
        assert ("ld.global.acquire.sys" in ptx) == (not on_device)


def test_tensor_parallel_megakernel_compiles_for_sm90():
    """tp=2: exchange pushes into peers' symmetric buffers and events signalled on every rank."""
    from distmk.comm.cpu import run_simulated_ranks

    def compile_rank(rank, comm):
        engine = Engine("llama-3-8b", tp=2, rank=rank, comm=comm, backend="triton", device="meta",
                        dtype=torch.bfloat16, max_context=1024, config=GraphConfig(batch=4, workers=DEFAULT_WORKERS))
        return engine.executor.compile_ahead(arch=90).metadata.shared

    assert all(shared <= HOPPER_SHARED_BYTES for shared in run_simulated_ranks(2, compile_rank))


def nvshmem_bitcode() -> str | None:
    """The NVSHMEM device bitcode for sm_90 from the nvidia-nvshmem wheel (a dev dependency), if installed: one file
    up to 3.4, one an architecture since (libnvshmem_device_sm_90.bc)."""
    import importlib.util
    import os
    spec = importlib.util.find_spec("nvidia.nvshmem")
    for root in (spec.submodule_search_locations if spec else []):
        for name in ("libnvshmem_device.bc", "libnvshmem_device_sm_90.bc"):
            path = os.path.join(root, "lib", name)
            if os.path.exists(path):
                return path
    return None


@pytest.mark.skipif(nvshmem_bitcode() is None, reason="needs the nvidia-nvshmem-cu13 wheel's device bitcode")
def test_nvshmem_transport_links_and_compiles_for_sm90():
    """The put-with-signal transport: Triton's calls into libnvshmem_device.bc link and assemble for sm_90
    (the signal op's value does not matter to the compiler; on a GPU it comes from nvshmem4py)."""
    from distmk.kernels.megakernel import compile_ahead
    from distmk.comm.cpu import run_simulated_ranks

    def compile_rank(rank, comm):
        engine = Engine("llama-3-8b", tp=2, rank=rank, comm=comm, backend="triton", device="meta",
                        dtype=torch.bfloat16, max_context=1024, config=GraphConfig(batch=4, workers=DEFAULT_WORKERS))
        if rank > 0:        # the ranks' kernels are one source: rank 0 compiles it
            return None
        ex = engine.executor
        options = {**ex.launch_options, "extern_libs": {"libnvshmem_device": nvshmem_bitcode()}}
        return compile_ahead(ex.kernel, {**ex.args, "TRANSPORT": 1, "SIGNAL_ADD": 10}, options, 90)

    compiled = run_simulated_ranks(2, compile_rank)[0]
    assert "nvshmemx_putmem_signal_block" in compiled.asm["ptx"] or "putmem_signal" in compiled.asm["llir"]


@pytest.mark.skipif(nvshmem_bitcode() is None, reason="needs the nvidia-nvshmem-cu13 wheel's device bitcode")
def test_every_nvshmem_binding_links_for_sm90():
    """Each Triton binding of distmk.device.nvshmem names a function libnvshmem_device.bc has, with
    the argument types it takes (the megakernel calls only some of them)."""
    import triton
    import triton.language as tl
    from distmk.device import nvshmem as nv
    from distmk.kernels.megakernel import compile_ahead

    @triton.jit
    def every_binding(buf, sig, out, SIGNAL_ADD: tl.constexpr, CMP_GE: tl.constexpr):
        pe = (nv.my_pe() + 1) % nv.n_pes()
        src = buf.to(tl.int64)
        size = tl.full((), 64, tl.int64)
        one = tl.full((), 1, tl.uint64)
        nv.putmem_block(src, src, size, pe)
        nv.putmem_nbi_block(src, src, size, pe)
        nv.putmem_warp(src, src, size, pe)
        nv.putmem_signal_block(src, src, size, sig.to(tl.int64), one, SIGNAL_ADD, pe)
        nv.putmem_signal_nbi_block(src, src, size, sig.to(tl.int64), one, SIGNAL_ADD, pe)
        nv.fence()
        nv.quiet()
        tl.store(out, nv.signal_wait_until(sig.to(tl.int64), CMP_GE, one).to(tl.int64))

    args = {"buf": torch.zeros(16), "sig": torch.zeros(1, dtype=torch.int64), "out": torch.zeros(1, dtype=torch.int64),
            "SIGNAL_ADD": 10, "CMP_GE": 5}   # any values compile; on a GPU they come from nvshmem4py
    compiled = compile_ahead(every_binding, args, {"extern_libs": {"libnvshmem_device": nvshmem_bitcode()}}, 90)
    for name in ("nvshmem_my_pe", "nvshmem_n_pes", "nvshmemx_putmem_block", "nvshmemx_putmem_nbi_block",
                 "nvshmemx_putmem_warp", "nvshmemx_putmem_signal_block", "nvshmemx_putmem_signal_nbi_block",
                 "nvshmem_fence", "nvshmem_quiet", "nvshmem_signal_wait_until"):
        assert name in compiled.asm["llir"] or name in compiled.asm["ptx"], name


def test_executors_share_one_kernel_object():
    """One @triton.jit object per process: Triton 3.6 hashed a re-imported copy differently, so autotuning's
    candidates missed the disk cache on the next start."""
    engines = [Engine("tiny-llama", backend="triton", device="meta", dtype=torch.float32, max_context=64,
                      config=GraphConfig(batch=batch, workers=DEFAULT_WORKERS)) for batch in (1, 2)]
    assert engines[0].executor.kernel is engines[1].executor.kernel


def test_weight_ring_compiles_for_sm90():
    """The Gluon weight ring's probes (benchmarks/ring_probe.py on distmk/device/ring.py: TMA producer warp,
    mbarrier ring, wgmma consumer) build with the Triton this machine has: Gluon moves between releases, and
    the GPU image runs another one."""
    pytest.importorskip("triton.experimental.gluon")
    import ring_probe as ring
    from distmk.models.presets import preset
    from distmk.models.shard import plan_shard
    from distmk.tasks import TYPE_ID
    spec = preset("llama-3-8b")
    plan = plan_shard(spec, 1, 0)
    shape = dict(H=spec.hidden_size, D=spec.head_dim, HQ=plan.num_heads, HKV=plan.num_kv_heads, INTER=plan.inter,
                 QKV_ID=TYPE_ID["qkv"], OPROJ_ID=TYPE_ID["o_proj"], GATEUP_ID=TYPE_ID["gate_up"],
                 DOWN_ID=TYPE_ID["down"])
    probe = ring.compile_ring_stream(rows=64, n=DEFAULT_WORKERS * 64, k=4096, block_n=64, block_k=256, stages=4,
                                     x_stages=3, programs=DEFAULT_WORKERS, mode=1)
    # e4m3 weights (device/ring.py mma_block_fp8): dequantized to bf16 in registers and multiplied by mma.sync
    # (W8A16); or by e4m3 activations (W8A8), quantized with power-of-two scales (no division) into a double buffer
    # while the part before is in flight
    fp8, w8a8 = (ring.compile_ring_stream(rows=64, n=DEFAULT_WORKERS * 64, k=4096, block_n=64, block_k=256, stages=9,
                                          x_stages=4, programs=DEFAULT_WORKERS, mode=1, fp8=True, a8=a8, b_pad=8)
                 for a8 in (False, True))
    # and on two consumer warpgroups, each a slice's part, with an input warp (stream.py's gluon-fp8-2wg)
    two = ring.compile_ring_stream(rows=128, n=DEFAULT_WORKERS * 128, k=4096, block_n=64, block_k=256, stages=9,
                                   x_stages=6, programs=DEFAULT_WORKERS, mode=1, fp8=True, b_pad=8,
                                   two_warpgroups=True)
    assert converts_e4m3(fp8.asm["ptx"]) and "mma.sync.aligned.m16n8k16.row.col.f32.bf16" in fp8.asm["ptx"]
    assert "e4m3.e4m3" in w8a8.asm["ptx"] and "wgmma.wait_group.sync.aligned 1" in w8a8.asm["ptx"]
    assert "div." not in w8a8.asm["ptx"]
    for compiled in (probe, fp8, two, w8a8, ring.compile_ring_matmuls(shape)):
        assert compiled.metadata.shared <= HOPPER_SHARED_BYTES
        ptx = compiled.asm["ptx"]
        assert ("mma.sync" if compiled in (fp8, two) else "wgmma.mma_async") in ptx
        assert "cp.async.bulk.tensor" in ptx and "mbarrier" in ptx


@pytest.mark.parametrize("dtype, batch, reason", [(torch.float32, 1, "bf16 only"), (torch.bfloat16, 32, "up to 16")])
def test_ring_megakernel_refuses_a_step_it_cannot_run(dtype, batch, reason):
    from distmk.errors import DistmkError
    with pytest.raises(DistmkError, match=reason):
        Engine("tiny-llama", backend="triton", device="meta", dtype=dtype, max_context=64,
               config=GraphConfig(batch=batch, workers=DEFAULT_WORKERS), kernel_options={"kernel": "ring"})


def test_ring_refuses_e4m3_products_it_cannot_stream():
    """e4m3 slots are two input slices of 128 columns: a step with a product whose K is not a multiple of 128
    (tiny-llama's o_proj at tp=2: 64) cannot stream e4m3 on the ring, nor one with a block scale of 2^8 or more
    (device/ring.py _dequantized), and the reason names it."""
    from distmk.kernels.ring_megakernel import ring_unsupported
    from distmk.models.presets import preset
    from distmk.models.shard import plan_shard
    from distmk.tasks import TASK_KINDS
    spec = preset("tiny-llama")
    scales = (None, torch.full((2, 2), 1.0))
    why = [ring_unsupported(spec, plan_shard(spec, tp, 0), GraphConfig(batch=8), torch.bfloat16, "pointer", TASK_KINDS,
                            fp8=fp8) for tp, fp8 in ((2, {"w_gate": scales}), (2, {}), (1, {"w_gate": scales}),
                                                     (1, {"w_up": (None, torch.full((2, 2), 256.0))}))]
    assert why == ["with e4m3 products every product's K must be a multiple of 128 (wo (64) are not)", None, None,
                   "e4m3 products with a block scale of 2^8 or more (w_up) would overflow its bf16 multiply"]


def test_e4m3_tiles_of_half_a_slot_stream_two_column_ranges_a_slot():
    """device/ring.py packs_halves: llama-3-8b's o_proj and down tiles at tp=1 on 132 workers are 32 rows, half an
    e4m3 slot, so a slot holds two column ranges of them; 63-row tiles (66 workers), bf16 weights, and a K that is
    not a multiple of two slots' columns (qwen3-30b-a3b's expert down: 768) do not pack."""
    from types import SimpleNamespace

    from triton.experimental.gluon import language as gl

    from distmk.device.ring import packs_halves
    from distmk.graph.lowering import hidden_tile_rows
    from distmk.kernels.ring_megakernel import E4M3_SLOT_K, RING_ROWS
    from distmk.models.presets import preset
    ring = SimpleNamespace(shape=[10, RING_ROWS, E4M3_SLOT_K], element_ty=gl.bfloat16)     # e4m3: 256 columns
    llama = preset("llama-3-8b")
    rows = {w: hidden_tile_rows(llama, GraphConfig(batch=1, workers=w)) for w in (DEFAULT_WORKERS, 66)}
    assert rows == {DEFAULT_WORKERS: 32, 66: 63}
    k = {"o_proj": llama.num_heads * llama.head_dim, "down": llama.intermediate_size}
    assert all(packs_halves(gl.float8e4nv, rows[DEFAULT_WORKERS], k[name], ring) for name in k)
    assert not any(packs_halves(gl.float8e4nv, rows[66], k[name], ring) for name in k)
    assert not packs_halves(gl.bfloat16, rows[DEFAULT_WORKERS], k["down"], ring)
    assert not packs_halves(gl.float8e4nv, 16, preset("qwen3-30b-a3b").moe_intermediate_size, ring)


@pytest.mark.parametrize("b_pad", [8, 16])
def test_packed_loop_reads_each_input_part_where_the_ring_holds_it(b_pad):
    """device/ring.py _part_pairs, the [2, rows, 128] view through which the packed W8A16 loop loads a slice's two
    input parts: each part's bytes where the input ring's own layout holds [rows, 128], the second part after the
    first (an NVMMA layout of rank 3 puts a part's second 64 columns after the other part's first: the loop read the
    wrong columns with it on an H100). Checked by the Triton here, on the layouts' linear forms."""
    import triton
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from distmk.device.ring import _part_pairs, matmul_layouts
    from distmk.kernels.megakernel import compile_ahead
    if tuple(int(v) for v in triton.__version__.split(".")[:2]) < (3, 7):
        pytest.skip("Triton before 3.7 cannot give a shared layout's linear form")

    @gluon.constexpr_function
    def stacked(part):
        return gl.SharedLinearLayout(offset_bases=[[0] + b for b in part.offset_bases] + [[1, 0, 0]],
                                     alignment=part.alignment)

    @gluon.jit
    def check(x, RING: gl.constexpr, PAIRS: gl.constexpr, ROWS: gl.constexpr):
        part: gl.constexpr = gl.to_linear_layout(RING, [ROWS, 128])
        gl.static_assert(gl.to_linear_layout(PAIRS, [2, ROWS, 128]) == stacked(part))

    _, ring = matmul_layouts(256, b_pad)
    compile_ahead(check, {"x": torch.empty(1, dtype=torch.bfloat16, device="meta"), "RING": ring,
                          "PAIRS": _part_pairs(ring, b_pad), "ROWS": b_pad, "num_warps": 4}, {})


def test_ring_megakernel_refuses_rings_that_would_hang_or_overflow():
    from distmk.errors import DistmkError
    for options in ({"ring_slots": 1}, {"ring_inputs": 1}, {"ring_slots": 7, "ring_inputs": 4}):
        with pytest.raises(DistmkError, match="at least 2 each"):
            Engine("llama-3-8b", backend="triton", device="meta", dtype=torch.bfloat16, max_context=64,
                   config=GraphConfig(batch=1, workers=DEFAULT_WORKERS), kernel_options={"kernel": "ring", **options})

    # a packed e4m3 slot (o_proj, down at tp=1) reads four input slices of 128 columns at once (device/ring.py)
    with pytest.raises(DistmkError, match="ring_inputs=3: e4m3 products with input slices of 128 columns"):
        Engine("llama-3-8b", backend="triton", device="meta", dtype=torch.bfloat16, max_context=64,
               config=GraphConfig(batch=1, workers=DEFAULT_WORKERS), quantize="fp8",
               kernel_options={"kernel": "ring", "stream_e4m3": 1, "ring_block_k": 128, "ring_inputs": 3})


@pytest.mark.parametrize("options, message", [({"num_wraps": 4}, r"unknown kernel options \['num_wraps'\]"),
                                              ({"num_warps": 3}, "num_warps must be a power of two, got 3"),
                                              ({"timeout_s": 0}, "timeout_s must be > 0"),
                                              ({"timeout_s": 3600}, "at most 2147 s"),
                                              ({"ring_attention_keys": 3}, "ring_attention_keys must be 0 or a power"),
                                              ({"prefetch_tasks": "o_proj,route"}, r"names \['route'\]")])
def test_kernel_options_name_what_is_wrong(options, message):
    from distmk.errors import DistmkError
    with pytest.raises(DistmkError, match=message):
        Engine("tiny-llama", backend="triton", device="meta", dtype=torch.bfloat16, max_context=64,
               config=GraphConfig(batch=1, workers=DEFAULT_WORKERS), kernel_options=options)


def test_kernel_holds_the_tables_task_types_and_prefetches_those_asked_for():
    """A dense table's kernel has no expert code (on Triton 3.6 the expert gate/up tile at a dense model's
    constants failed the compile), and prefetch_tasks keeps the other types' prefetches out of it."""
    dense = Engine("tiny-llama", backend="triton", device="meta", dtype=torch.bfloat16, max_context=64,
                   config=GraphConfig(batch=1, workers=DEFAULT_WORKERS), kernel_options={"kernel": "tl"})
    moe = Engine("tiny-qwen3-moe", backend="triton", device="meta", dtype=torch.bfloat16, max_context=64,
                 config=GraphConfig(batch=1, workers=DEFAULT_WORKERS),
                 kernel_options={"kernel": "tl", "prefetch_tasks": "o_proj"})
    # the generated module of each kernel
    dense_source, moe_source = (pathlib.Path(e.executor.kernel.fn.__code__.co_filename).read_text()
                                for e in (dense, moe))
    assert "expert_gate_up_gpu(" not in dense_source and "gate_up_gpu(" in dense_source
    assert "expert_gate_up_gpu(" in moe_source and "o_proj_prefetch(" in moe_source
    assert "qkv_prefetch(" not in moe_source and "qkv_prefetch(" in dense_source


def test_auto_kernel_is_tl_off_hopper():
    """Off a Hopper GPU (here: the meta device) the automatic choice is the tl megakernel."""
    engine = Engine("tiny-llama", backend="triton", device="meta", dtype=torch.bfloat16, max_context=64,
                    config=GraphConfig(batch=1, workers=DEFAULT_WORKERS))
    assert engine.executor.kernel_name == "tl"


def test_code_size_counts_the_ring_kernels_machine_code():
    """benchmarks/code_size.py: the ring kernel's SASS per source file adds up to its total, with ptxas's spill
    stores and loads counted apart."""
    out = subprocess.run([sys.executable, "benchmarks/code_size.py", "--model", "tiny-qwen3", "--batch", "4",
                          "--json"], capture_output=True, text=True, check=True,
                         cwd=pathlib.Path(__file__).parent.parent).stdout
    size = json.loads(out.strip().splitlines()[-1])
    assert sum(size["by_file"].values()) == size["sass_bytes"] > 0
    assert {"attention.py", "ring.py"} <= set(size["by_file"])
    assert size["spill_stores"] >= 0 and size["spill_loads"] >= 0
