"""Sampling from a row of logits: greedy, or temperature with top-k and top-p, from a seeded generator.
Every rank samples from the same gathered logits with the same generator, so all ranks agree. The draw runs
where the logits are (on a GPU: no copy of the vocabulary to the host, no host sort; the generator is the
device's, so a seed draws a different stream on a GPU than on the CPU, as presets' weights do).

Safe for any finite parameters: temperatures under GREEDY_BELOW are greedy (as vLLM treats them), the
rest scale the logits in float64 after subtracting their maximum (so nothing overflows to inf or nan),
and top-p always keeps the most likely token. A token's log-probability (token_logprobs) is the model's, of the
logits before temperature, top-k and top-p, as OpenAI and vLLM report it."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from distmk.errors import DistmkError

GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0   # 0 (or under GREEDY_BELOW) = greedy
    top_p: float = 1.0
    top_k: int = 0             # 0 = no limit
    seed: int | None = None

    def __post_init__(self):
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise DistmkError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:             # also refuses nan
            raise DistmkError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise DistmkError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


def resolve_sampling(temperature: float | None, top_p: float | None, top_k: int | None, seed: int | None, *,
                     defaults: dict, greedy_default: bool) -> SamplingParams:
    """What a caller asked for, each parameter it left out (None) taken from the checkpoint's defaults
    (ModelSpec.generation_defaults), else from distmk's: greedy for the CLI, temperature 1 for the API."""
    given = {"temperature": temperature, "top_p": top_p, "top_k": top_k}
    values = {"temperature": 0.0 if greedy_default else 1.0, "top_p": 1.0, "top_k": 0, **defaults,
              **{k: v for k, v in given.items() if v is not None}}
    return SamplingParams(values["temperature"], values["top_p"], values["top_k"], seed)


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> int:
    logits = logits.double()
    if params.greedy:
        return int(logits.argmax())
    logits = (logits - logits.max()) / params.temperature       # <= 0 everywhere, 0 at the maximum
    if params.top_k:
        kth = torch.topk(logits, min(params.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1:
        sorted_p, order = probs.sort(descending=True)
        drop = sorted_p.cumsum(0) - sorted_p >= params.top_p       # keep the smallest prefix reaching top_p
        drop[0] = False                                             # and at least the most likely token
        sorted_p[drop] = 0
        probs = torch.zeros_like(probs).scatter(0, order, sorted_p)
    return int(torch.multinomial(probs / probs.sum(), 1, generator=generator))


@dataclass(frozen=True)
class TokenLogprob:
    """A chosen token's log-probability, and the `k` most likely tokens' (id, log-probability), most likely
    first. At least -9999 (as vLLM reports an impossible token; JSON has no -Infinity), and -9999 for a logit
    that is not a number."""
    logprob: float
    top: tuple[tuple[int, float], ...]


def token_logprobs(logits: torch.Tensor, tokens: list[int], ks: list[int]) -> list[TokenLogprob]:
    """TokenLogprob of each row of `logits` [rows, vocab]: row r chose tokens[r] and lists its ks[r] most likely;
    computed where the logits are, in one copy to the host for all rows."""
    logprobs = torch.log_softmax(logits.double(), dim=-1).nan_to_num(nan=-9999.0).clamp(min=-9999.0)
    chosen = logprobs.gather(1, torch.tensor(tokens, device=logits.device)[:, None])[:, 0]
    top = torch.topk(logprobs, min(max(ks), logprobs.shape[-1]), dim=-1, sorted=True)
    chosen, ids, values = chosen.tolist(), top.indices.tolist(), top.values.tolist()
    return [TokenLogprob(chosen[r], tuple(zip(ids[r][:k], values[r][:k]))) for r, k in enumerate(ks)]
