"""Automatic prefix caching: a prompt starts from the KV blocks an earlier sequence wrote for the same prefix, and
gets the tokens it gets when it reads its whole prompt (float32 on the CPU, through the steps and the prefill path).
The server's side (usage, /metrics, at tp=2): test_serve.py."""
import pytest

from conftest import hf_greedy
from distmk.graph import GraphConfig
from distmk.runtime.batcher import Batcher, Sequence
from distmk.runtime.engine import Engine
from distmk.runtime.kv_cache import KVCache, block_hashes

MODEL = "tiny-qwen2"
SHARED = [(7 * i + 3) % 300 for i in range(26)]       # a 26-token prefix: 6 full blocks of 4


@pytest.fixture
def engine():
    """Its own for each test: the prefix cache lives as long as the engine's KV cache."""
    return Engine(MODEL, config=GraphConfig(batch=6, kv_splits=2, tile_rows=32, workers=3), max_context=64,
                  block_size=4, max_seqs=4)


def run(batcher, *seqs):
    for seq in seqs:
        batcher.submit(seq)
    while batcher.busy:
        batcher.step()
    return [seq.output for seq in seqs]


def test_a_blocks_hash_names_its_tokens_and_every_token_before_them():
    a = block_hashes(list(range(10)), 4)
    assert len(a) == 2                                           # full blocks only
    assert block_hashes(list(range(8)) + [99, 98], 4) == a      # the partial block does not count
    changed = block_hashes([5] + list(range(1, 10)), 4)
    assert changed[0] != a[0] and changed[1] != a[1]            # a change early changes every later block
    assert block_hashes(list(range(12)), 4, a[1], 2) == block_hashes(list(range(12)), 4)[2:]   # chained on


def test_cached_blocks_are_shared_counted_and_evicted_least_recently_used_first():
    kv = KVCache(1, 1, 4, 2, 1, 1, None, "cpu")                 # 4 blocks of 2
    h = block_hashes([1, 2, 3, 4, 5, 6], 2)
    first = kv.allocate([], 6)
    for block, block_hash in zip(first, h):
        kv.register(block, block_hash)
    assert kv.match(h) == first and kv.match(block_hashes([1, 2, 9, 9], 2)) == first[:1]
    kv.share(first[:2])                                          # a second sequence starts from two of them
    kv.release(first)
    assert kv.available == 2 and kv.evictable == {first[2]: None}   # its last block no one holds: cached, free
    kv.release(first[:2])
    assert kv.available == 4 and kv.match(h) == first
    taken = kv.allocate([], 4)                                   # the never-written block, then the oldest cached
    assert taken == [next(b for b in range(4) if b not in first), first[2]]
    assert kv.match(h) == first[:2]                              # block 3 of the prefix is forgotten
    with pytest.raises(Exception, match="KV cache is full: 3 more block"):
        kv.allocate([], 6)


@pytest.mark.parametrize("prefill_chunk", [0, 8])
def test_a_shared_prefix_is_read_once_and_gives_the_tokens_of_reading_it_whole(engine, monkeypatch, prefill_chunk):
    """Three prompts share a 26-token prefix: the first reads it, the later ones start after its 6 cached blocks
    (the same prompt again: after the blocks before its last token). Every output is transformers' greedy one,
    read through the steps' rows (prefill_chunk 0) or prefill chunks from the cached position on (8)."""
    monkeypatch.setattr(engine, "prefill_chunk", prefill_chunk)
    batcher = Batcher(engine)
    prompts = [SHARED + [1, 2, 3], SHARED + [40, 41, 42, 43, 44, 45, 46, 47, 48, 49], SHARED + [1, 2, 3]]
    first = Sequence(prompts[0], 5)
    rows = []                       # (position of each row) of every step, to see what was read again
    step = batcher.run
    batcher.run = lambda inputs: rows.append(inputs.positions) or step(inputs)
    assert run(batcher, first) == [hf_greedy(MODEL, tuple(prompts[0]), 5)[0]]
    later = [Sequence(p, 5) for p in prompts[1:]]
    rows.clear()
    outputs = run(batcher, *later)
    assert outputs == [hf_greedy(MODEL, tuple(p), 5)[0] for p in prompts[1:]]
    assert [s.cached_tokens for s in later] == [24, 28]     # 29 tokens: the 7 blocks before the last token
    assert first.cached_tokens == 0 and min(p for r in rows for p in r) >= 24
    assert batcher.prefix_queried == sum(map(len, prompts)) and batcher.prefix_hits == 52
    assert engine.kv.available == engine.kv.num_blocks


@pytest.mark.parametrize("prefill_chunk", [0, 8])
def test_prompts_sent_together_read_their_shared_prefix_once(engine, monkeypatch, prefill_chunk):
    """The same prompt three times at once (a request's n choices) and a fourth prompt with the same prefix: the
    first reads the prefix; the others wait until its blocks are cached, then start after them (a prompt of its
    own meanwhile starts at once). Every output is transformers' greedy one."""
    monkeypatch.setattr(engine, "prefill_chunk", prefill_chunk)
    batcher = Batcher(engine)
    prompts = [SHARED + [1, 2, 3]] * 3 + [SHARED + [40, 41]]
    seqs = [Sequence(p, 4) for p in prompts]
    other = Sequence([9, 8, 7, 6, 5], 4)
    for seq in (*seqs[:3], other, seqs[3]):
        batcher.submit(seq)
    batcher.step()
    assert batcher.running == [seqs[0], other] and batcher.waiting == [seqs[1], seqs[2], seqs[3]]
    while batcher.busy:
        batcher.step()
    assert [s.output for s in seqs] == [hf_greedy(MODEL, tuple(p), 4)[0] for p in prompts]
    assert other.output == hf_greedy(MODEL, (9, 8, 7, 6, 5), 4)[0]
    assert [s.cached_tokens for s in seqs] == [0, 28, 28, 24] and other.cached_tokens == 0
    assert batcher.prefix_hits == 80 and engine.kv.available == engine.kv.num_blocks


def test_a_prompt_arriving_while_its_prefix_is_being_generated_reuses_what_is_written(engine):
    """The first sequence's prompt and generated tokens are offered as their blocks fill: a second whose prompt
    is the first's prompt and output so far starts from them while the first still runs."""
    batcher = Batcher(engine)
    first = batcher.submit(Sequence(SHARED, 12))
    while len(first.output) < 6:
        batcher.step()
    follow = Sequence(SHARED + first.output[:5] + [7], 4)
    batcher.submit(follow)
    while batcher.busy:
        batcher.step()
    assert follow.cached_tokens == 28 and first.finish_reason == "length"
    assert follow.output == hf_greedy(MODEL, tuple(follow.prompt), 4)[0]


def test_without_the_prefix_cache_or_with_prompt_logprobs_every_prompt_is_read(engine):
    repeated = SHARED + [5]
    run(Batcher(engine), Sequence(repeated, 2))
    uncached = Sequence(repeated, 2)
    run(Batcher(engine, prefix_cache=False), uncached)
    logprobs = Sequence(repeated, 2, prompt_logprobs=1)
    run(Batcher(engine), logprobs)
    assert uncached.cached_tokens == logprobs.cached_tokens == 0
    assert len(logprobs.prompt_token_logprobs) == len(repeated) - 1
    assert uncached.output == logprobs.output == hf_greedy(MODEL, tuple(repeated), 2)[0]


def test_cached_blocks_give_way_to_new_sequences_when_the_cache_is_full():
    """A pool of 2 sequences x 16 blocks: after prompts that fill it with cached blocks, a sequence that needs
    every block evicts them, and the prompts read again get their tokens."""
    small = Engine(MODEL, config=GraphConfig(batch=6, kv_splits=2, tile_rows=32, workers=3), max_context=64,
                   block_size=4, max_seqs=2)
    batcher = Batcher(small)
    prompts = [[(11 * i + j) % 300 for i in range(40)] for j in range(3)]
    run(batcher, *(Sequence(p, 2) for p in prompts))
    assert len(small.kv.cached) > 16                             # more than one sequence's room is cached
    big = [Sequence([1, 2, 3], 61), Sequence([4, 5, 6], 61)]     # 16 blocks each: every block of the pool
    run(batcher, *big)
    again = Sequence(prompts[0], 2)
    assert run(batcher, again) == [hf_greedy(MODEL, tuple(prompts[0]), 2)[0]] and again.cached_tokens == 0
