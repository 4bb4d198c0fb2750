"""Speculative decoding: proposals (n-gram lookup or a draft model) verified by the target in one pass.

Nothing here imports torch at module level except the draft-model proposer and the verification graphs
(verify_graphs.py, imported by the model runner), so the server's settings can check a
`--speculative-config` without loading the engine.
"""
