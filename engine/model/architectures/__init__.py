"""One file per architecture, each a `DecoderModel` subclass (engine/model/layers/decoder.py) naming the
`architectures` and `model_types` it serves; engine/model/registry.py finds them here by itself.
Adding one: docs/MODELS.md, "Adding an architecture"."""
