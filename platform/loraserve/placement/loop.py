"""The placement loop: every `interval` seconds, read every replica, plan, pin and unpin.

A round: scrape each replica's metrics listener (`/metrics` and `GET /v1/residency`, bounded by
`timeout_s`), update the demand, plan (plan.py) and call the operator's residency endpoints: `unpin`
(with `unload`, if asked, to free the cold adapter's slot and CPU row at once) and `preload` with
`pin`. A replica that does not answer is left out of that round (its pins stay as they are; the other
replicas are planned without it). Nothing here is needed to serve: with the loop stopped, adapters keep
their last pins and the engines' LRU does the rest.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from loraserve.placement.plan import Action, Demand, actions, plan
from loraserve.placement.views import ReplicaView, parse_view

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PlacementSettings:
    copies: int = 2  # k: replicas each hot adapter is pinned on
    budget: int = 4  # adapters the loop pins per replica, at most (and never beyond max_loras - 1)
    min_rate: float = 0.1  # smoothed requests per round below which an adapter is cold
    smoothing: float = 0.5  # weight of the latest round in the demand
    unload_cold: bool = False  # unpinning also frees the slot and CPU-tier row (else: LRU decides)
    timeout_s: float = 5.0  # per call to a replica

    def __post_init__(self) -> None:
        if self.copies < 1:
            raise ValueError(f"--copies must be at least 1 (got {self.copies})")
        if self.budget < 0:
            raise ValueError(f"--budget must be 0 or more (got {self.budget})")
        if self.min_rate < 0 or self.timeout_s <= 0:
            raise ValueError("--min-rate must be >= 0 and --timeout positive")


@dataclass
class Round:
    views: list[ReplicaView] = field(default_factory=list)
    unreachable: list[str] = field(default_factory=list)  # replicas left out: "url: why"
    rates: dict[str, float] = field(default_factory=dict)
    desired: dict[str, frozenset[str]] = field(default_factory=dict)
    done: list[Action] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)  # actions refused: "op name on url: why"


class PlacementLoop:
    def __init__(
        self,
        replicas: Callable[[], list[str]],
        settings: PlacementSettings,
        placement_key: str,
        metrics_key: str | None = None,
        client: httpx.Client | None = None,
    ) -> None:
        """`replicas()` gives the replicas' metrics listener URLs each round (a fixed list, or a DNS name
        of a headless Service resolved again each time)."""
        self.replicas = replicas
        self.settings = settings
        self.demand = Demand(settings.smoothing)
        self._operator = {"authorization": f"Bearer {placement_key}"}
        self._scraper = {"authorization": f"Bearer {metrics_key}"} if metrics_key else {}
        self._client = client or httpx.Client(timeout=settings.timeout_s)

    def run_once(self) -> Round:
        result = Round()
        for url in self.replicas():
            try:
                result.views.append(self._view(url))
            except (httpx.HTTPError, ValueError) as exc:
                result.unreachable.append(f"{url}: {exc}")
                log.warning("placement: %s left out of this round: %s", url, exc)
        result.rates = self.demand.update(result.views)
        s = self.settings
        result.desired = plan(result.views, result.rates, s.copies, s.budget, s.min_rate)
        for action in actions(result.views, result.desired):
            try:
                self._apply(action)
                result.done.append(action)
            except httpx.HTTPError as exc:
                result.failed.append(f"{action.op} {action.adapter_name} on {action.url}: {exc}")
                log.warning("placement: %s", result.failed[-1])
        if result.done:
            log.info("placement: %s", ", ".join(f"{a.op} {a.adapter_name} on {a.url}" for a in result.done))
        return result

    def run(self, interval_s: float, stop: threading.Event) -> None:
        """Rounds every `interval_s` seconds until `stop` is set; a round that fails is logged, not fatal."""
        while not stop.is_set():
            try:
                self.run_once()
            except Exception:
                log.exception("placement: the round failed")
            stop.wait(interval_s)

    def close(self) -> None:
        self._client.close()

    def _view(self, url: str) -> ReplicaView:
        metrics = self._client.get(f"{url}/metrics", headers=self._scraper)
        metrics.raise_for_status()
        residency = self._client.get(f"{url}/v1/residency", headers=self._operator)
        if residency.status_code == 404:
            raise ValueError("it serves no residency endpoints: start it with --placement-key")
        if residency.status_code == 401:
            raise ValueError("it refuses the placement key: give the loop the replicas' --placement-key")
        residency.raise_for_status()
        return parse_view(url, metrics.text, residency.json())

    def _apply(self, action: Action) -> None:
        if action.op == "pin":
            body = {"adapter": action.adapter_name, "level": "gpu", "pin": True}
            response = self._client.post(
                f"{action.url}/v1/residency/preload", json=body, headers=self._operator
            )
        else:
            body = {"adapter": action.adapter_name, "unload": self.settings.unload_cold}
            response = self._client.post(
                f"{action.url}/v1/residency/unpin", json=body, headers=self._operator
            )
        if response.status_code >= 400:
            raise httpx.HTTPStatusError(
                f"{response.status_code}: {_message(response)}", request=response.request, response=response
            )


def _message(response: httpx.Response) -> str:
    try:
        return response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return response.text[:200]
