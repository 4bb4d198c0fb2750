"""The engine's speculative decoding: which requests propose, the rows that verify them, what is kept.

One step of a request that speculates, k = 3 proposals d0 d1 d2 after its last known token x:

    step inputs      x   d0  d1  d2          (positions N-1 .. N+2; KV written for all four)
    target samples   t0  t1  t2  t3          (one row each, the request's own adapter applied)
    kept             t0 .. ta: the tokens up to and including the first ti != di (a = accepted drafts)

If d0 == t0 and d1 != t1 the request gains [t0, t1]: two tokens for one step. Rejected proposals' KV
slots are rolled back by lowering `num_computed_tokens` by k - a; the next step overwrites them (the
blocks stay allocated, as in vLLM).

Verification is rejection sampling with a deterministic proposal (n-gram lookup, or the draft model's
argmax): a draft d is accepted with probability p(d) under the target's distribution p (temperature,
top-k, top-p applied), and on rejection the token is drawn from p without d, renormalised. Sampling the
target's token ti with the row's own noise and accepting d iff ti == d is that same law, and it keeps
seeded requests exact: a seeded request's generator is rewound past the unused rows
(Sampler.rewind), so it produces the tokens it would produce without speculation. Greedy rows compare
argmaxes, so greedy requests are exact too.
"""

from __future__ import annotations

from engine.logits_processors import uses_processors
from engine.request import Request, RequestStatus
from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.fallback import AcceptanceFallback
from engine.spec_decode.ngram import TokenHistory, propose_ngram
from engine.spec_decode.stats import SpecDecodeStats
from engine.stop_checker import may_stop_at

# A draft model's proposals are filled in after scheduling; until then the slots hold this token.
PLACEHOLDER_TOKEN = 0


class Speculator:
    """Owned by the engine: `propose` after each step's update, `before_execute` after scheduling (the
    draft model fills its proposals), `sampling_rows` and `verify` around the sampler."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int, runner=None):
        self.config = config
        self.max_model_len = max_model_len
        self.draft = None
        if config.method == "draft_model":
            from engine.spec_decode.draft_model import DraftModelProposer  # torch and the model: only here

            self.draft = DraftModelProposer(config.model, runner, max_model_len)
        self.fallback = AcceptanceFallback(
            config.fallback_acceptance_rate, config.fallback_window, config.fallback_cooldown
        )
        self._drafts: dict[Request, list[int]] = {}  # this step's proposals, per verifying request
        self._history = TokenHistory()
        self._num_drafts = 0
        self._num_draft_tokens = 0
        self._num_accepted = 0
        self._accepted_per_pos = [0] * config.num_speculative_tokens

    # -- proposing --------------------------------------------------------------------------------------

    def propose(self, running: list[Request]) -> None:
        """Set each running request's `spec_token_ids` for the next step (empty: it does not speculate)."""
        limit = self.config.disable_by_batch_size
        off = limit is not None and len(running) > limit
        for request in running:
            request.spec_token_ids = []
            if off or not self._may_speculate(request):
                continue
            k = self._max_proposals(request)
            if k <= 0 or not self.fallback.allows(request.request_id):
                continue
            if self.draft is not None:
                request.spec_token_ids = [PLACEHOLDER_TOKEN] * k
            else:
                config = self.config
                request.spec_token_ids = propose_ngram(
                    self._history.tokens(request), config.prompt_lookup_min, config.prompt_lookup_max, k
                )

    def before_execute(self, scheduled) -> None:
        """Run the draft model over the step (its KV follows the target's) and fill its proposals."""
        if self.draft is not None:
            self.draft.propose(scheduled)

    def _may_speculate(self, request: Request) -> bool:
        """Decoding, and nothing that needs the tokens one at a time: no grammar (its state advances per
        token), no penalties or biases (they read the tokens so far), past min_tokens (stop tokens masked
        per position), and not opted out with `speculative=False`."""
        params = request.sampling_params
        return (
            request.status is RequestStatus.RUNNING
            and request.num_computed_tokens == request.num_tokens - 1
            and params.speculative
            and params.structured_outputs is None
            and not uses_processors(params)
            and may_stop_at(request.num_output_tokens + 1, params)
        )

    def _max_proposals(self, request: Request) -> int:
        """k, capped so that the kept tokens never pass max_tokens or max_model_len (a step keeps at most
        proposals + 1 tokens, so the KV the request may need is what add_request already checked)."""
        k = self.config.num_speculative_tokens
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None:
            k = min(k, max_tokens - request.num_output_tokens - 1)
        return min(k, self.max_model_len - request.num_tokens - 1)

    # -- verifying --------------------------------------------------------------------------------------

    def sampling_rows(self, scheduled) -> list[Request]:
        """The request of each logits row the runner returns: one per sampling request, plus one per
        proposal (ModelRunner.execute returns them in this order)."""
        rows: list[Request] = []
        self._drafts = {}
        for item in scheduled:
            if not item.samples:
                continue
            rows.append(item.request)
            if item.num_spec_tokens:
                drafts = list(item.request.spec_token_ids[: item.num_spec_tokens])
                self._drafts[item.request] = drafts
                rows.extend([item.request] * len(drafts))
        return rows

    def verify(self, rows: list[tuple], sampler) -> list[tuple[Request, list, list]]:
        """Per-row (request, token id, logprobs) -> per-request (request, kept tokens, their logprobs);
        rolls back the rejected proposals' KV and rewinds seeded generators."""
        grouped = []
        index = 0
        while index < len(rows):
            request = rows[index][0]
            drafts = self._drafts.get(request, [])
            group = rows[index : index + 1 + len(drafts)]
            index += len(group)
            tokens = [token_id for _, token_id, _ in group]
            logprobs = [lp for _, _, lp in group]
            if None in tokens:  # its sampling failed: the failed row's error fails the request
                failed = tokens.index(None)
                grouped.append((request, [None], [logprobs[failed]]))
                continue
            if not drafts:
                grouped.append((request, tokens, logprobs))
                continue
            accepted = 0
            while accepted < len(drafts) and tokens[accepted] == drafts[accepted]:
                accepted += 1
            request.num_computed_tokens -= len(drafts) - accepted  # the rejected proposals' KV
            sampler.rewind(request.request_id, accepted + 1)
            self._count(request.request_id, len(drafts), accepted)
            grouped.append((request, tokens[: accepted + 1], logprobs[: accepted + 1]))
        self._drafts = {}
        return grouped

    def _count(self, request_id: str, num_drafts: int, accepted: int) -> None:
        self._num_drafts += 1
        self._num_draft_tokens += num_drafts
        self._num_accepted += accepted
        for position in range(accepted):
            self._accepted_per_pos[position] += 1
        self.fallback.record(request_id, num_drafts, accepted)

    def free(self, request_id: str) -> None:
        self.fallback.free(request_id)
        self._history.free(request_id)
        if self.draft is not None:
            self.draft.free(request_id)

    def stats(self) -> SpecDecodeStats:
        return SpecDecodeStats(
            self._num_drafts, self._num_draft_tokens, self._num_accepted, tuple(self._accepted_per_pos)
        )
