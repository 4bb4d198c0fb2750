"""Speculative decoding: proposals (n-gram lookup or a draft model) verified by the target in one pass.

Nothing here imports torch at module level except the draft-model proposer, so the server's settings can
check a `--speculative-config` without loading the engine.
"""
