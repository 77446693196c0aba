"""Continuous batching: sequences that join and leave between steps get the tokens they would get alone."""
import dataclasses

import pytest

from conftest import hf_greedy
from distmk.errors import DistmkError
from distmk.graph import GraphConfig
from distmk.runtime.engine import Engine
from distmk.runtime.batcher import Batcher, Sequence, run_step


@pytest.fixture(scope="module")
def engine():
    return Engine("tiny-qwen2", config=GraphConfig(batch=6, kv_splits=2, tile_rows=32, workers=3),
                  max_context=64, block_size=4, max_seqs=8)


def test_joining_and_leaving_sequences_match_generating_alone(engine):
    prompts = [list(range(1, 12)), [7, 8, 9], list(range(100, 109)), [42]]
    max_tokens = [5, 9, 3, 7]
    alone = [engine.generate(p, m) for p, m in zip(prompts, max_tokens)]
    batcher = Batcher(engine)
    seqs = [batcher.submit(Sequence(prompts[0], max_tokens[0])), batcher.submit(Sequence(prompts[1], max_tokens[1]))]
    steps = 0
    while batcher.busy:
        if steps == 2:                      # two more arrive while the first are mid-flight
            seqs += [batcher.submit(Sequence(p, m)) for p, m in zip(prompts[2:], max_tokens[2:])]
        batcher.step()
        steps += 1
    assert [s.output for s in seqs] == alone
    assert all(s.finish_reason == "length" for s in seqs)
    assert engine.kv.available == engine.kv.num_blocks          # every block came back


@pytest.mark.parametrize("prefill_chunk, steps_at_least", [(0, 5), (8, 3)])
def test_long_prompt_is_chunked_while_a_stream_keeps_decoding(engine, monkeypatch, prefill_chunk, steps_at_least):
    """A 30-token prompt is read through the steps' free rows (prefill_chunk 0), or by prefill chunks of 8 tokens,
    one before each step, beside those rows: either way the running stream gets a token every step."""
    monkeypatch.setattr(engine, "prefill_chunk", prefill_chunk)
    batcher = Batcher(engine, prefix_cache=False)       # every prompt read whole
    stream = batcher.submit(Sequence([5, 6], 20))
    batcher.step()
    batcher.step()
    long = batcher.submit(Sequence(list(range(200, 230)), 2))      # 30 prompt tokens, 6 rows a step
    before, steps = len(stream.output), 0
    while long.output == []:
        batcher.step()
        steps += 1
    assert len(stream.output) - before == steps >= steps_at_least
    batcher.cancel(stream)
    while batcher.busy:
        batcher.step()
    assert stream.finish_reason == "cancelled" and long.finish_reason == "length"
    assert engine.kv.available == engine.kv.num_blocks


def test_a_lone_long_prompt_is_prefilled_without_steps_between_its_chunks(engine, monkeypatch):
    """With no stream decoding, a step of prompt rows alone would only delay the next chunk: the chunks of a
    30-token prompt run back to back, then one step reads its last 6 tokens and gives the first token."""
    monkeypatch.setattr(engine, "prefill_chunk", 8)
    batcher = Batcher(engine, prefix_cache=False)
    steps, run = [], batcher.run
    batcher.run = lambda step: steps.append(step) or run(step)
    prompt = list(range(200, 230))
    seq = batcher.submit(Sequence(prompt, 3))
    while batcher.busy:
        batcher.step()
    assert [step.positions for step in steps] == [list(range(24, 30)), [30], [31]]
    assert seq.output == hf_greedy("tiny-qwen2", tuple(prompt), 3)[0]


def test_a_prompt_that_ends_in_a_prefill_chunk_takes_its_first_token_from_it(engine, monkeypatch):
    """A 16-token prompt in prefill chunks of 8 (after the first, more than a step's 6 rows are left): the second
    chunk ends the prompt and its last row's logits give the first token, with no decode step for it (which would
    add a step to the time to first token), returned at once, before the next step runs; the token's
    log-probability comes from them too. Tokens and logits are transformers', each log-probability the log-softmax
    of the logits its token was chosen from."""
    import torch
    monkeypatch.setattr(engine, "prefill_chunk", 8)
    batcher = Batcher(engine, prefix_cache=False)
    steps, chunks, run, prefill = [], [], batcher.run, batcher.prefill
    batcher.run = lambda step: steps.append(step) or run(step)
    batcher.prefill = lambda chunk: chunks.append(chunk) or prefill(chunk)
    prompt = list(range(200, 216))
    seq = batcher.submit(Sequence(prompt, 3, logprobs=2, keep_logits=True))
    calls = []
    while batcher.busy:
        calls.append(batcher.step())
    assert [(c.start, len(c.tokens), c.last) for c in chunks] == [(0, 8, False), (8, 8, True)]
    assert [step.positions for step in steps] == [[16], [17]]
    assert calls == [[], [(seq, seq.output[0])], [(seq, seq.output[1])], [(seq, seq.output[2])]]
    ref_tokens, ref_logits = hf_greedy("tiny-qwen2", tuple(prompt), 3)
    logits = torch.stack(seq.logits)
    assert seq.output == ref_tokens
    assert (logits - ref_logits).abs().max() / ref_logits.abs().max() < 1e-4
    want = torch.log_softmax(logits.double(), dim=-1)
    for row, token, got in zip(want, seq.output, seq.token_logprobs, strict=True):
        assert got.logprob == pytest.approx(row[token].item()) and got.top[0] == (token, got.logprob)


def test_a_prompt_bound_for_prefill_chunks_starts_with_one(engine, monkeypatch):
    """Two prompts bound for prefill chunks arrive together beside a stream, the first short enough for one chunk:
    the step after it has rows to spare, and the second prompt waits for its own first chunk at position 0
    instead of feeding its start through them (a first chunk attends to its own keys alone, so the rest of a
    prompt cut so costs more than a whole first chunk). Both prompts and the stream get
    the tokens they would get alone."""
    monkeypatch.setattr(engine, "prefill_chunk", 8)
    batcher = Batcher(engine, prefix_cache=False)
    chunks, prefill = [], batcher.prefill
    batcher.prefill = lambda chunk: chunks.append(chunk) or prefill(chunk)
    stream = batcher.submit(Sequence([5, 6], 12))
    batcher.step()
    prompts = [list(range(200, 209)), list(range(300, 330))]      # 8 tokens before the last: one chunk
    seqs = [batcher.submit(Sequence(p, 3)) for p in prompts]
    while batcher.busy:
        batcher.step()
    firsts = {id(c.blocks): c.start for c in reversed(chunks)}       # each prompt's earliest chunk
    assert sorted(firsts.values()) == [0, 0] and len(firsts) == 2
    assert [s.output for s in seqs] == [hf_greedy("tiny-qwen2", tuple(p), 3)[0] for p in prompts]
    assert stream.output == hf_greedy("tiny-qwen2", (5, 6), 12)[0]


def test_steps_back_to_back_give_the_tokens_of_single_steps(engine, monkeypatch):
    """steps_per_launch=4: once every sequence decodes, up to 4 steps run per launch (fewer where a sequence
    has fewer tokens left); each sequence gets its tokens alone, one arriving mid-way included, an end of
    sequence mid-launch ends it there, and every KV block comes back."""
    prompts, max_tokens = [list(range(1, 12)), [7, 8, 9], [42]], [10, 6, 9]
    alone = [engine.generate(p, m) for p, m in zip(prompts, max_tokens)]
    launches = []

    def run(step):
        launches.append(step.steps)
        return run_step(engine, step)

    batcher = Batcher(engine, run=run, steps_per_launch=4)
    seqs = [batcher.submit(Sequence(p, m)) for p, m in zip(prompts[:2], max_tokens[:2])]
    while batcher.busy:
        if len(launches) == 3:
            seqs.append(batcher.submit(Sequence(prompts[2], max_tokens[2])))
        batcher.step()
    assert [s.output for s in seqs] == alone and all(s.finish_reason == "length" for s in seqs)
    assert max(launches) == 4 and sum(launches) < sum(max_tokens)
    assert engine.kv.available == engine.kv.num_blocks
    eos = alone[0][4]                        # the fifth token ends the first sequence, inside a launch
    monkeypatch.setattr(engine, "spec", dataclasses.replace(engine.spec, eos_token_id=(eos,)))
    batcher = Batcher(engine, steps_per_launch=4)
    seq = batcher.submit(Sequence(prompts[0], 10))
    while batcher.busy:
        batcher.step()
    assert seq.output == alone[0][:alone[0].index(eos) + 1] and seq.finish_reason == "stop"
    with pytest.raises(DistmkError, match="steps_per_launch must be >= 1"):
        Batcher(engine, steps_per_launch=0)


def test_log_probabilities_are_recorded_a_token_at_a_time(engine):
    """A sequence that asks for log-probabilities gets one per new token, its token's log-softmax and the k most
    likely, also while steps could run back to back (a step whose rows need the logits runs alone): beside a
    greedy sequence that does not ask, sampled ones included, and the tokens are those of generating alone."""
    import torch
    from distmk.runtime.sampling import SamplingParams
    prompts = [list(range(1, 12)), [7, 8, 9]]
    alone, logits = engine.generate(prompts[0], 7, return_logits=True)
    batcher = Batcher(engine, steps_per_launch=4)
    seqs = [batcher.submit(Sequence(prompts[0], 7, logprobs=3, keep_logits=True)),
            batcher.submit(Sequence(prompts[1], 7)),
            batcher.submit(Sequence(prompts[1], 5, SamplingParams(temperature=1.0, seed=3), logprobs=0,
                                    keep_logits=True))]
    while batcher.busy:
        batcher.step()
    assert seqs[0].output == alone and seqs[1].output == engine.generate(prompts[1], 7)
    want = torch.log_softmax(logits.double(), dim=-1)
    for i, (token, got) in enumerate(zip(alone, seqs[0].token_logprobs, strict=True)):
        assert got.logprob == pytest.approx(want[i, token].item())
        assert [t for t, _ in got.top] == want[i].topk(3).indices.tolist() and got.top[0] == (token, got.logprob)
    sampled = seqs[2]
    assert len(sampled.token_logprobs) == len(sampled.output) == 5
    for token, row, got in zip(sampled.output, sampled.logits, sampled.token_logprobs):
        assert got.top == () and got.logprob == pytest.approx(torch.log_softmax(row.double(), -1)[token].item())


def test_prompt_log_probabilities_are_transformers_log_softmax():
    """A sequence that asks for its prompt's log-probabilities (what completions' echo with logprobs and vLLM's
    prompt_logprobs return) gets each prompt token's given the ones before it, with the k most likely: transformers'
    float32 log-softmax over the prompt, to 1e-4. Its 20-token prompt goes through prefill chunks of 4 that compute
    their positions' logits (the lm_head as a matrix product), then the steps' rows, beside a stream that decodes;
    the tokens are those of generating alone."""
    import torch
    from conftest import hf_model
    engine = Engine("tiny-qwen2", config=GraphConfig(batch=6, kv_splits=2, tile_rows=32, workers=3), max_context=64,
                    block_size=4, max_seqs=4, prefill_chunk=4)
    prompt = [(5 * i + 2) % 300 for i in range(20)]
    batcher = Batcher(engine)
    chunks, prefill = [], batcher.prefill
    batcher.prefill = lambda chunk: chunks.append(chunk) or prefill(chunk)
    seqs = [batcher.submit(Sequence([1, 2, 3], 8)), batcher.submit(Sequence(prompt, 3, prompt_logprobs=2))]
    while batcher.busy:
        batcher.step()
    assert len(chunks) >= 2 and all(c.logits for c in chunks)          # beside steps whose prompt rows read more
    assert seqs[1].output == engine.generate(prompt, 3) and seqs[0].output == engine.generate([1, 2, 3], 8)
    with torch.no_grad():
        want = torch.log_softmax(hf_model("tiny-qwen2")(torch.tensor([prompt])).logits[0].double(), dim=-1)
    got = seqs[1].prompt_token_logprobs
    assert len(got) == len(prompt) - 1
    for j, entry in enumerate(got):
        assert entry.logprob == pytest.approx(want[j, prompt[j + 1]].item(), abs=1e-4)
        assert [t for t, _ in entry.top] == want[j].topk(2).indices.tolist()
        assert [v for _, v in entry.top] == pytest.approx(want[j].topk(2).values.tolist(), abs=1e-4)


def test_admission_is_bounded_by_rows_and_by_free_blocks(engine):
    batcher = Batcher(engine)
    seqs = [batcher.submit(Sequence([1, 2, 3], 4)) for _ in range(9)]
    batcher.step()
    assert len(batcher.running) == 6 and len(batcher.waiting) == 3     # one row each: 6 rows a step
    for seq in seqs:
        batcher.cancel(seq)
    small = Engine("tiny-qwen2", config=GraphConfig(batch=6, kv_splits=2, tile_rows=32, workers=3),
                   max_context=64, block_size=4, max_seqs=2)               # 2 x 16 blocks
    batcher = Batcher(small)
    seqs = [batcher.submit(Sequence([1, 2, 3], 61)) for _ in range(3)]  # 16 blocks each
    batcher.step()
    assert len(batcher.running) == 2 and len(batcher.waiting) == 1
    batcher.cancel(seqs[0])
    batcher.step()
    assert len(batcher.running) == 2 and not batcher.waiting             # admitted once blocks came back


def test_bad_requests_are_refused(engine):
    batcher = Batcher(engine)
    with pytest.raises(DistmkError, match="exceeds the context"):
        batcher.submit(Sequence([1, 2, 3], 62))
    with pytest.raises(DistmkError, match="outside the vocabulary"):
        batcher.submit(Sequence([1, 99999], 2))


def test_seeded_sampling_is_reproducible_in_a_batch(engine):
    from distmk.runtime.sampling import SamplingParams
    runs = []
    for _ in range(2):
        batcher = Batcher(engine)
        seqs = [batcher.submit(Sequence([3, 4, 5], 8, SamplingParams(temperature=1.0, top_p=0.9, seed=s)))
                for s in (1, 2)]
        while batcher.busy:
            batcher.step()
        runs.append([s.output for s in seqs])
    assert runs[0] == runs[1] and runs[0][0] != runs[0][1]


def test_fewer_running_sequences_than_rows_leave_rows_for_prompts(engine):
    batcher = Batcher(engine, max_running=2)
    seqs = [batcher.submit(Sequence([1, 2, 3], 4)) for _ in range(3)]
    batcher.step()
    assert len(batcher.running) == 2 and len(batcher.waiting) == 1
    while batcher.busy:
        batcher.step()
    assert [s.output for s in seqs] == [engine.generate([1, 2, 3], 4)] * 3
    with pytest.raises(DistmkError, match="max_running must be in 1..6"):
        Batcher(engine, max_running=7)
