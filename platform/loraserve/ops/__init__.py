"""Operations: /health, /ready, /metrics, and graceful shutdown."""
