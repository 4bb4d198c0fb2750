"""The engine core: the process that owns the GPU (scheduler, KV cache, adapter residency, model runner).

`process.run_engine_core` is the process's entry point; `loop.EngineCoreLoop` its busy loop. It talks
to the front end (engine.frontend) only through engine.messages over ZeroMQ.

The loop drives engine.llm_engine.LLMEngine (which the offline API runs in the caller's process too);
the engine's parts live here beside it: `request_checks` (what a request must pass before it is
queued), `live_requests` (the unfinished requests and every way one ends), `step_outputs` (sampling
and the assembly of a step's outputs) and `engine_metrics` (the counters behind EngineStats).
"""
