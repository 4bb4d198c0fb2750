"""Model resolution: what a request's `model` means for its tenant, and `GET /v1/models`."""

from loraserve.resolution.models_list import ModelCard, ModelList, list_models, retrieve_model
from loraserve.resolution.resolve import resolve_model
from loraserve.resolution.resolved import ModelKind, ModelNotFound, ResolvedModel

__all__ = [
    "ModelCard",
    "ModelKind",
    "ModelList",
    "ModelNotFound",
    "ResolvedModel",
    "list_models",
    "resolve_model",
    "retrieve_model",
]
