"""The placement loop (`loraserve placement`): which replicas keep which hot adapters pinned on the GPU.

views.py: what a replica's metrics listener says; plan.py: demand and the plan (pure); loop.py: the
rounds and the calls to the residency endpoints; command.py: the command line. Optional: the gateway's
scorers route well without it; it pre-loads hot adapters before their requests arrive and keeps the
long tail from evicting them (docs/OPERATIONS.md, "Placement").
"""
