"""Scheduling policies by name (`EngineConfig.scheduling_policy`, `--scheduling-policy`).

A policy is one small file here with a subclass of SchedulingPolicy (base.py says what it decides); the
scheduler calls it and never asks which one it is. Adding one: its file, its line below, and its name
in engine/engine_args.py's SCHEDULING_POLICIES (docs/ARCHITECTURE.md, "Where to change what").
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.scheduling_policies.base import SchedulingPolicy
from engine.scheduling_policies.fair import FairPolicy
from engine.scheduling_policies.fcfs import FcfsPolicy
from engine.scheduling_policies.priority import PriorityPolicy

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.fairness import VirtualTokenCounters

POLICIES: dict[str, type[SchedulingPolicy]] = {
    "fair": FairPolicy,
    "fcfs": FcfsPolicy,
    "priority": PriorityPolicy,
}

__all__ = ["POLICIES", "SchedulingPolicy", "make_policy"]


def make_policy(config: EngineConfig, counters: VirtualTokenCounters) -> SchedulingPolicy:
    """The policy `config.scheduling_policy` names, deciding by `counters` where it needs them."""
    try:
        policy = POLICIES[config.scheduling_policy]
    except KeyError:
        raise ValueError(
            f"scheduling_policy must be one of {', '.join(POLICIES)} (got {config.scheduling_policy!r})"
        ) from None
    return policy(config, counters)
