"""The engine-core process: the process that owns the GPU and runs EngineCore (engine/engine_core.py).

`process.run_engine_core` is its entry point; `loop.EngineCoreLoop` its busy loop, which sends each
step's token deltas as the core returns them; `clients` its front ends and who owns which request;
`handle` what whoever starts the process keeps (CoreHandle, CoreWatch, CoreAddresses). It talks to the
front ends (engine.frontend) only through engine.messages over ZeroMQ. Imports go one way: this
package imports the engine; the engine's parts never import it (tests/test_layout.py).
"""
