"""The engine's front end, in the caller's process: the async client and the output processing.

`AsyncLLM` starts the engine core process (or joins one another process started) and streams
RequestOutput deltas; `output_processor` turns the core's token ids into text, stop strings and
logprobs and fans `n > 1` out and in (for AsyncLLM and for the in-process LLMEngine alike);
`core_client` owns the sockets and watches the core's process.
"""
