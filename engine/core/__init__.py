"""The engine core's parts, beside engine/engine_core.py (EngineCore) and under it.

`request_checks` (what a request must pass before it is queued), `live_requests` (the unfinished
requests and every way one ends), `step_outputs` (sampling and each step's token deltas),
`engine_metrics` (the counters behind EngineStats) and `steady` (where the core process's loop runs,
its threads and garbage collector; read by the adapter loaders and front ends too). Nothing here imports
the process that runs the core (engine/core_process/) nor the front end (engine/frontend/).
"""
