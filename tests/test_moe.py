"""Mixture-of-experts models (Qwen3-MoE, Mixtral): config import, experts sharded along their intermediate
dimension, and the router / expert / combine tasks giving transformers' greedy tokens from checkpoints that
transformers wrote."""
import dataclasses
import functools

import pytest
import torch

from distmk.comm.cpu import run_simulated_ranks
from distmk.errors import GraphError, ModelError, ShardingError
from distmk.graph import GraphConfig
from distmk.graph.lowering import compile_step
from distmk.graph.table import A0, A2, LAYER, SIGNAL, TYPE, WAIT
from distmk.kernels.layout import stack_layers
from distmk.models.presets import PRESETS, preset
from distmk.models.shard import load_shard, plan_shard
from distmk.models.spec import spec_from_hf_config
from distmk.models.weights import RandomWeights, open_model
from distmk.runtime.batcher import Batcher, Sequence
from distmk.runtime.engine import Engine
from distmk.tasks import TASK_KINDS, TYPE_ID
from distmk.tasks.route import flat_segments
from conftest import PROMPT, SMALL, TINY_MOE, hf_generate, hf_model

BATCH_1 = dataclasses.replace(SMALL, batch=1)
# decoded together, one row each in every step: rows that often choose the same experts
PROMPTS = [tuple(PROMPT), (9, 8, 7), (100, 200, 300, 400, 500), (42,)]

# config.json of Qwen/Qwen3-30B-A3B and mistralai/Mixtral-8x7B-v0.1 on the Hugging Face Hub (the fields distmk
# reads, and the training-only ones it accepts)
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "bos_token_id": 151643,
    "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048,
    "intermediate_size": 6144, "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [],
    "model_type": "qwen3_moe", "moe_intermediate_size": 768, "norm_topk_prob": True, "num_attention_heads": 32,
    "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4,
    "output_router_logits": False, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001, "sliding_window": None, "tie_word_embeddings": False, "use_sliding_window": False,
    "vocab_size": 151936}
MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
    "hidden_size": 4096, "intermediate_size": 14336, "max_position_embeddings": 32768, "model_type": "mixtral",
    "num_attention_heads": 32, "num_experts_per_tok": 2, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "num_local_experts": 8, "output_router_logits": False, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.02, "router_jitter_noise": 0.0, "sliding_window": None, "tie_word_embeddings": False,
    "vocab_size": 32000}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Each tiny MoE preset written by transformers' save_pretrained (per-expert tensors, as on the Hub)."""
    root = tmp_path_factory.mktemp("moe")
    for name in TINY_MOE:
        hf_model(name).save_pretrained(root / name)
    return {name: str(root / name) for name in TINY_MOE}


@functools.lru_cache(maxsize=None)
def transformers_greedy(path: str, prompt: tuple = tuple(PROMPT), new_tokens: int = 32):
    """(tokens, [new_tokens, vocab] logits) of transformers' greedy generate from the checkpoint, eos ignored."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = hf_generate(model, prompt, new_tokens, output_logits=True, return_dict_in_generate=True, eos_token_id=None)
    return out.sequences[0, len(prompt):].tolist(), torch.stack(out.logits)[:, 0]


def test_presets_have_transformers_parameter_counts_and_real_sizes():
    for name in TINY_MOE:
        assert PRESETS[name].num_parameters() == sum(p.numel() for p in hf_model(name).parameters())
    assert PRESETS["qwen3-30b-a3b"].num_parameters() / 1e9 == pytest.approx(30.53, abs=0.01)
    assert PRESETS["mixtral-8x7b"].num_parameters() / 1e9 == pytest.approx(46.70, abs=0.01)


def test_hub_configs_give_the_real_presets():
    assert dataclasses.replace(spec_from_hf_config(QWEN3_30B_A3B), bos_token_id=None) == PRESETS["qwen3-30b-a3b"]
    assert spec_from_hf_config(MIXTRAL_8X7B) == PRESETS["mixtral-8x7b"]


def test_checkpoint_round_trip(checkpoints):
    """The config transformers writes (num_local_experts for Qwen3-MoE too) reads back into the preset, and an
    expert's tensors under the checkpoint's names are the preset's."""
    for name, path in checkpoints.items():
        spec, source, _ = open_model(path)
        assert spec == PRESETS[name]
        down = spec.moe_names(spec.moe_layers[-1], spec.num_experts - 1)[3]
        assert torch.equal(source.read(down, 1, 8, 24), RandomWeights(spec).read(down, 1, 8, 24))


def test_sparse_layers_follow_decoder_sparse_step_and_mlp_only_layers():
    cfg = {**QWEN3_30B_A3B, "num_hidden_layers": 6, "decoder_sparse_step": 2, "mlp_only_layers": [3]}
    spec = spec_from_hf_config(cfg)
    assert spec.moe_layers == (1, 5) and spec.dense_layers == (0, 2, 3, 4)
    assert spec_from_hf_config(spec.to_hf_config()).moe_layers == (1, 5)


@pytest.mark.parametrize("changes, message", [
    ({"shared_expert_intermediate_size": 512}, "shared experts .* not supported"),
    ({"num_experts_per_tok": 129}, "num_experts_per_tok=129 must be in 1..128"),
    ({"mlp_only_layers": [48]}, r"mlp_only_layers must list layers in 0..47, got \[48\]"),
    ({"decoder_sparse_step": 0}, "decoder_sparse_step must be >= 1"),
    ({"moe_intermediate_size": None}, "required field 'moe_intermediate_size' is missing"),
    ({"use_sliding_window": True}, "use_sliding_window=true is not supported"),
])
def test_unsupported_or_broken_moe_fields_are_refused_by_name(changes, message):
    with pytest.raises(ModelError, match=message):
        spec_from_hf_config({**QWEN3_30B_A3B, **changes})


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("name", TINY_MOE)
def test_every_rank_holds_its_rows_of_every_expert(name, tp):
    """Experts split along their intermediate dimension: the ranks' rows of gate/up and columns of down put
    together are each expert; the router is every rank's."""
    spec = preset(name)
    source = RandomWeights(spec)
    shards = [load_shard(spec, source, plan_shard(spec, tp, rank)) for rank in range(tp)]
    for i, layer in enumerate(spec.moe_layers):
        assert all(s.layers[layer].w_gate is None for s in shards)
        router = spec.moe_names(layer, 0)[0]
        assert all(torch.equal(s.layers[layer].router, source.full(router)) for s in shards)
        for expert in range(spec.num_experts):
            _, gate, up, down = spec.moe_names(layer, expert)
            for field, name_, dim in (("expert_gate", gate, 0), ("expert_up", up, 0), ("expert_down", down, 1)):
                joined = torch.cat([getattr(s.layers[layer], field)[expert] for s in shards], dim=dim)
                assert torch.equal(joined, source.full(name_)), (layer, expert, field)
    for layer in spec.dense_layers:
        assert torch.equal(torch.cat([s.layers[layer].w_gate for s in shards]),
                           source.full(f"model.layers.{layer}.mlp.gate_proj.weight"))


@pytest.mark.parametrize("name", TINY_MOE)
def test_the_kernels_stacked_experts_are_the_loaded_ones_not_a_copy(name):
    """load_shard reads the experts into the [sparse layers, experts, ...] tensor the megakernel takes, so laying
    the weights out for it allocates no second copy (qwen3-30b-a3b on an 80 GB GPU: 57 GiB of weights, 18 GiB of
    them one such tensor)."""
    spec = preset(name)
    weights = load_shard(spec, RandomWeights(spec), plan_shard(spec, 2, 1))
    loaded = {f: [getattr(weights.layers[i], f).data_ptr() for i in spec.moe_layers]
              for f in ("expert_gate", "expert_up", "expert_down")}
    stacked = stack_layers(weights)
    for field, pointers in loaded.items():
        assert [view.data_ptr() for view in stacked[field]] == pointers, field
        assert [getattr(weights.layers[i], field).data_ptr() for i in spec.moe_layers] == pointers, field


def test_tp_that_does_not_divide_the_experts_is_refused():
    spec = dataclasses.replace(preset("tiny-mixtral"), moe_intermediate_size=30)
    with pytest.raises(ShardingError, match="tp=4 does not divide the experts' intermediate size 30"):
        plan_shard(spec, 4, 0)


def test_sparse_layers_are_lowered_to_router_expert_and_combine_tiles():
    """tiny-qwen3-moe (fused_route 0): its sparse layers have a route task, at tp 2 after a router tile (of all 8 experts), at tp 1
    (router_partials 1) after the o_proj tiles that add their shares of the logits (the layer's sparse index as
    their router_layer), expert tiles that cut the batch * top_k slots' rows (at most tile_rows each when every
    slot leads) whatever slots lead, every down tile waiting for all the gate/up tiles, and combine tiles in the
    place of the down tiles (all-reduced at tp 2); its dense layer 1 a dense MLP, whose o_proj tiles add none."""
    spec = preset("tiny-qwen3-moe")
    for tp in (1, 2):
        plan = plan_shard(spec, tp, 0)
        config = dataclasses.replace(SMALL, router_partials=1 if tp == 1 else 0, fused_route=0)
        table = compile_step(spec, plan, config)
        kinds = [(TASK_KINDS[t].name, layer) for t, layer in table.tasks[:, :2].tolist()]
        slots = SMALL.batch * spec.experts_per_token
        for sparse, layer in enumerate(spec.moe_layers):
            count = {k: kinds.count((k, layer)) for k in ("router", "route", "expert_gate_up", "expert_down",
                                                          "moe_combine", "gate_up", "down", "allreduce")}
            row_tiles = spec.hidden_size // SMALL.tile_rows
            up_parts = -(-slots * plan.expert_inter // SMALL.tile_rows)
            down_parts = -(-slots * spec.hidden_size // SMALL.tile_rows)
            assert count == {"router": int(tp > 1), "route": 1, "expert_gate_up": up_parts,
                             "expert_down": down_parts, "moe_combine": row_tiles, "gate_up": 0, "down": 0,
                             "allreduce": 2 * row_tiles * (tp > 1)}, (tp, layer)
            shares = {row[A0 + 3] for row in table.tasks.tolist()
                      if row[LAYER] == layer and TASK_KINDS[row[TYPE]].name == "o_proj"}
            assert shares == {sparse if tp == 1 else -1}, (tp, layer)
            ups, downs = ([row for row in table.tasks.tolist() if row[LAYER] == layer and TASK_KINDS[row[TYPE]].name
                           == kind] for kind in ("expert_gate_up", "expert_down"))
            assert [row[A0:A2 + 1] for row in ups] == [[part, up_parts, sparse] for part in range(up_parts)]
            assert [row[A0:A2 + 1] for row in downs] == [[part, down_parts, sparse] for part in range(down_parts)]
            assert len({row[SIGNAL] for row in ups}) == 1 and {row[WAIT] for row in downs} == {ups[0][SIGNAL]}
        assert kinds.count(("gate_up", 1)) > 0 and kinds.count(("router", 1)) == 0
        dense_o_proj = [row for row in table.tasks.tolist() if row[LAYER] == 1 and row[TYPE] == TYPE_ID["o_proj"]]
        assert {row[A0 + 3] for row in dense_o_proj} == {-1}


def test_router_partials_choice():
    """router_partials 0 (automatic) takes the o_proj tiles' shares at tp=1 and batch 1 while they are at most
    64 KB (qwen3-30b-a3b: 128 tiles x 128 experts x 4 bytes), router tiles otherwise (mixtral-8x7b's 8 experts at
    batch 8 too) and always at tp > 1, where asking for the shares is refused by name."""
    for name, tp, batch, want in (("qwen3-30b-a3b", 1, 1, 1), ("qwen3-30b-a3b", 1, 8, 2), ("qwen3-30b-a3b", 2, 1, 2),
                                  ("mixtral-8x7b", 1, 1, 1), ("mixtral-8x7b", 1, 8, 2), ("qwen3-8b", 1, 1, 2)):
        spec = preset(name)
        config = GraphConfig(batch=batch, workers=132).resolved(spec, plan_shard(spec, tp, 0))
        assert config.router_partials == want, (name, tp, batch)
    spec = preset("qwen3-30b-a3b")
    assert GraphConfig(router_partials=2).resolved(spec, plan_shard(spec, 1, 0)).router_partials == 2
    with pytest.raises(GraphError, match="router_partials=1 needs tp=1"):
        GraphConfig(router_partials=1).resolved(spec, plan_shard(spec, 2, 0))
    with pytest.raises(GraphError, match="router_partials must be 0, 1 or 2, got 3"):
        GraphConfig(router_partials=3).resolved(spec, plan_shard(spec, 1, 0))


def test_fused_route_drops_the_route_phase_and_changes_no_result():
    """fused_route=1 where the o_proj tiles add the shares (router_partials 1): no route task; the expert tiles wait
    on the o_proj tiles' event (the tile that adds the last share routes before it signals) and their producer's
    `routed` event is that one; the same tokens and bit-identical logits with 1 and 13 workers, rows that share
    experts included (four-row steps). Where router tiles make the logits (router_partials 2) it resolves to 0."""
    spec = preset("tiny-qwen3-moe")
    plan = plan_shard(spec, 1, 0)
    fused = dataclasses.replace(SMALL, router_partials=1, fused_route=1)
    table = compile_step(spec, plan, fused)
    rows = table.tasks.tolist()
    assert not any(TASK_KINDS[row[TYPE]].name == "route" for row in rows)
    for layer in spec.moe_layers:
        o_proj = {row[SIGNAL] for row in rows if row[LAYER] == layer and TASK_KINDS[row[TYPE]].name == "o_proj"}
        ups = [row for row in rows if row[LAYER] == layer and TASK_KINDS[row[TYPE]].name == "expert_gate_up"]
        assert len(o_proj) == 1 and {row[WAIT] for row in ups} == {row[A0 + 3] for row in ups} == o_proj
    assert GraphConfig(router_partials=2, fused_route=1).resolved(spec, plan).fused_route == 0

    def run(config):
        return Engine("tiny-qwen3-moe", config=config).generate(PROMPT, 12, return_logits=True)

    base_tokens, base_logits = run(dataclasses.replace(SMALL, router_partials=1, fused_route=0))
    for workers in (1, 13):
        tokens, logits = run(dataclasses.replace(fused, workers=workers))
        assert tokens == base_tokens and torch.equal(logits, base_logits)
    with pytest.raises(GraphError, match="fused_route must be 0 or 1"):
        GraphConfig(fused_route=2)


def test_expert_tiles_at_batch_1_are_each_a_share_of_one_expert():
    """Without tile_rows, workers // slots tiles a slot: at batch 1 (every slot leads) each tile is one expert's
    share and none crosses an expert, as qwen3-30b-a3b's 8 x 16 tiles of 48 gate/up and 128 down rows."""
    spec = preset("qwen3-30b-a3b")
    config = GraphConfig(batch=1, workers=132)
    for rows in (768, 2048):
        parts, total = config.expert_parts(rows, 8), 8 * rows
        assert parts == 128 and all(p * total // parts // rows == ((p + 1) * total // parts - 1) // rows
                                    for p in range(parts))
    assert config.expert_parts(14336, 2 * 8) == 16 * 8          # mixtral-8x7b at batch 8: 8 a slot
    assert config.expert_parts(64, 2) == 2 * 4                  # at least 16 rows a tile
    kinds = [TASK_KINDS[t].name for t in compile_step(spec, plan_shard(spec, 1, 0), config).tasks[:, 0].tolist()]
    assert kinds.count("expert_gate_up") == kinds.count("expert_down") == 128 * len(spec.moe_layers)


@pytest.mark.parametrize("config", [BATCH_1, SMALL], ids=["batch1", "batch4"])
@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("name", TINY_MOE)
def test_greedy_and_logits_match_transformers(checkpoints, name, tp, config):
    path = checkpoints[name]
    ref_tokens, ref_logits = transformers_greedy(path)
    results = run_simulated_ranks(tp, lambda rank, comm: Engine(path, tp=tp, rank=rank, comm=comm, config=config)
                                  .generate(PROMPT, 32, stop_on_eos=False, return_logits=True))
    tokens, logits = results[0]
    assert tokens == ref_tokens
    assert (logits - ref_logits).abs().max() / ref_logits.abs().max() < 1e-4
    for other_tokens, other_logits in results[1:]:       # the combine and all-reduce leave ranks bit-identical
        assert other_tokens == tokens and torch.equal(other_logits, logits)


def decode_together(engine, prompts, new_tokens: int) -> list[list[int]]:
    """Every prompt's greedy tokens, all sequences in the batcher at once (a row each per decode step)."""
    batcher = Batcher(engine)
    seqs = [batcher.submit(Sequence(list(p), new_tokens, stop_on_eos=False)) for p in prompts]
    while batcher.busy:
        batcher.step()
    return [seq.output for seq in seqs]


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("name", TINY_MOE)
def test_rows_of_four_sequences_in_one_step_match_transformers(checkpoints, name, tp):
    path = checkpoints[name]
    expected = [transformers_greedy(path, p, 16)[0] for p in PROMPTS]
    results = run_simulated_ranks(tp, lambda rank, comm: decode_together(
        Engine(path, tp=tp, rank=rank, comm=comm, config=SMALL, max_seqs=4), PROMPTS, 16))
    assert all(r == expected for r in results)


def shared_expert_step(tokens=(9, 8, 7, 42)):
    """tiny-mixtral's reference engine after one step of four rows, each token at position 0 of a sequence of its
    own (top 2 of 4 experts: 8 choices, so some expert is chosen twice; these four choose 3 distinct experts in
    each sparse layer)."""
    engine = Engine("tiny-mixtral", config=SMALL, max_seqs=4)
    blocks = [engine.kv.allocate([], 1) for _ in tokens]
    engine.step(list(tokens), [0] * len(tokens), blocks)
    return engine


def test_rows_that_choose_one_expert_share_its_tiles():
    """route_unique lists each chosen expert's leading slot (the first to choose it) once, in slot order, and the
    expert tiles of a phase cut the distinct experts' rows laid end to end, covering each exactly once, some tile
    crossing from one expert into the next."""
    engine = shared_expert_step()
    ctx = engine.executor.ctx                          # the last sparse layer's routing
    chosen = ctx.buf["route_expert"][:4].flatten().tolist()
    count = int(ctx.buf["route_count"][0])
    unique = ctx.buf["route_unique"][:count].tolist()
    assert unique == [chosen.index(e) for e in dict.fromkeys(chosen)]
    assert count == len(set(chosen)) < len(chosen)
    layer = engine.spec.moe_layers[-1]
    for kind, rows in (("expert_gate_up", engine.plan.expert_inter), ("expert_down", engine.spec.hidden_size)):
        covered, crossing = torch.zeros(count, rows, dtype=torch.int64), 0
        for row in engine.table.tasks.tolist():
            if row[LAYER] == layer and TASK_KINDS[row[TYPE]].name == kind:
                segments = list(flat_segments(ctx, row[A0], row[A0 + 1], rows))
                crossing += len(segments) > 1
                for slot, expert, row0, nrows in segments:
                    assert expert == chosen[slot] and nrows > 0
                    covered[unique.index(slot), row0:row0 + nrows] += 1
        assert bool((covered == 1).all()) and crossing > 0, kind


def test_a_step_whose_rows_share_experts_matches_transformers():
    """The step of test_rows_that_choose_one_expert_share_its_tiles (four rows sharing experts, tiles that cross
    experts) gives each row transformers' logits of its token."""
    tokens = (9, 8, 7, 42)
    engine = shared_expert_step(tokens)
    with torch.no_grad():
        expected = hf_model("tiny-mixtral")(torch.tensor(tokens)[:, None]).logits[:, 0]
    buf = engine.executor.ctx.buf
    assert all(len(set(layer.flatten().tolist())) == 3 for layer in buf["route_history"][:, :4])
    logits = buf["logits"][:4, :engine.spec.vocab_size]
    assert (logits - expected).abs().max() / expected.abs().max() < 1e-4


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("name", TINY_MOE)
def test_prefill_chunks_match_transformers(checkpoints, name, tp):
    """A 40-token prompt prefilled by matrix products in chunks of 16, 16 and 8, the last one's last row giving the
    first token (runtime/prefill.py routes and combines as the tasks do)."""
    path = checkpoints[name]
    prompt = tuple((7 * i + 3) % 50 for i in range(40))
    ref_tokens, ref_logits = transformers_greedy(path, prompt, 16)
    results = run_simulated_ranks(tp, lambda rank, comm: Engine(path, tp=tp, rank=rank, comm=comm, config=SMALL,
                                                                prefill_chunk=16)
                                  .generate(list(prompt), 16, stop_on_eos=False, return_logits=True))
    tokens, logits = results[0]
    assert tokens == ref_tokens
    assert (logits - ref_logits).abs().max() / ref_logits.abs().max() < 1e-4
    assert all(t == tokens and torch.equal(lg, logits) for t, lg in results[1:])


def test_autotuned_options_are_cached_per_expert_shape():
    """Two models that differ only in their number of experts compile the same table: the key of their tuned
    kernel options still tells them apart."""
    from distmk.kernels.autotune import tuning_key
    spec = preset("tiny-mixtral")
    keys = set()
    for s in (spec, dataclasses.replace(spec, num_experts=8)):
        plan = plan_shard(s, 1, 0)
        keys.add(tuning_key(s, plan, compile_step(s, plan, SMALL), torch.bfloat16, "cpu"))
    assert len(keys) == 2


def test_ring_megakernel_runs_moe_steps_at_any_tp_over_peer_pointers():
    """Every MoE task type has its ring device functions (router tiles and the exchanges included): the ring
    megakernel takes a MoE step at tp=1 and at tp=2 over peer pointers; NVSHMEM's put-with-signal stays on the tl
    megakernel."""
    from distmk.kernels.ring_megakernel import ring_unsupported
    spec = preset("tiny-mixtral")
    for tp in (1, 2):
        plan = plan_shard(spec, tp, 0)
        table = compile_step(spec, plan, dataclasses.replace(SMALL, router_partials=2))
        kinds = {TASK_KINDS[t] for t in table.tasks[:, 0].tolist()}
        assert {"router", "route", "expert_gate_up", "expert_down", "moe_combine"} <= {k.name for k in kinds}
        assert ring_unsupported(spec, plan, table.config, torch.bfloat16, "pointer", kinds) is None
    assert {"allreduce", "argmax_push"} <= {k.name for k in kinds}
    assert "tl megakernel" in ring_unsupported(spec, plan, table.config, torch.bfloat16, "nvshmem", kinds)


def test_router_cut_over_the_experts_matches_transformers(tmp_path):
    """40 experts: the gate's logits come from two router tiles (32 and 8 experts, router_partials 2), the route
    task chooses from both."""
    spec = dataclasses.replace(preset("tiny-mixtral"), num_experts=40)
    model = hf_model(spec)
    model.save_pretrained(tmp_path / "forty-experts")
    expected = hf_generate(model, PROMPT, 16)[0, len(PROMPT):].tolist()
    plan = plan_shard(spec, 1, 0)
    config = dataclasses.replace(SMALL, router_partials=2)
    kinds = [TASK_KINDS[t].name for t in compile_step(spec, plan, config).tasks[:, 0].tolist()]
    assert kinds.count("router") == 2 * spec.num_layers
    for tp in (1, 2):
        results = run_simulated_ranks(tp, lambda rank, comm: Engine(str(tmp_path / "forty-experts"), tp=tp, rank=rank,
                                                                    comm=comm, config=config)
                                      .generate(PROMPT, 16, stop_on_eos=False))
        assert all(r == expected for r in results)


@pytest.mark.parametrize("name", TINY_MOE + ["tiny-qwen2", "tiny-mistral"])
def test_float32_reference_forward_matches_transformers(name):
    """tests/float32_reference.py, the float32 model that tests/test_gpu.py holds bf16 qwen3-30b-a3b against (no
    room for transformers' float32 copy beside distmk's): transformers' logits at every position of a 40-token
    sequence; with a qkv bias (tiny-qwen2); with a sliding window of 8 (tiny-mistral); from bf16 weights, the same
    as from their float32 upcast."""
    from float32_reference import float32_logits
    spec = preset(name)
    if name == "tiny-mistral":
        spec = dataclasses.replace(spec, sliding_window=8)
    weights = load_shard(spec, RandomWeights(spec), plan_shard(spec, 1, 0))
    tokens = [(7 * i + 3) % 50 for i in range(40)]
    with torch.no_grad():
        expected = hf_model(spec)(torch.tensor([tokens])).logits[0]
    logits = float32_logits(spec, weights, tokens)
    assert (logits - expected).abs().max() / expected.abs().max() < 1e-5
    bf16 = load_shard(spec, RandomWeights(spec), plan_shard(spec, 1, 0), dtype=torch.bfloat16)
    upcast = load_shard(spec, RandomWeights(spec), plan_shard(spec, 1, 0), dtype=torch.bfloat16)
    for lw in upcast.layers:
        for field in dataclasses.fields(lw):
            if getattr(lw, field.name) is not None:
                setattr(lw, field.name, getattr(lw, field.name).float())
    for field in ("embed", "lm_head", "final_norm"):
        setattr(upcast, field, getattr(upcast, field).float())
    assert torch.equal(float32_logits(spec, bf16, tokens), float32_logits(spec, upcast, tokens))
    if spec.sliding_window:      # the window matters: without it the logits differ
        unwindowed = dataclasses.replace(spec, sliding_window=None)
        assert not torch.allclose(float32_logits(unwindowed, weights, tokens), logits, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("name", TINY_MOE)
def test_route_history_keeps_every_sparse_layer_and_pins_the_reference(name):
    """The route tasks keep each sparse layer's choices of the step (route_history), which the float32 reference
    makes too for the same 16 tokens; given them it gives the same logits, given other experts other logits
    (the slow GPU test pins its routing to distmk's this way)."""
    from float32_reference import float32_logits
    engine = Engine(name, config=dataclasses.replace(SMALL, batch=16), max_context=64)
    spec, tokens = engine.spec, [(7 * i + 3) % 50 for i in range(16)]
    blocks = engine.kv.allocate([], 16)
    buf = engine.step(tokens, range(16), [blocks] * 16)
    history = buf["route_history"][:, :16].clone()
    assert history.shape == (len(spec.moe_layers), 16, spec.experts_per_token)
    ref, routes = float32_logits(spec, engine.weights, tokens, return_routes=True)
    assert torch.equal(history, routes)
    assert (buf["logits"][:16, :spec.vocab_size] - ref).abs().max() / ref.abs().max() < 1e-4
    assert torch.equal(float32_logits(spec, engine.weights, tokens, routes=history), ref)
    others = float32_logits(spec, engine.weights, tokens, routes=(history + 1) % spec.num_experts)
    assert (others - ref).abs().max() / ref.abs().max() > 1e-2


@pytest.mark.parametrize("name", TINY_MOE)
def test_bfloat16_against_float32_reference_on_cpu(name):
    """test_gpu.py's comparison of bf16 qwen3-30b-a3b with the float32 model of its weights, run here on the tiny
    presets by the reference executor in bf16: the plumbing (teacher-forced steps, route_history, the reference
    routed as distmk routed) and its figures' sense."""
    from test_gpu import against_float32
    engine = Engine(name, dtype=torch.bfloat16, config=dataclasses.replace(SMALL, batch=16), max_context=64)
    figures = against_float32(engine, list(range(10, 26)), 16)
    assert figures["logits_rel_err"] < 1e-2 and figures["greedy_agreement"] >= 0.9, figures
    assert figures["same_experts_fraction"] > 0.9 and figures["teacher_forced_equals_generated"] is not None
