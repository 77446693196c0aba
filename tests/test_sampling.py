"""Sampling: seeded and reproducible, top-k/top-p restrict the support, all ranks agree."""
import pytest
import torch

from distmk.errors import DistmkError
from distmk.reference.comm import run_simulated_ranks
from distmk.runtime.engine import Engine
from distmk.runtime.sampling import SamplingParams, sample
from conftest import PROMPT, SMALL, hf_greedy


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


@pytest.mark.parametrize("kw, message", [({"temperature": -0.1}, "temperature"), ({"top_p": 0}, "top_p"),
                                         ({"top_k": -1}, "top_k")])
def test_bad_sampling_parameters(kw, message):
    with pytest.raises(DistmkError, match=message):
        SamplingParams(**kw)
