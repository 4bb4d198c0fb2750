"""Structural JSON schemas for the custom resources in deploy/k8s, which Kubernetes' own schemas lack.

Each keeps the fields our manifests use, with the required keys, types and enums of the CRDs they
target (Gateway API Inference Extension v1.0.1, Gateway API v1, Prometheus Operator v1), and rejects
unknown keys in the specs so a typo or a field from another API version fails here instead of at apply.
"""

from __future__ import annotations

_NAME = {"type": "string", "minLength": 1, "maxLength": 253}
_PORT = {"type": "integer", "minimum": 1, "maximum": 65535}
_LABELS = {"type": "object", "additionalProperties": {"type": "string", "maxLength": 63}}


def _resource(api_version: str, kind: str, spec: dict) -> dict:
    return {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": api_version},
            "kind": {"const": kind},
            "metadata": {"type": "object", "required": ["name"]},
            "spec": spec,
        },
    }


def _closed(required: list[str], properties: dict) -> dict:
    return {"type": "object", "required": required, "properties": properties, "additionalProperties": False}


INFERENCE_POOL = _resource(
    "inference.networking.k8s.io/v1",
    "InferencePool",
    _closed(
        ["selector", "targetPorts", "endpointPickerRef"],
        {
            "selector": _closed(["matchLabels"], {"matchLabels": {**_LABELS, "minProperties": 1}}),
            "targetPorts": {
                "type": "array",
                "minItems": 1,
                "maxItems": 8,
                "items": _closed(["number"], {"number": _PORT}),
            },
            "appProtocol": {"enum": ["http", "kubernetes.io/h2c"]},
            "endpointPickerRef": _closed(
                ["name"],
                {
                    "group": {"type": "string"},
                    "kind": {"type": "string"},
                    "name": _NAME,
                    "port": _closed(["number"], {"number": _PORT}),
                    "failureMode": {"enum": ["FailOpen", "FailClose"]},
                },
            ),
        },
    ),
)

INFERENCE_OBJECTIVE = _resource(
    "inference.networking.x-k8s.io/v1alpha2",
    "InferenceObjective",
    _closed(
        ["poolRef"],
        {
            "priority": {"type": "integer"},
            "poolRef": _closed(
                ["name"], {"group": {"type": "string"}, "kind": {"type": "string"}, "name": _NAME}
            ),
        },
    ),
)

_PARENT_REF = _closed(
    ["name"], {"group": {"type": "string"}, "kind": {"type": "string"}, "name": _NAME, "namespace": _NAME}
)
_BACKEND_REF = _closed(
    ["name"],
    {
        "group": {"type": "string"},
        "kind": {"type": "string"},
        "name": _NAME,
        "port": _PORT,
        "weight": {"type": "integer", "minimum": 0},
    },
)

HTTP_ROUTE = _resource(
    "gateway.networking.k8s.io/v1",
    "HTTPRoute",
    _closed(
        ["parentRefs", "rules"],
        {
            "parentRefs": {"type": "array", "minItems": 1, "items": _PARENT_REF},
            "hostnames": {"type": "array", "items": {"type": "string"}},
            "rules": {
                "type": "array",
                "minItems": 1,
                "items": _closed(
                    ["backendRefs"],
                    {
                        "matches": {
                            "type": "array",
                            "items": {
                                "type": "object",
                                "properties": {
                                    "path": _closed(
                                        ["type", "value"],
                                        {
                                            "type": {"enum": ["Exact", "PathPrefix", "RegularExpression"]},
                                            "value": {"type": "string", "pattern": "^/"},
                                        },
                                    )
                                },
                            },
                        },
                        "backendRefs": {"type": "array", "minItems": 1, "items": _BACKEND_REF},
                        "timeouts": _closed(
                            [], {"request": {"type": "string", "pattern": r"^([0-9]{1,5}(h|m|s|ms)){1,4}$"}}
                        ),
                    },
                ),
            },
        },
    ),
)

GATEWAY = _resource(
    "gateway.networking.k8s.io/v1",
    "Gateway",
    _closed(
        ["gatewayClassName", "listeners"],
        {
            "gatewayClassName": _NAME,
            "listeners": {
                "type": "array",
                "minItems": 1,
                "items": _closed(
                    ["name", "protocol", "port"],
                    {
                        "name": _NAME,
                        "protocol": {"type": "string"},
                        "port": _PORT,
                        "hostname": {"type": "string"},
                    },
                ),
            },
        },
    ),
)

SERVICE_MONITOR = _resource(
    "monitoring.coreos.com/v1",
    "ServiceMonitor",
    _closed(
        ["selector", "endpoints"],
        {
            "selector": _closed(["matchLabels"], {"matchLabels": _LABELS}),
            "endpoints": {
                "type": "array",
                "minItems": 1,
                "items": _closed(
                    ["port"],
                    {
                        "port": {"type": "string"},
                        "path": {"type": "string", "pattern": "^/"},
                        "interval": {"type": "string", "pattern": r"^([0-9]+(ms|s|m|h))+$"},
                    },
                ),
            },
        },
    ),
)

# Keyed by (apiVersion, kind) as the rendered objects carry them.
CUSTOM_SCHEMAS = {
    (s["properties"]["apiVersion"]["const"], s["properties"]["kind"]["const"]): s
    for s in (INFERENCE_POOL, INFERENCE_OBJECTIVE, HTTP_ROUTE, GATEWAY, SERVICE_MONITOR)
}
