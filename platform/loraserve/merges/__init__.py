"""Merged adapters per request and as route variants: the field (fields.py), its checks (spec.py) and the
merge cache (service.py)."""
