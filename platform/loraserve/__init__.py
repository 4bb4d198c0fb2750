"""loraserve: the control plane (HTTP API, tenants, routes, config, metrics, CLI)."""
