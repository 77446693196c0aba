"""Several sequences in one step: each row has its own position and paged blocks, and gets the token it
would get alone (what continuous batching will rely on)."""
import pytest

from distmk.errors import DistmkError

from distmk.graph import GraphConfig
from distmk.runtime.engine import Engine
from conftest import hf_greedy


def test_rows_of_different_sequences_in_one_step():
    prompts = [(1, 2, 3, 4, 5, 6, 7), (9, 8, 7), (100, 200, 300, 400, 500)]
    steps = 6
    expected = [hf_greedy("tiny-qwen2", p, steps)[0] for p in prompts]
    engine = Engine("tiny-qwen2", config=GraphConfig(batch=8, kv_splits=2, tile_rows=32, workers=3),
                    block_size=4)
    blocks = [engine.kv.allocate([], len(p) + steps) for p in prompts]
    # prefill: one prompt per step (rows of the same sequence)
    last = []
    for p, b in zip(prompts, blocks):
        buf = engine.step(list(p), range(len(p)), [b] * len(p))
        last.append(int(buf["next_token"][len(p) - 1]))
    got = [[t] for t in last]
    for i in range(1, steps):      # decode: one row per sequence, all in one step
        positions = [len(p) + i - 1 for p in prompts]
        buf = engine.step([g[-1] for g in got], positions, blocks)
        for row, g in enumerate(got):
            g.append(int(buf["next_token"][row]))
    assert got == expected
    # blocks of different sequences are disjoint, and returned blocks can be handed out again
    assert not set(blocks[0]) & set(blocks[1])
    free_before = len(engine.kv.free)
    for b in blocks:
        engine.kv.release(b)
    assert len(engine.kv.free) == free_before + sum(map(len, blocks))


def test_steps_run_the_smallest_table_that_holds_their_rows():
    """With step tables of 1, 2 and 8 rows, a step of 3 rows runs the 8-row table and a lone sequence's decode
    steps the 1-row one, whose attention is split over more workers; every sequence gets transformers' tokens,
    alone and three at once."""
    prompts = [(1, 2, 3, 4, 5, 6, 7), (9, 8, 7), (100, 200, 300, 400, 500)]
    engine = Engine("tiny-qwen2", config=GraphConfig(batch=8, tile_rows=32, workers=16),
                    block_size=4, step_batches=(1, 2), max_seqs=3)
    assert sorted(engine.executors) == [1, 2, 8]
    assert engine.executor_for(1).table.config.kv_splits > engine.executor_for(8).table.config.kv_splits
    assert [engine.executor_for(n).table.config.batch for n in (1, 2, 3, 8)] == [1, 2, 8, 8]
    alone = engine.generate(list(prompts[0]), 6)
    assert engine.last_executor is engine.executors[1]
    assert alone == hf_greedy("tiny-qwen2", prompts[0], 6)[0]
    from distmk.runtime.batcher import Batcher, Sequence
    from distmk.runtime.sampling import SamplingParams
    batcher = Batcher(engine)
    seqs = [batcher.submit(Sequence(list(p), 6, SamplingParams(), False)) for p in prompts]
    while batcher.busy:
        batcher.step()
    assert [s.output for s in seqs] == [hf_greedy("tiny-qwen2", p, 6)[0] for p in prompts]


def test_step_tables_larger_than_a_step_are_refused():
    with pytest.raises(DistmkError, match=r"step_batches \[9\] must lie in 1..8"):
        Engine("tiny-llama", config=GraphConfig(batch=8), step_batches=(2, 9))


def test_kv_cache_full_is_a_clear_error():
    engine = Engine("tiny-llama", config=GraphConfig(batch=1), max_context=32, block_size=16)
    engine.kv.allocate([], 32)
    with pytest.raises(DistmkError, match="KV cache is full: 1 more block"):
        engine.kv.allocate([], 1)
