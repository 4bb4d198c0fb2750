"""`fcfs`: first come, first served in one queue, ignoring tenants (vLLM's default policy).

A head that lacks room stops admission; one kept out by `max_loras` or a loading adapter is skipped;
when KV blocks run out the newest running request is preempted. All of it is the base class's.
"""

from __future__ import annotations

from engine.scheduling_policies.base import SchedulingPolicy


class FcfsPolicy(SchedulingPolicy):
    pass
