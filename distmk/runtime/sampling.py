"""Sampling from a row of logits: greedy, or temperature with top-k and top-p, from a seeded generator.
Every rank samples from the same gathered logits with the same generator, so all ranks agree. The draw runs
where the logits are (on a GPU: no copy of the vocabulary to the host, no host sort; the generator is the
device's, so a seed draws a different stream on a GPU than on the CPU, as presets' weights do).

Safe for any finite parameters: temperatures under GREEDY_BELOW are greedy (as vLLM treats them), the rest scale the
logits in float64 after subtracting their maximum (so nothing overflows to inf or nan), and top-k, min-p (vLLM's)
and top-p, in that order, always keep the most likely token. vLLM's allowed_token_ids, OpenAI's logit_bias and the
penalties come first, in vLLM's order: the allowed tokens, the bias, then transformers' (and vLLM's)
repetition_penalty over the prompt and the output, OpenAI's presence and frequency penalties over the output; a
greedy sequence with any of them takes the changed logits' argmax here, not the device's. A token's log-probability
(token_logprobs) is the model's: of the logits before the bias, the penalties, any masking, temperature, top-k,
min-p and top-p, as OpenAI and vLLM report it."""
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
    presence_penalty: float = 0.0    # subtracted from the logit of each token the output has
    frequency_penalty: float = 0.0   # subtracted from a token's logit once per time the output has it
    repetition_penalty: float = 1.0  # a seen token's logit divided by it where positive, multiplied where negative
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token, added to its logit): OpenAI's, -100 to 100
    min_p: float = 0.0         # vLLM's: tokens less likely than min_p x the most likely one's are left out
    allowed_tokens: tuple[int, ...] = ()    # vLLM's allowed_token_ids: where given, the only tokens drawn

    def __post_init__(self):
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise DistmkError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:             # also refuses nan
            raise DistmkError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise DistmkError(f"top_k must be >= 0, got {self.top_k}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:          # also refuses nan
                raise DistmkError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise DistmkError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}")
        if not 0 <= self.min_p <= 1:                    # also refuses nan
            raise DistmkError(f"min_p must be in [0, 1], got {self.min_p}")
        if any(token < 0 for token in self.allowed_tokens):
            raise DistmkError(f"allowed token ids are >= 0, got {min(self.allowed_tokens)}")
        for token, bias in self.logit_bias:
            if token < 0 or not -100 <= bias <= 100:          # also refuses nan
                raise DistmkError(f"logit_bias takes token ids >= 0 to biases in [-100, 100], got {token}: {bias}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def penalized(self) -> bool:
        """Whether the logits change before sampling (penalize): a logit bias or penalties."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1 or self.logit_bias
                    or self.allowed_tokens)

    @property
    def needs_logits(self) -> bool:
        """Whether choosing a token takes the gathered logits (sample), not the device's argmax."""
        return not self.greedy or self.penalized


def resolve_sampling(temperature: float | None, top_p: float | None, top_k: int | None, seed: int | None, *,
                     defaults: dict, greedy_default: bool, presence_penalty: float = 0.0,
                     frequency_penalty: float = 0.0, repetition_penalty: float | None = None,
                     logit_bias: dict[int, float] | None = None, min_p: float | None = None,
                     allowed_tokens: list[int] | None = None) -> SamplingParams:
    """What a caller asked for, each parameter it left out (None) taken from the checkpoint's defaults
    (ModelSpec.generation_defaults), else from distmk's: greedy for the CLI, temperature 1 for the API."""
    given = {"temperature": temperature, "top_p": top_p, "top_k": top_k, "repetition_penalty": repetition_penalty,
             "min_p": min_p}
    values = {"temperature": 0.0 if greedy_default else 1.0, "top_p": 1.0, "top_k": 0, "repetition_penalty": 1.0,
              "min_p": 0.0, **defaults, **{k: v for k, v in given.items() if v is not None}}
    return SamplingParams(values["temperature"], values["top_p"], values["top_k"], seed, presence_penalty,
                          frequency_penalty, values["repetition_penalty"], tuple(sorted((logit_bias or {}).items())),
                          values["min_p"], tuple(sorted(set(allowed_tokens or ()))))


def penalize(logits: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int]) -> torch.Tensor:
    """The logits (float64) with every token but the allowed ones (where given) at -inf, the sequence's logit bias
    added, then its penalties: repetition over every token of prompt and output, presence and frequency over the
    output's counts."""
    logits = logits.double().clone()
    if params.allowed_tokens:
        allowed = torch.tensor(params.allowed_tokens, device=logits.device)
        logits = torch.full_like(logits, -math.inf).index_copy_(0, allowed, logits[allowed])
        if bool(torch.isneginf(logits).all()):        # else every token would tie below
            raise DistmkError("none of allowed_token_ids may come next (a grammar or min_tokens holds them back)")
    if params.logit_bias:
        tokens, biases = zip(*params.logit_bias)
        logits[torch.tensor(tokens, device=logits.device)] += torch.tensor(biases, dtype=logits.dtype,
                                                                           device=logits.device)
    if params.repetition_penalty != 1:
        seen = torch.tensor(sorted(set(prompt) | set(output)), dtype=torch.long, device=logits.device)
        values = logits[seen]
        logits[seen] = torch.where(values > 0, values / params.repetition_penalty, values * params.repetition_penalty)
    if output and (params.presence_penalty or params.frequency_penalty):
        counts = torch.bincount(torch.tensor(output, device=logits.device), minlength=logits.numel()).double()
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).double()
    # a legal but extreme repetition_penalty (5e-324, 1e308) divides or multiplies past float64's range: the
    # penalised logits stay finite, the largest (or smallest) there is, so sampling's softmax stays a distribution
    return logits.nan_to_num(posinf=torch.finfo(torch.float64).max, neginf=torch.finfo(torch.float64).min)


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None,
           prompt: list[int] = (), output: list[int] = ()) -> int:
    """The next token of a sequence with this prompt and output so far (what the penalties read)."""
    logits = penalize(logits, params, prompt, output) if params.penalized else logits.double()
    if params.greedy:
        return int(logits.argmax())
    logits = (logits - logits.max()) / params.temperature       # <= 0 everywhere, 0 at the maximum
    if params.top_k:
        kth = torch.topk(logits, min(params.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.min_p:                                                # the most likely token always stays
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0)
        probs /= probs.sum()
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
    rank: int = 1           # 1 + how many tokens are more likely (vLLM's prompt_logprobs report it)


def token_logprobs(logits: torch.Tensor, tokens: list[int], ks: list[int]) -> list[TokenLogprob]:
    """TokenLogprob of each row of `logits` [rows, vocab]: row r chose tokens[r] and lists its ks[r] most likely;
    computed where the logits are, in float32 (a long prompt's rows are a GB of them), in one copy to the host."""
    logprobs = torch.log_softmax(logits.float(), dim=-1).nan_to_num_(nan=-9999.0).clamp_(min=-9999.0)
    chosen = logprobs.gather(1, torch.tensor(tokens, device=logits.device)[:, None])
    rank = (logprobs > chosen).sum(dim=-1) + 1
    top = torch.topk(logprobs, min(max(ks), logprobs.shape[-1]), dim=-1, sorted=True)
    chosen, rank, ids, values = chosen[:, 0].tolist(), rank.tolist(), top.indices.tolist(), top.values.tolist()
    return [TokenLogprob(chosen[r], tuple(zip(ids[r][:k], values[r][:k])), rank[r]) for r, k in enumerate(ks)]
