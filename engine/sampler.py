"""Next tokens for a batch of requests, each with its own temperature, top-k, top-p, seed and logprobs."""

from __future__ import annotations

from collections import Counter
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


@dataclass
class SampledStep:
    """One step's sampling, queued: token ids on the device now, on the host once `result()` waited."""

    requests: list[Request]
    token_ids: torch.Tensor  # [num_rows] int64 on the device (async scheduling feeds the next step with it)
    wanted: list[int]  # rows that asked for logprobs
    host: list[torch.Tensor]  # token ids, then (if wanted) chosen logprobs, top values, top ids
    copied: torch.cuda.Event | None  # recorded after the copies to `host`; None on the CPU

    def row_of(self) -> dict[Request, int]:
        """Request -> its row in `token_ids`."""
        return {request: row for row, request in enumerate(self.requests)}

    def result(self) -> SamplerOutput:
        """Wait for the copies (if not done yet) and return the tokens and logprobs as Python values."""
        if self.copied is not None:
            self.copied.synchronize()
        token_ids = self.host[0].tolist()
        return SamplerOutput(token_ids, _logprob_lists(self.requests, self.wanted, token_ids, self.host[1:]))


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
        # Speculative decoding: request id -> its generator's state before each of its rows of the last
        # launch, for the requests with more than one row (see `rewind`).
        self._row_states: dict[str, list[torch.Tensor]] = {}

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> SamplerOutput:
        """logits: [num_rows, vocab], row i belongs to requests[i]."""
        return self.launch(logits, requests).result()

    def launch(self, logits: torch.Tensor, requests: list[Request]) -> SampledStep:
        """Queue the sampling of `logits` on the device, and the copy of its results to the host; the
        host waits only in `result()`."""
        if logits.dim() != 2 or logits.shape[0] != len(requests):
            raise ValueError(f"logits must be [num_rows={len(requests)}, vocab], got {tuple(logits.shape)}")
        raw = logits.to(SAMPLING_DTYPE)  # [num_rows, vocab]
        scores = _mask_stop_tokens_before_min(raw, requests)  # [num_rows, vocab]

        greedy_rows = [i for i, r in enumerate(requests) if r.sampling_params.greedy]
        sampled_rows = [i for i, r in enumerate(requests) if not r.sampling_params.greedy]
        if not sampled_rows:
            token_ids = scores.argmax(dim=-1)  # [num_rows]
        else:
            token_ids = torch.empty(len(requests), dtype=torch.long, device=logits.device)  # [num_rows]
            if greedy_rows:
                rows = on_device(greedy_rows, logits.device)
                token_ids[rows] = scores[rows].argmax(dim=-1)
            rows = on_device(sampled_rows, logits.device)
            token_ids[rows] = self._sample(scores[rows], [requests[i] for i in sampled_rows])

        wanted = [i for i, r in enumerate(requests) if r.sampling_params.logprobs is not None]
        results = [token_ids]
        if wanted:
            results += _logprob_tensors(raw, requests, wanted, token_ids)
        host, copied = start_copy_to_host(results)
        return SampledStep(requests, token_ids, wanted, host, copied)

    def free(self, request_id: str) -> None:
        """Forget a finished request's generator."""
        self._per_request.pop(request_id, None)
        self._row_states.pop(request_id, None)

    def rewind(self, request_id: str, num_rows_used: int) -> None:
        """A request sampled several rows in the last launch (speculative verification) but keeps only
        the first `num_rows_used` tokens: its generator goes back to the state after those rows, so its
        next token takes the noise it would have taken without speculation."""
        states = self._row_states.pop(request_id, None)
        generator = self._per_request.get(request_id)
        if states is not None and generator is not None and num_rows_used < len(states):
            generator.set_state(states[num_rows_used])

    def _sample(self, scores: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """scores: [num_rows, vocab] -> [num_rows] sampled token ids."""
        device = scores.device
        params = [r.sampling_params for r in requests]
        temperature = on_device([p.temperature for p in params], device, SAMPLING_DTYPE)
        scores = scores / temperature.unsqueeze(1)
        if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
            vocab = scores.shape[1]
            top_k = on_device([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params], device)
            top_p = on_device([p.top_p for p in params], device, SAMPLING_DTYPE)
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
            noise[on_device(unseeded, probs.device)] = shared_noise
        self._row_states = {}
        counts = Counter(r.request_id for i, r in enumerate(requests) if i in seeded)
        repeated = {request_id for request_id, count in counts.items() if count > 1}
        for i, generator in seeded.items():
            request_id = requests[i].request_id
            if request_id in repeated:
                self._row_states.setdefault(request_id, []).append(generator.get_state())
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


def on_device(values: list, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A short host list as a tensor on `device`, without waiting for the GPU: a copy from pageable memory
    first waits for everything queued before it (the step's forward), one from page-locked memory is
    queued like a kernel, so the sampler's launches overlap the forward instead of following it."""
    tensor = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


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
        if may_stop_at(request.num_output_tokens + request.num_in_flight + 1, params):
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
    # The -inf values are made on the device: a Python scalar assigned through an index would be copied
    # from pageable memory, which waits for the step's forward and undoes async scheduling.
    minus_inf = torch.full((len(rows),), float("-inf"), dtype=scores.dtype, device=scores.device)
    scores.index_put_((on_device(rows, scores.device), on_device(cols, scores.device)), minus_inf)
    return scores


def _logprob_tensors(
    raw: torch.Tensor, requests: list[Request], wanted: list[int], token_ids: torch.Tensor
) -> list[torch.Tensor]:
    """[chosen [num_wanted], top values [num_wanted, max_n], top ids [num_wanted, max_n]] on the device,
    from one log_softmax over the rows that ask for logprobs (the raw distribution)."""
    rows = on_device(wanted, raw.device)
    logprobs = raw[rows].log_softmax(dim=-1)  # [num_wanted, vocab]
    chosen = logprobs.gather(1, token_ids[rows].unsqueeze(1)).squeeze(1)  # [num_wanted]
    max_n = max(requests[i].sampling_params.logprobs for i in wanted)
    top_values, top_ids = logprobs.topk(max_n, dim=-1)  # [num_wanted, max_n] each
    return [chosen, top_values, top_ids]


def _logprob_lists(
    requests: list[Request], wanted: list[int], token_ids: list[int], host: list[torch.Tensor]
) -> list[TokenLogprobs | None]:
    result: list[TokenLogprobs | None] = [None] * len(requests)
    if not wanted:
        return result
    chosen, top_values, top_ids = (t.tolist() for t in host)
    for j, i in enumerate(wanted):
        n = requests[i].sampling_params.logprobs
        top = dict(zip(top_ids[j][:n], top_values[j][:n]))
        result[i] = TokenLogprobs(token_ids[i], chosen[j], top)
    return result


def start_copy_to_host(tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], torch.cuda.Event | None]:
    """CUDA tensors copied into page-locked host memory, queued together, and an event recorded after the
    copies: one wait for all of them instead of one blocking copy each. CPU tensors are returned as is."""
    if tensors[0].device.type != "cuda":
        return tensors, None
    host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
    for h, t in zip(host, tensors):
        h.copy_(t, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record(torch.cuda.current_stream(tensors[0].device))
    return host, copied
