"""Sampling: seeded and reproducible, top-k/top-p restrict the support, all ranks agree, no finite
parameters break it, and a failure ends one sequence only."""
import pytest
import torch

from distmk.errors import DistmkError
from distmk.comm.cpu import run_simulated_ranks
from distmk.runtime.batcher import Batcher, Sequence, run_step
from distmk.runtime.engine import Engine
from distmk.runtime.sampling import SamplingParams, sample
from conftest import PROMPT, SMALL, hf_generate, hf_greedy, hf_model


def test_top_k_and_top_p_support():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0])
    gen = torch.Generator().manual_seed(0)
    draws = {sample(logits, SamplingParams(temperature=1.0, top_k=2), gen) for _ in range(200)}
    assert draws == {0, 1}
    # softmax of the logits is ~[.64, .24, .09, .03, .01]: top_p=0.5 keeps only the first
    draws = {sample(logits, SamplingParams(temperature=1.0, top_p=0.5), gen) for _ in range(50)}
    assert draws == {0}
    draws = {sample(logits, SamplingParams(temperature=5.0), gen) for _ in range(400)}
    assert draws == {0, 1, 2, 3, 4}
    # min_p: what is at least that share of the most likely token's probability (.64 x 0.3 = .19)
    draws = {sample(logits, SamplingParams(temperature=1.0, min_p=0.3), gen) for _ in range(200)}
    assert draws == {0, 1}
    draws = {sample(logits, SamplingParams(temperature=5.0, min_p=1.0), gen) for _ in range(50)}
    assert draws == {0}


def test_top_k_1_is_greedy():
    tokens = Engine("tiny-llama", config=SMALL).generate(PROMPT, 32, SamplingParams(temperature=0.7, top_k=1, seed=3))
    assert tokens == hf_greedy("tiny-llama")[0]


def test_seeded_sampling_is_reproducible_and_ranks_agree():
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=42)
    runs = [run_simulated_ranks(2, lambda r, c: Engine("tiny-qwen3", tp=2, rank=r, comm=c, config=SMALL)
                                .generate(PROMPT, 16, params)) for _ in range(2)]
    assert runs[0][0] == runs[0][1] == runs[1][0]
    other = Engine("tiny-qwen3", config=SMALL).generate(PROMPT, 16, SamplingParams(1.0, 0.9, 0, seed=43))
    assert other != runs[0][0]


def test_any_finite_parameters_sample_safely():
    """Temperatures down to the smallest double act as greedy, top_p down to it keeps the most likely token,
    the largest temperatures and top_k values are fine: no inf or nan reaches the draw."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(300, generator=gen) * 30
    best = int(logits.argmax())
    for temperature in (5e-324, 1e-320, 1e-50, 1e-39, 1e-6, 1e-5, 1e-3, 1.0, 1e38, 1e308, 1.7976931348623157e308):
        for top_p in (5e-324, 1e-50, 1e-9, 0.5, 1.0):
            for top_k in (0, 1, 7, 10 ** 30):
                token = sample(logits, SamplingParams(temperature, top_p, top_k), gen)
                assert 0 <= token < 300
                # (at huge temperatures every token is about as likely as the best: no single one is kept)
                if temperature < 1e-5 or top_k == 1 or (top_p < 1e-9 and temperature <= 1):
                    assert token == best, (temperature, top_p, top_k)
    assert SamplingParams(temperature=-0.0).greedy and SamplingParams(temperature=1e-50).greedy


def test_extreme_repetition_penalties_sample_safely():
    """A repetition_penalty of 5e-324 divides a seen token's positive logit to inf (the fuzzer's 500: "probability
    tensor contains either inf, nan or element < 0"), one of 1e308 multiplies a negative one to -inf: the penalised
    logits stay finite. At 5e-324 the seen tokens with positive logits are the only ones left to draw."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(300, generator=gen) * 30
    seen = [int(i) for i in logits.argsort()[-5:]] + [int(logits.argmin())]      # five positive, one negative
    for penalty in (5e-324, 1e-320, 1e-50, 1e308, 1.7976931348623157e308):
        for temperature in (0.0, 1.0, 1e308):
            token = sample(logits, SamplingParams(temperature, repetition_penalty=penalty), gen, prompt=seen)
            assert 0 <= token < 300
            if penalty < 1e-300 and temperature <= 1:
                assert token in seen[:5], (penalty, temperature, token)


def test_a_sequence_whose_sampling_fails_fails_alone():
    """Logits the sampler refuses (nan, as a broken checkpoint may give) end that sequence with an error;
    the sequence beside it gets the tokens it gets alone."""
    engine = Engine("tiny-llama", config=SMALL, max_seqs=2)
    params = SamplingParams(temperature=1.0, seed=3)
    alone = engine.generate([4, 5, 6], 6, params)
    poisoned, healthy = Sequence([1, 2, 3], 6, params), Sequence([4, 5, 6], 6, params)

    def run(step):
        greedy, logits = run_step(engine, step)
        for row, blocks in enumerate(step.block_tables):
            if blocks == poisoned.blocks:
                logits[row] = float("nan")
        return greedy, logits

    batcher = Batcher(engine, run=run)
    batcher.submit(poisoned)
    batcher.submit(healthy)
    while batcher.busy:
        batcher.step()
    assert poisoned.finish_reason == "error" and "probability tensor" in poisoned.error and not poisoned.output
    assert healthy.finish_reason == "length" and healthy.output == alone
    assert engine.kv.available == engine.kv.num_blocks


@pytest.mark.parametrize("kw, message", [({"temperature": -0.1}, "temperature"), ({"top_p": 0}, "top_p"),
                                         ({"top_k": -1}, "top_k"), ({"temperature": float("nan")}, "temperature"),
                                         ({"temperature": float("inf")}, "temperature"),
                                         ({"top_p": float("nan")}, "top_p"),
                                         ({"presence_penalty": 2.5}, "presence_penalty must be in"),
                                         ({"frequency_penalty": float("nan")}, "frequency_penalty"),
                                         ({"repetition_penalty": 0}, "repetition_penalty must be a finite"),
                                         ({"min_p": 1.5}, "min_p must be in"), ({"min_p": float("nan")}, "min_p")])
def test_bad_sampling_parameters(kw, message):
    with pytest.raises(DistmkError, match=message):
        SamplingParams(**kw)


def test_penalties_are_transformers_and_openais():
    """repetition_penalty is transformers' RepetitionPenaltyLogitsProcessor over prompt and output; presence and
    frequency are OpenAI's documented subtraction over the output's counts; a greedy sequence with a penalty takes
    the penalised argmax."""
    from transformers import RepetitionPenaltyLogitsProcessor
    from distmk.runtime.sampling import penalize
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(50, generator=gen, dtype=torch.float64)
    prompt, output = [3, 7, 7, 11], [7, 20, 20, 20, 42]
    want = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([prompt + output]), logits[None].clone())[0]
    assert torch.allclose(penalize(logits, SamplingParams(repetition_penalty=1.3), prompt, output), want)
    got = penalize(logits, SamplingParams(presence_penalty=0.5, frequency_penalty=-0.25), prompt, output)
    counts = torch.bincount(torch.tensor(output), minlength=50).double()
    assert torch.allclose(got, logits - (-0.25) * counts - 0.5 * (counts > 0).double())
    assert torch.equal(got[3], logits[3])                        # presence and frequency: the output only
    top = int(logits.argmax())
    logits[top] += 0.01 - (logits[top] - logits.topk(2).values[1])       # the best by 0.01 over the second
    assert sample(logits, SamplingParams()) == top
    assert sample(logits, SamplingParams(presence_penalty=1.0), output=[top]) != top


def test_greedy_with_repetition_penalty_gives_transformers_tokens():
    """Greedy decoding with a repetition penalty: transformers' generate(repetition_penalty=...) tokens."""
    want = hf_generate(hf_model("tiny-llama"), PROMPT, 24, repetition_penalty=1.5)[0, len(PROMPT):].tolist()
    plain = Engine("tiny-llama", config=SMALL).generate(PROMPT, 24, SamplingParams(), stop_on_eos=False)
    got = Engine("tiny-llama", config=SMALL).generate(PROMPT, 24, SamplingParams(repetition_penalty=1.5),
                                                      stop_on_eos=False)
    assert got == want != plain


def test_min_p_of_generation_config_is_the_default():
    """generation_config.json's min_p (vLLM reads it too) where the caller leaves it out; out of [0, 1] refused."""
    from distmk.errors import ModelError
    from distmk.models.presets import preset
    from distmk.models.spec import with_generation_config
    from distmk.runtime.sampling import resolve_sampling
    defaults = with_generation_config(preset("tiny-llama"), {"min_p": 0.05}).generation_defaults
    assert defaults == {"min_p": 0.05}
    assert resolve_sampling(None, None, None, None, defaults=defaults, greedy_default=False).min_p == 0.05
    assert resolve_sampling(None, None, None, None, defaults=defaults, greedy_default=False, min_p=0.0).min_p == 0
    with pytest.raises(ModelError, match="min_p must be a finite number >= 0 and <= 1"):
        with_generation_config(preset("tiny-llama"), {"min_p": 2})


def test_allowed_tokens_are_the_only_ones_drawn_and_none_left_is_an_error():
    """vLLM's allowed_token_ids: greedy and sampled draws come from them alone; where a mask (a grammar's,
    min_tokens') leaves none of them, sampling says so rather than drawing from the ties of a masked row."""
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0))
    allowed = (3, 17, 41)
    assert sample(logits, SamplingParams(allowed_tokens=allowed)) == max(allowed, key=lambda t: logits[t])
    generator = torch.Generator().manual_seed(1)
    draws = {sample(logits, SamplingParams(temperature=1.0, allowed_tokens=allowed), generator) for _ in range(200)}
    assert draws == set(allowed)
    masked = logits.index_fill(0, torch.tensor(allowed), float("-inf"))
    with pytest.raises(DistmkError, match="none of allowed_token_ids may come next"):
        sample(masked, SamplingParams(allowed_tokens=allowed))
