"""Next tokens for a batch of requests, each with its own temperature, top-k, top-p, seed and logprobs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.request import Request
from engine.stop_checker import may_stop_at

# Every row computes in this dtype, whatever the model's: logprobs and the kept sets must not depend on it.
SAMPLING_DTYPE = torch.float32
# torch.exponential_ may return 0; a masked token (probability 0) divided by it would be NaN and win argmax.
MIN_EXPONENTIAL_NOISE = torch.finfo(SAMPLING_DTYPE).tiny


@dataclass(frozen=True)
class TokenLogprobs:
    """Log-probabilities at one step, from the model's raw distribution (before temperature, top-k, top-p)."""

    token_id: int  # the sampled token
    logprob: float  # its log-probability
    top: dict[int, float]  # the top-n token ids -> logprob, most likely first (n = params.logprobs)


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: list[int]  # one per row
    logprobs: list[TokenLogprobs | None]  # None where the request did not ask for logprobs


class Sampler:
    """Picks one token per row of logits.

    Greedy rows (temperature below GREEDY_EPSILON) take the argmax. The others divide by their
    temperature, keep their top-k, then their top-p nucleus, and draw with the exponential race:
    argmax(probs / E) with E ~ Exponential(1) per token picks token i with probability probs[i], and
    each row's noise can come from its own generator. A request with a `seed` owns a generator seeded
    with it on first use, so its tokens do not depend on what else shares the batch or on row order;
    unseeded rows share one generator seeded from `seed`.
    """

    def __init__(self, seed: int = 0) -> None:
        self._seed = seed
        self._shared: dict[torch.device, torch.Generator] = {}
        self._per_request: dict[str, torch.Generator] = {}

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> SamplerOutput:
        """logits: [num_rows, vocab], row i belongs to requests[i]."""
        if logits.dim() != 2 or logits.shape[0] != len(requests):
            raise ValueError(f"logits must be [num_rows={len(requests)}, vocab], got {tuple(logits.shape)}")
        raw = logits.to(SAMPLING_DTYPE)  # [num_rows, vocab]
        scores = _mask_stop_tokens_before_min(raw, requests)  # [num_rows, vocab]

        token_ids = torch.empty(len(requests), dtype=torch.long, device=logits.device)  # [num_rows]
        greedy_rows = [i for i, r in enumerate(requests) if r.sampling_params.greedy]
        sampled_rows = [i for i, r in enumerate(requests) if not r.sampling_params.greedy]
        if greedy_rows:
            rows = torch.tensor(greedy_rows, device=logits.device)
            token_ids[rows] = scores[rows].argmax(dim=-1)
        if sampled_rows:
            rows = torch.tensor(sampled_rows, device=logits.device)
            token_ids[rows] = self._sample(scores[rows], [requests[i] for i in sampled_rows])

        token_id_list = token_ids.tolist()
        return SamplerOutput(token_id_list, _logprobs(raw, requests, token_id_list))

    def free(self, request_id: str) -> None:
        """Forget a finished request's generator."""
        self._per_request.pop(request_id, None)

    def _sample(self, scores: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """scores: [num_rows, vocab] -> [num_rows] sampled token ids."""
        device = scores.device
        params = [r.sampling_params for r in requests]
        temperature = torch.tensor([p.temperature for p in params], dtype=SAMPLING_DTYPE, device=device)
        scores = scores / temperature.unsqueeze(1)
        if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
            vocab = scores.shape[1]
            top_k = torch.tensor(
                [min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params], device=device
            )
            top_p = torch.tensor([p.top_p for p in params], dtype=SAMPLING_DTYPE, device=device)
            scores = apply_top_k_top_p(scores, top_k, top_p)
        probs = scores.softmax(dim=-1)  # [num_rows, vocab]
        noise = self._exponential_noise(probs, requests)  # [num_rows, vocab]
        return (probs / noise).argmax(dim=-1)

    def _exponential_noise(self, probs: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """Exponential(1) noise like probs: seeded rows from their own generators, the rest from the shared one."""
        noise = torch.empty_like(probs)
        # Every generator exists before any noise is drawn: a seed torch refuses then fails before a
        # single generator has advanced, so the engine can sample the other rows again unchanged.
        seeded = {
            i: self._request_generator(r, probs.device)
            for i, r in enumerate(requests)
            if r.sampling_params.seed is not None
        }
        unseeded = [i for i, r in enumerate(requests) if r.sampling_params.seed is None]
        if unseeded:
            shared_noise = torch.empty(len(unseeded), probs.shape[1], dtype=probs.dtype, device=probs.device)
            shared_noise.exponential_(generator=self._shared_generator(probs.device))
            noise[torch.tensor(unseeded, device=probs.device)] = shared_noise
        for i, generator in seeded.items():
            noise[i].exponential_(generator=generator)
        return noise.clamp_(min=MIN_EXPONENTIAL_NOISE)

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        if device not in self._shared:
            self._shared[device] = torch.Generator(device=device).manual_seed(self._seed)
        return self._shared[device]

    def _request_generator(self, request: Request, device: torch.device) -> torch.Generator:
        generator = self._per_request.get(request.request_id)
        if generator is None or generator.device != device:
            generator = torch.Generator(device=device).manual_seed(request.sampling_params.seed)
            self._per_request[request.request_id] = generator
        return generator


def apply_top_k_top_p(scores: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set to -inf every token outside each row's top-k, then outside its top-p nucleus.

    scores: [num_rows, vocab]; top_k: [num_rows] in 1..vocab (vocab = off); top_p: [num_rows] in (0, 1].
    Ranks come from a stable descending sort, so among equal scores the lowest token id ranks first and
    top_k=1 keeps exactly the argmax. The nucleus keeps a token while the probability of the tokens
    ranked above it is below p, which always keeps the first.
    """
    sorted_scores, order = scores.sort(dim=-1, descending=True, stable=True)  # [num_rows, vocab] each
    ranks = torch.arange(scores.shape[1], device=scores.device)  # [vocab]
    outside = ranks.unsqueeze(0) >= top_k.unsqueeze(1)  # [num_rows, vocab]
    sorted_scores = sorted_scores.masked_fill(outside, float("-inf"))
    sorted_probs = sorted_scores.softmax(dim=-1)
    mass_above = sorted_probs.cumsum(dim=-1) - sorted_probs  # [num_rows, vocab]
    outside |= mass_above >= top_p.unsqueeze(1)
    outside[:, 0] = False
    return scores.masked_fill(outside.scatter(1, order, outside), float("-inf"))


def _mask_stop_tokens_before_min(scores: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """Scores with eos and stop_token_ids at -inf for rows that are still below their min_tokens.

    As in vLLM, eos is masked even with ignore_eos. Returns a copy only when something is masked.
    """
    rows: list[int] = []
    cols: list[int] = []
    vocab = scores.shape[1]
    for i, request in enumerate(requests):
        params = request.sampling_params
        if may_stop_at(request.num_output_tokens + 1, params):
            continue
        stop_ids = set(params.stop_token_ids)
        if request.eos_token_id is not None:
            stop_ids.add(request.eos_token_id)
        for token_id in sorted(stop_ids):
            if 0 <= token_id < vocab:
                rows.append(i)
                cols.append(token_id)
    if not rows:
        return scores
    scores = scores.clone()
    scores[torch.tensor(rows, device=scores.device), torch.tensor(cols, device=scores.device)] = float("-inf")
    return scores


def _logprobs(raw: torch.Tensor, requests: list[Request], token_ids: list[int]) -> list[TokenLogprobs | None]:
    """Sampled-token and top-n logprobs, from one log_softmax over the rows that ask for them."""
    wanted = [i for i, r in enumerate(requests) if r.sampling_params.logprobs is not None]
    result: list[TokenLogprobs | None] = [None] * len(requests)
    if not wanted:
        return result
    device = raw.device
    logprobs = raw[torch.tensor(wanted, device=device)].log_softmax(dim=-1)  # [num_wanted, vocab]
    chosen = torch.tensor([token_ids[i] for i in wanted], device=device)
    chosen_logprobs = logprobs.gather(1, chosen.unsqueeze(1)).squeeze(1).tolist()  # [num_wanted]
    max_n = max(requests[i].sampling_params.logprobs for i in wanted)
    top_values, top_ids = logprobs.topk(max_n, dim=-1)  # [num_wanted, max_n] each
    top_values, top_ids = top_values.tolist(), top_ids.tolist()
    for j, i in enumerate(wanted):
        n = requests[i].sampling_params.logprobs
        top = dict(zip(top_ids[j][:n], top_values[j][:n]))
        result[i] = TokenLogprobs(token_ids[i], chosen_logprobs[j], top)
    return result
