"""The engine core: the process that owns the GPU (scheduler, KV cache, adapter residency, model runner).

`process.run_engine_core` is the process's entry point; `loop.EngineCoreLoop` its busy loop. It talks
to the front end (engine.frontend) only through engine.messages over ZeroMQ.
"""
