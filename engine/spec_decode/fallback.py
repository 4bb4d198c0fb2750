"""Per-request fallback: a request whose drafts are rarely accepted stops speculating for a while.

Verifying rejected drafts costs target compute (k extra tokens per request per step) and, with a draft
model, the draft's passes; a request whose text does not repeat itself gains nothing from them.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass
class _History:
    window: deque  # (num_draft_tokens, num_accepted) of the last verifications
    paused_steps: int = 0  # proposal opportunities left to skip


@dataclass
class AcceptanceFallback:
    """`allows(request_id)` before proposing; `record(...)` after each verification with drafts."""

    min_rate: float  # 0: never falls back
    window: int  # verifications looked at
    cooldown: int  # proposal opportunities skipped once the rate fell below min_rate
    _history: dict[str, _History] = field(default_factory=dict)
    num_fallbacks: int = 0  # cumulative, for tests and logs

    def allows(self, request_id: str) -> bool:
        """Whether the request may speculate now; each refusal counts one step of its cooldown."""
        history = self._history.get(request_id)
        if history is None or history.paused_steps == 0:
            return True
        history.paused_steps -= 1
        return False

    def record(self, request_id: str, num_draft_tokens: int, num_accepted: int) -> None:
        history = self._history.get(request_id)
        if history is None:
            history = self._history[request_id] = _History(deque(maxlen=self.window))
        history.window.append((num_draft_tokens, num_accepted))
        if self.min_rate <= 0.0 or len(history.window) < self.window:
            return
        drafted = sum(d for d, _ in history.window)
        accepted = sum(a for _, a in history.window)
        if accepted < self.min_rate * drafted:
            history.paused_steps = self.cooldown
            history.window.clear()  # after the pause, a fresh window decides again
            self.num_fallbacks += 1

    def free(self, request_id: str) -> None:
        self._history.pop(request_id, None)
