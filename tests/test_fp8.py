"""FP8 checkpoints (models/fp8.py): tiny checkpoints written in both layouts (e4m3 weights with a scale per block,
or per output channel or per tensor) give the greedy tokens of transformers running the same dequantized weights in
float32, at tp 1 and 2, dense and sparse, and of transformers' own FP8 loader (block layout); a tensor-parallel
slice that would cut a block is refused by name; and --quantize fp8 gives a preset its FP8 twin."""
import json

import pytest
import torch
from safetensors.torch import save_file

from conftest import hf_generate, hf_model_from_files
from distmk.comm.cpu import run_simulated_ranks
from distmk.errors import DistmkError, ModelError
from distmk.models.fp8 import (E4M3_MAX, activation_scale, bf16_scales, dequantize, linear_weights, quantize,
                               quantize_activations)
from distmk.models.presets import preset
from distmk.models.weights import CheckpointWeights, RandomWeights
from distmk.runtime.engine import Engine

PROMPT = [3, 17, 92, 5, 44, 120, 7]


def quantized(w: torch.Tensor, layout: str, block) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e4m3 values, scale as the layout stores it, the dequantized float32 weight)."""
    if layout == "block":
        values, scale = quantize(w, block)
        return values, scale, dequantize(values, scale, block)
    scale = (w.abs().amax(dim=1, keepdim=True) if layout == "channel" else w.abs().amax()).clamp(min=1e-12) / E4M3_MAX
    values = (w / scale).to(torch.float8_e4m3fn)
    return values, scale, values.float() * scale


def write_fp8(path, name: str, layout: str, block=(16, 16)) -> dict:
    """An FP8 checkpoint of a preset's weights (its products' weights in e4m3, the rest float32) and the
    dequantized state transformers runs."""
    spec = preset(name)
    state = {k: v.float() for k, v in RandomWeights(spec).state_dict().items()}
    stored, dequantized = {}, dict(state)
    for weight in linear_weights(spec):
        values, scale, dequantized[weight] = quantized(state[weight], layout, block)
        stored[weight] = values
        stored[weight + ("_scale_inv" if layout == "block" else "_scale")] = scale
    path.mkdir()
    save_file({**{k: v.contiguous() for k, v in state.items() if k not in stored}, **stored},
              str(path / "model.safetensors"))
    config = spec.to_hf_config()
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                     **({"weight_block_size": list(block)} if layout == "block" else {})}
    (path / "config.json").write_text(json.dumps(config))
    return dequantized


def transformers_tokens(spec, state, n: int) -> list[int]:
    model = hf_model_from_files(spec, weights=state)
    return hf_generate(model, PROMPT, n, eos_token_id=None)[0, len(PROMPT):].tolist()


def distmk_tokens(path, tp: int, n: int, **engine) -> list[int]:
    def rank(r, comm):
        return Engine(str(path), tp=tp, rank=r, comm=comm, max_context=64, **engine).generate(PROMPT, n,
                                                                                             stop_on_eos=False)
    tokens = run_simulated_ranks(tp, rank)
    assert all(t == tokens[0] for t in tokens)
    return tokens[0]


@pytest.mark.parametrize("name, layout, tp", [("tiny-llama", "block", 1), ("tiny-llama", "block", 2),
                                              ("tiny-llama", "channel", 2), ("tiny-qwen3", "tensor", 1),
                                              ("tiny-mixtral", "block", 2), ("tiny-qwen3-moe", "channel", 1)])
def test_fp8_checkpoint_gives_transformers_tokens_of_its_dequantized_weights(tmp_path, name, layout, tp):
    state = write_fp8(tmp_path / "fp8", name, layout)
    assert distmk_tokens(tmp_path / "fp8", tp, 12) == transformers_tokens(preset(name), state, 12)


@pytest.mark.parametrize("name, block", [("tiny-llama", (16, 16)), ("tiny-qwen3", (128, 128)),
                                         ("tiny-qwen3-moe", (16, 16))])
def test_fp8_checkpoint_gives_the_tokens_of_transformers_own_fp8_loader(tmp_path, name, block):
    """transformers' own FP8 integration (its fine-grained FP8 quantizer, which on a machine without a GPU
    dequantizes the e4m3 weights by their `weight_scale_inv` as it loads them) reads the checkpoint distmk reads, and
    generates distmk's greedy tokens: the block layout is the one transformers and vLLM read."""
    from transformers import AutoModelForCausalLM
    write_fp8(tmp_path / "fp8", name, "block", block=block)
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "fp8"), dtype=torch.float32, device_map="cpu")
    theirs = hf_generate(model, PROMPT, 12, eos_token_id=None)[0, len(PROMPT):].tolist()
    assert distmk_tokens(tmp_path / "fp8", 1, 12) == theirs


def test_a_rank_slice_that_cuts_a_block_is_refused(tmp_path):
    write_fp8(tmp_path / "fp8", "tiny-llama", "block", block=(48, 48))       # tp=2 takes 64 of q's 128 rows
    with pytest.raises(ModelError, match=r"q_proj.weight: rows (0..64|64..128) of this rank.s slice cut its FP8 "
                                         r"blocks of 48"):
        distmk_tokens(tmp_path / "fp8", 2, 1)


def test_an_fp8_weight_without_its_scale_is_refused(tmp_path):
    write_fp8(tmp_path / "fp8", "tiny-llama", "channel")
    from safetensors.torch import load_file
    tensors = load_file(str(tmp_path / "fp8" / "model.safetensors"))
    del tensors["model.layers.0.mlp.up_proj.weight_scale"]
    save_file(tensors, str(tmp_path / "fp8" / "model.safetensors"))
    with pytest.raises(ModelError, match="model.layers.0.mlp.up_proj.weight is FP8 but the checkpoint has no"):
        distmk_tokens(tmp_path / "fp8", 1, 1)


def test_w8a8_activations_take_the_least_power_of_two_scale_that_keeps_them_finite():
    """The scale of a group of activations is the least power of two that maps its largest magnitude within e4m3's
    range, so the quantized values are the activations rounded to e4m3 (x / s exact); zeros stay zeros."""
    largest = torch.tensor([E4M3_MAX, E4M3_MAX + 1, 1.0, 0.0, 3.0e38])
    assert activation_scale(largest).tolist() == [1.0, 2.0, 2.0 ** -8, 2.0 ** -100, 2.0 ** 120]
    x = torch.randn(3, 256) * torch.tensor([1.0, 1e3, 1e-3])[:, None]
    x[2, 128:] = 0
    q = quantize_activations(x)
    for row, part in ((r, p) for r in range(3) for p in range(2)):
        group, got = x[row, part * 128:(part + 1) * 128], q[row, part * 128:(part + 1) * 128]
        s = activation_scale(group.abs().max())
        assert group.abs().max() / s <= E4M3_MAX and (s == 2.0 ** -100 or group.abs().max() / s > E4M3_MAX / 2)
        assert torch.equal(got, (group / s).to(torch.float8_e4m3fn).float() * s)


def test_block_scales_are_held_as_bf16_values(tmp_path):
    """The weight ring multiplies its e4m3 weights by their block scales in bf16 (device/ring.py _dequantized), so
    every executor holds the scales so: quantize picks the least bf16 value at or above a block's largest magnitude
    over E4M3_MAX (no value overflows), and a checkpoint's float32 block scales are read rounded to bf16."""
    w = torch.randn(256, 384) * torch.logspace(-4, 2, 256)[:, None]
    values, scale = quantize(w)
    least = w.view(2, 128, 3, 128).abs().amax(dim=(1, 3)) / E4M3_MAX
    below = (scale.to(torch.bfloat16).view(torch.int16) - 1).view(torch.bfloat16).float()
    assert torch.equal(scale, bf16_scales(scale)) and (scale >= least).all() and (below < least).all()
    assert values.float().abs().max() <= E4M3_MAX
    write_fp8(tmp_path / "fp8", "tiny-llama", "block")
    from safetensors.torch import load_file
    tensors = load_file(str(tmp_path / "fp8" / "model.safetensors"))
    name = "model.layers.0.mlp.up_proj.weight"
    tensors[name + "_scale_inv"] = tensors[name + "_scale_inv"] * (1 + 2.0 ** -12)     # between two bf16 values
    save_file(tensors, str(tmp_path / "fp8" / "model.safetensors"))
    read = CheckpointWeights(str(tmp_path / "fp8"), preset("tiny-llama"), fp8_block=(16, 16)).read(name)
    held = bf16_scales(tensors[name + "_scale_inv"])
    assert not torch.equal(held, tensors[name + "_scale_inv"])
    assert torch.equal(read, dequantize(tensors[name], held, (16, 16)))


def test_quantize_fp8_gives_a_preset_its_fp8_twin():
    """--quantize fp8: a preset's products' weights quantized in 128 x 128 blocks at load, the rest as it was: the
    tokens of transformers running the dequantized weights, at tp 1 and 2, whose logits differ from the bf16
    preset's own."""
    spec = preset("tiny-qwen3")
    state = {k: v.float() for k, v in RandomWeights(spec).state_dict().items()}
    for weight in linear_weights(spec):
        state[weight] = dequantize(*quantize(state[weight]), (128, 128))
    tokens = Engine("tiny-qwen3", max_context=64, quantize="fp8").generate(PROMPT, 12, stop_on_eos=False)
    assert tokens == transformers_tokens(spec, state, 12)
    # at tp=2 a rank's slices are quantized on the whole tensor's blocks: the same twin
    assert distmk_tokens("tiny-qwen3", 2, 12, quantize="fp8") == tokens
    logits = [Engine("tiny-qwen3", max_context=64, **q).generate(PROMPT, 1, stop_on_eos=False, return_logits=True)[1]
              for q in ({}, {"quantize": "fp8"})]
    assert not torch.equal(*logits)


@pytest.mark.parametrize("name, source, tp, streamed", [
    ("tiny-qwen3", "twin", 1, {"wqkv", "wo", "w_gate", "w_up", "w_down"}),
    ("tiny-qwen3", "twin", 2, {"wo", "w_gate", "w_up", "w_down"}),
    ("tiny-qwen3", "blocks of 128", 1, {"wqkv", "wo", "w_gate", "w_up", "w_down"}),
    ("tiny-qwen3", "blocks of 16", 1, set()), ("tiny-qwen3", "channel", 1, set()),
    ("tiny-qwen3-moe", "twin", 1, {"wo", "expert_gate", "expert_up", "expert_down"}),
    ("tiny-qwen3-moe", "twin", 2, {"wo", "expert_gate", "expert_up", "expert_down"})])
def test_the_products_the_ring_streams_in_e4m3_are_the_weights_the_reference_multiplies(tmp_path, name, source, tp,
                                                                                       streamed):
    """What the weight ring streams (RankWeights.fp8: e4m3 values and a scale a 128 x 128 block, kept on the triton
    backend) where a product's rank slices hold whole blocks of 128, dequantized, are the weights the reference
    multiplies. At tp=2 tiny-qwen3's q, k and v slices are 64 rows (tiny-qwen3-moe's k and v at tp=1): its wqkv
    stays dequantized only; blocks of
    another size and per-channel scales are not streamed. A MoE model's experts are streamed ([sparse layers,
    experts, ...]); its dense MLP (tiny-qwen3-moe's layer 1) is not. A streamed product is held in e4m3 alone:
    RankWeights.layer dequantizes it."""
    from distmk.models.fp8 import QuantizedAtLoad
    from distmk.models.shard import load_shard, plan_shard
    from distmk.models.weights import CheckpointWeights
    spec = preset(name)
    if source == "twin":
        weights = QuantizedAtLoad(RandomWeights(spec), spec)
    else:
        block = (128, 128) if source == "blocks of 128" else (16, 16)
        write_fp8(tmp_path / "fp8", name, "channel" if source == "channel" else "block", block=block)
        weights = CheckpointWeights(str(tmp_path / "fp8"), spec, fp8_block=block)
    shard = load_shard(spec, weights, plan_shard(spec, tp, 0), keep_fp8=True)
    assert set(shard.fp8) == streamed
    read = load_shard(spec, weights, plan_shard(spec, tp, 0))         # every weight read dequantized
    for product, (values, scales) in shard.fp8.items():
        assert values.dtype == torch.float8_e4m3fn
        layers = spec.moe_layers if product.startswith("expert") else range(spec.num_layers)
        assert len(values) == len(scales) == len(layers)
        for i, layer in enumerate(layers):
            lw_read = read.layers[layer]
            assert getattr(shard.layers[layer], product) is None, (product, layer)     # held in e4m3 alone
            assert torch.equal(dequantize(values[i], scales[i], (128, 128)), getattr(lw_read, product))
            assert torch.equal(getattr(shard.layer(layer), product), getattr(lw_read, product)), (product, layer)


def test_fp8_accuracy_compares_the_fp8_twins_logits_with_the_originals(tmp_path):
    """benchmarks/fp8_accuracy.py on the CPU: every position's logits of the model and of its FP8 twin, compared:
    apart by the quantization's error, a few percent on tiny-qwen3's random weights, and no more."""
    from fp8_accuracy import main
    assert main(["--model", "tiny-qwen3", "--positions", "40", "--batch", "8", "--device", "cpu",
                 "--out", str(tmp_path / "acc.json")]) == 0
    r = json.loads((tmp_path / "acc.json").read_text())
    assert r["positions"] == 40 and r["kernel"] == "reference"
    assert 0 < r["rel_err_median"] <= r["rel_err_max"] < 0.3
    assert 0 < r["kl_mean"] <= r["kl_max"] < 0.05
    assert r["top1_agreement"] >= 0.8


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-qwen3-moe"])
def test_prefill_multiplies_the_products_held_in_e4m3_alone_as_their_dequantized_weights(name):
    """An engine streaming e4m3 products holds them in e4m3 alone, not beside a dequantized copy (an FP8 model in
    about half the bytes); its prefill dequantizes them a layer at a time and writes the KV cache and logits that
    the engine holding them dequantized writes."""
    from distmk.runtime.prefill import prefill_chunk
    engines = [Engine(name, backend=backend, quantize="fp8", max_context=32, step_batches=(1,),
                      kernel_options={"stream_e4m3": 1} if backend == "triton" else None)
               for backend in ("reference", "triton")]
    held, alone = (e.weights for e in engines)
    assert alone.fp8 and not held.fp8
    assert all(getattr(lw, product) is None for lw in alone.layers for product in alone.fp8
               if lw.router is not None or not product.startswith("expert"))
    assert sum(t.numel() * t.element_size() for t in layer_tensors(alone)) < \
        0.6 * sum(t.numel() * t.element_size() for t in layer_tensors(held))
    outputs = []
    for engine in engines:
        blocks = engine.kv.allocate([], len(PROMPT))
        logits = prefill_chunk(engine, PROMPT, 0, blocks, logits=True)
        outputs.append((logits, engine.kv.k.clone(), engine.kv.v.clone()))
    for a, b in zip(*outputs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-qwen3-moe"])
def test_e4m3_values_held_in_the_rings_column_order_multiply_as_in_their_own(name):
    """The weight ring holds each 128 columns of the e4m3 values in its operand's order (RankWeights.order_fp8,
    device/ring.py part_columns): the weights a layer gives, the prefill's KV cache and logits (the input's columns
    taken in that order) stay those of the values in their own order, and the order undone gives the bytes back."""
    from distmk.device.ring import part_columns
    from distmk.runtime.prefill import prefill_chunk
    for mode in ("w8a16", "w8a8"):
        engine = Engine(name, backend="triton", quantize="fp8", max_context=32, step_batches=(1,),
                        kernel_options={"stream_e4m3": 1}, prefill_fp8=mode)
        weights = engine.weights
        own = {product: values.clone() for product, (values, _) in weights.fp8.items()}
        before = [weights.layer(i) for i in range(len(weights.layers))]
        outputs = []
        for order in (None, part_columns()):
            weights.order_fp8(order)
            blocks = engine.kv.allocate([], len(PROMPT))
            logits = prefill_chunk(engine, PROMPT, 0, blocks, logits=True)
            outputs.append((logits, engine.kv.k[:, blocks].clone(), engine.kv.v[:, blocks].clone()))
            engine.kv.release(blocks)
        assert not any(torch.equal(values, own[product]) for product, (values, _) in weights.fp8.items())
        for a, b in zip(before, (weights.layer(i) for i in range(len(weights.layers)))):
            assert all(torch.equal(getattr(a, f), getattr(b, f)) for f in weights.fp8 if getattr(a, f) is not None)
        for a, b in zip(*outputs):
            # w8a8's float32 sums run over the columns in another order
            assert torch.equal(a, b) if mode == "w8a16" else torch.allclose(a, b, rtol=1e-5, atol=1e-6)
        weights.order_fp8(None)
        assert all(torch.equal(values, own[product]) for product, (values, _) in weights.fp8.items())


def layer_tensors(weights) -> list[torch.Tensor]:
    """Every tensor a rank holds for its layers' products: the LayerWeights fields and the e4m3 products."""
    fields = [t for lw in weights.layers for t in vars(lw).values() if isinstance(t, torch.Tensor)]
    return fields + [t for pair in weights.fp8.values() for t in pair]


@pytest.mark.parametrize("name, tp", [("tiny-llama", 1), ("tiny-qwen3-moe", 1), ("tiny-qwen3", 2),
                                      ("tiny-qwen3-moe", 2)])
def test_w8a8_prefill_quantizes_the_activations_of_the_products_held_in_e4m3(name, tp):
    """prefill_fp8 w8a8 (the default on Hopper): a product held in e4m3 multiplies its input quantized a row and 128
    columns (models/fp8.py scaled_mm_blocks; on the CPU the float32 sums torch._scaled_mm makes on a GPU), so the KV
    cache and logits move from w8a16's (the products dequantized, the input in the model's dtype) by about e4m3's
    precision: a value rounds to 3 bits of mantissa, within 2^-4 of itself. Tensor-parallel ranks stay identical."""
    from distmk.runtime.prefill import prefill_chunk

    def rank(r, comm, mode):
        engine = Engine(name, tp=tp, rank=r, comm=comm, backend="triton", quantize="fp8", max_context=32,
                        step_batches=(1,), kernel_options={"stream_e4m3": 1}, prefill_fp8=mode)
        blocks = engine.kv.allocate([], len(PROMPT))
        logits = prefill_chunk(engine, PROMPT, 0, blocks, logits=True)
        return logits, engine.kv.k.clone(), engine.kv.v.clone()
    outputs = {mode: run_simulated_ranks(tp, lambda r, comm: rank(r, comm, mode)) for mode in ("w8a16", "w8a8")}
    assert torch.equal(outputs["w8a8"][0][0], outputs["w8a8"][-1][0])     # the logits, gathered over the ranks
    for w8a16, w8a8 in zip(outputs["w8a16"][0], outputs["w8a8"][0]):
        moved = ((w8a8 - w8a16).norm() / w8a16.norm()).item()
        assert 0 < moved < 2 ** -3


def test_an_unknown_prefill_fp8_is_refused():
    with pytest.raises(DistmkError, match="prefill_fp8 must be w8a8 or w8a16, got 'fp8'"):
        Engine("tiny-llama", prefill_fp8="fp8")


@pytest.mark.parametrize("k", [256, 200])
def test_prefill_multiplies_an_e4m3_product_w8a8_where_its_k_holds_whole_groups(k):
    """prefill's linear: an e4m3 product (values, block scales) times x quantized a row and 128 columns (the float32
    sums of quantize_activations' input and the dequantized weight); a K that ends inside a block (the tl kernel
    may hold such a product in e4m3) times x as it is, the weight dequantized."""
    from distmk.models.fp8 import DEFAULT_BLOCK, dequantize_blocks
    from distmk.runtime.prefill import linear
    x, values, scales = torch.randn(5, k), *quantize(torch.randn(192, k))
    if k % 128:
        expected = torch.nn.functional.linear(x, dequantize_blocks(values, scales, x.dtype))
    else:
        expected = quantize_activations(x) @ dequantize(values, scales, DEFAULT_BLOCK).t()
    assert torch.equal(linear(x, (values, scales)), expected)
