"""distmk's greedy tokens and logits against transformers' own generate, on the same weights."""
import json

import pytest
import torch

from distmk.comm.cpu import run_simulated_ranks
from distmk.runtime.engine import Engine
from conftest import PROMPT, SMALL, TINY, hf_generate, hf_greedy, hf_model


def generate_tp(name, tp, config=SMALL, new_tokens=32, prompt=PROMPT, prefill_chunk=0, **kw):
    """Every simulated rank's (tokens, logits); the prompt through the decode graph's steps unless prefill_chunk."""
    return run_simulated_ranks(tp, lambda rank, comm: Engine(name, tp=tp, rank=rank, comm=comm, config=config,
                                                             prefill_chunk=prefill_chunk, **kw)
                               .generate(prompt, new_tokens, return_logits=True))


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("name", TINY)
def test_greedy_and_logits_match_transformers(name, tp):
    ref_tokens, ref_logits = hf_greedy(name)
    results = generate_tp(name, tp)
    tokens, logits = results[0]
    assert tokens == ref_tokens
    rel = (logits - ref_logits).abs().max() / ref_logits.abs().max()
    assert rel < 1e-4, f"max relative logit error {rel:.2e}"
    for other_tokens, other_logits in results[1:]:       # every rank holds bit-identical results
        assert other_tokens == tokens
        assert torch.equal(other_logits, logits)


@pytest.mark.parametrize("name", TINY)
def test_tp2_checkpoint_dirs_match_transformers(name, saved_checkpoints):
    """A directory written by save_pretrained (tiny-llama's sharded, with an index), each rank reading its slices
    of every family's tensor names (torchrun's launch of one: test_cli.py)."""
    results = run_simulated_ranks(2, lambda rank, comm: Engine(saved_checkpoints[name], tp=2, rank=rank, comm=comm,
                                                               config=SMALL).generate(PROMPT, 32))
    assert results[0] == results[1] == hf_greedy(name)[0]


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("name", TINY)
def test_prefill_chunks_match_transformers(name, tp):
    """A 40-token prompt prefilled by matrix products (runtime/prefill.py) in chunks of 16, 16 and 8 tokens (the last
    one's last row gives the first token): transformers' tokens, and every rank bit-identical."""
    prompt = [(7 * i + 3) % 50 for i in range(40)]
    ref_tokens, ref_logits = hf_greedy(name, tuple(prompt), 16)
    results = generate_tp(name, tp, new_tokens=16, prompt=prompt, prefill_chunk=16)
    tokens, logits = results[0]
    assert tokens == ref_tokens
    assert (logits - ref_logits).abs().max() / ref_logits.abs().max() < 1e-4
    assert all(t == tokens and torch.equal(lg, logits) for t, lg in results[1:])


def test_compiled_prefill_stages_match_transformers():
    """The prefill's element-wise stages torch.compile'd, as a GPU runs them (here Inductor's CPU code): chunks
    of 16, 16 and 8 tokens, one compilation for all three lengths, transformers' tokens, ranks bit-identical."""
    prompt = [(7 * i + 3) % 50 for i in range(40)]
    ref_tokens, ref_logits = hf_greedy("tiny-qwen3", tuple(prompt), 16)
    results = generate_tp("tiny-qwen3", 2, new_tokens=16, prompt=prompt, prefill_chunk=16, compile_prefill=True)
    tokens, logits = results[0]
    assert tokens == ref_tokens
    assert (logits - ref_logits).abs().max() / ref_logits.abs().max() < 1e-4
    assert all(t == tokens and torch.equal(lg, logits) for t, lg in results[1:])


@pytest.mark.parametrize("start", [0, 19])
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3", "window"])
def test_chunk_in_a_longer_bucket_writes_the_plain_chunks_kv(name, start, request):
    """What a chunk's CUDA graph records (runtime/prefill.ChunkGraphs, captured on a GPU only), run as it is: an
    11-token chunk at `start` (after a plain chunk of the positions before it) in the 16-row bucket, whose extra
    rows repeat the last one, and at start 19 in the bucket of the 64 keys a sequence holds (past its 30, the rest
    of its block, then that block again), writes the K and V the plain chunk writes, and nothing past its
    positions; as its prompt's last chunk, the logits of its last row are the plain chunk's. "window": tiny-mistral
    with a sliding window of 8, whose chunks, the first included, all go through the masked keys."""
    from distmk.runtime.prefill import ChunkGraphs, prefill_chunk
    model = request.getfixturevalue("sliding_window_checkpoint")[0] if name == "window" else name
    tokens = [(5 * i + 2) % 40 for i in range(start + 11)]
    caches, logits = [], []
    for bucketed in (False, True):
        engine = Engine(model, config=SMALL, max_context=64)
        blocks = engine.kv.allocate([], start + 11)
        if start:
            prefill_chunk(engine, tokens[:start], 0, blocks)
        if bucketed:
            graphs = ChunkGraphs(engine, 16)
            bucket = graphs.stage(tokens[start:], start, blocks)
            assert bucket == (16, 64 if start or name == "window" else 0)
            logits.append(graphs.forward(*bucket, last=True))
        else:
            logits.append(prefill_chunk(engine, tokens[start:], start, blocks, last=True))
        caches.append((engine.kv.k.clone(), engine.kv.v.clone()))
    assert logits[0].shape == logits[1].shape == (1, engine.spec.vocab_size)
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-4, atol=1e-5)
    for plain, bucketed in zip(*caches):
        torch.testing.assert_close(bucketed, plain, rtol=1e-4, atol=1e-5)     # float32: other GEMM shapes
    end = start + 11                                                  # the chunk's blocks' positions end.. untouched
    assert caches[1][0][:, blocks[end // 16], end % 16:].abs().max() == 0


WINDOW_PROMPT = [(5 * i + 1) % 60 for i in range(20)]


@pytest.fixture(scope="module")
def sliding_window_checkpoint(tmp_path_factory):
    """tiny-mistral with a sliding window of 8 positions, far shorter than prompt and output, saved by
    transformers: (path, its greedy tokens after WINDOW_PROMPT)."""
    import dataclasses
    from conftest import hf_model
    from distmk.models.presets import preset
    model = hf_model(dataclasses.replace(preset("tiny-mistral"), sliding_window=8))
    path = tmp_path_factory.mktemp("window") / "tiny-mistral-window"
    model.save_pretrained(path)
    return str(path), hf_generate(model, WINDOW_PROMPT, 16)[0, len(WINDOW_PROMPT):].tolist()


@pytest.mark.parametrize("prefill_chunk", [0, 8])
def test_sliding_window_matches_transformers(sliding_window_checkpoint, prefill_chunk):
    """Attention over the last 8 positions only, in the decode graph and in prefill chunks, at tp 1 and 2."""
    path, expected = sliding_window_checkpoint
    for tp in (1, 2):
        results = run_simulated_ranks(tp, lambda rank, comm: Engine(path, tp=tp, rank=rank, comm=comm, config=SMALL,
                                                                    prefill_chunk=prefill_chunk)
                                      .generate(WINDOW_PROMPT, 16, stop_on_eos=False))
        assert results[0] == expected and all(r == expected for r in results)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3"])
def test_default_tiles_and_one_row_steps_match(name):
    """Default tile sizes (one tile per row-parallel output here) and prefill one token per step."""
    from distmk.graph import GraphConfig
    ref_tokens, _ = hf_greedy(name)
    tokens, _ = generate_tp(name, 2, config=GraphConfig(batch=1))[0]
    assert tokens == ref_tokens


@pytest.mark.parametrize("tile_rows", [16, 24])
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-qwen3"])
def test_qkv_tiles_across_heads_match(name, tile_rows):
    """QKV tiles that end inside a head (attention finishes the heads: RoPE, q/k-norm) give transformers' tokens at
    tp 1 and 2."""
    import dataclasses
    ref_tokens, ref_logits = hf_greedy(name)
    for tp in (1, 2):
        tokens, logits = generate_tp(name, tp, config=dataclasses.replace(SMALL, tile_rows=tile_rows))[0]
        assert tokens == ref_tokens
        assert (logits - ref_logits).abs().max() / ref_logits.abs().max() < 1e-4


def test_prompt_ids_equal_to_the_pad_id_are_attended():
    """Token id 0 (the reference's pad_token_id) inside the prompt is a token like any other."""
    prompt = (0, 1, 0, 2, 0)
    assert Engine("tiny-llama", config=SMALL).generate(list(prompt), 8) == hf_greedy("tiny-llama", prompt, 8)[0]


def test_eos_ids_of_generation_config_stop_as_transformers_stops(generation_config_checkpoint):
    """eos_token_id given only in generation_config.json, as a list: transformers stops on it, so does distmk."""
    from transformers import AutoModelForCausalLM
    path, gen = generation_config_checkpoint
    reference = hf_generate(AutoModelForCausalLM.from_pretrained(path), PROMPT, 32)[0, len(PROMPT):].tolist()
    assert len(reference) < 32 and reference[-1] in gen["eos_token_id"]
    engine = Engine(path, config=SMALL)
    assert engine.spec.eos_token_id == tuple(gen["eos_token_id"])
    assert engine.spec.generation_defaults == {"temperature": 0.6, "top_p": 0.9, "top_k": 20}
    assert engine.generate(PROMPT, 32) == reference


def test_repetition_penalty_of_generation_config_is_the_default_as_in_transformers(tmp_path):
    """A checkpoint whose generation_config.json sets repetition_penalty (Qwen2.5's do): transformers' generate
    applies it, and so does distmk where the caller leaves it out (the CLI's and the server's defaults)."""
    from transformers import AutoModelForCausalLM
    from distmk.runtime.sampling import resolve_sampling
    hf_model("tiny-llama").save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"repetition_penalty": 1.5}))
    reference = hf_generate(AutoModelForCausalLM.from_pretrained(tmp_path), PROMPT, 24)[0, len(PROMPT):].tolist()
    engine = Engine(str(tmp_path), config=SMALL)
    assert engine.spec.generation_defaults == {"repetition_penalty": 1.5}
    params = resolve_sampling(None, None, None, 0, defaults=engine.spec.generation_defaults, greedy_default=True)
    plain = hf_greedy("tiny-llama", new_tokens=24)[0]
    assert engine.generate(PROMPT, 24, params, stop_on_eos=False) == reference != plain
