"""The engine's front end, in the caller's (HTTP) process: the async client and the output processing.

`AsyncLLM` starts the engine core process (or joins one another process started) and streams
RequestOutput deltas; `output_processor` turns the core's token ids into text, stop strings and
logprobs; `core_client` owns the sockets and watches the core's process.
"""
