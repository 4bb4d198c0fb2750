"""Every manifest under deploy/k8s renders with kustomize and validates: core kinds against Kubernetes'
own JSON schemas (kubernetes-validate, bundled, offline), custom resources against crd_schemas."""

from __future__ import annotations

import copy

import jsonschema
import kubernetes_validate
import pytest
from crd_schemas import CUSTOM_SCHEMAS
from deploy_files import KUBERNETES_VERSION, KUSTOMIZATIONS, one, render


def validate(obj: dict) -> None:
    """Raise if `obj` does not match its schema; every kind we ship must have one."""
    key = (obj["apiVersion"], obj["kind"])
    if key in CUSTOM_SCHEMAS:
        jsonschema.validate(obj, CUSTOM_SCHEMAS[key])
    else:
        # strict: unknown fields are errors, as the API server's strict field validation makes them.
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_every_object_validates(kustomization):
    objects = render(kustomization)
    assert objects, f"{kustomization} renders nothing"
    for obj in objects:
        try:
            validate(obj)
        except (jsonschema.ValidationError, kubernetes_validate.ValidationError) as exc:
            pytest.fail(f"{kustomization}: {obj['kind']}/{obj['metadata']['name']}: {exc.message}")


def test_validation_rejects_broken_objects():
    """The validators are not vacuous: a misspelt field, a wrong type and a bad enum all fail."""
    objects = render("inference-gateway")
    deployment = one(objects, "Deployment", "loraserve")
    typo = copy.deepcopy(deployment)
    typo["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGett"] = {"path": "/ready"}
    wrong_type = copy.deepcopy(one(objects, "HorizontalPodAutoscaler"))
    wrong_type["spec"]["maxReplicas"] = "eight"
    bad_enum = copy.deepcopy(one(objects, "InferencePool"))
    bad_enum["spec"]["endpointPickerRef"]["failureMode"] = "FailSometimes"
    old_field = copy.deepcopy(one(objects, "InferencePool"))
    # The pre-v1 (v1alpha2) spelling of the picker reference.
    old_field["spec"]["extensionRef"] = old_field["spec"].pop("endpointPickerRef")
    for broken in (typo, wrong_type, bad_enum, old_field):
        with pytest.raises((jsonschema.ValidationError, kubernetes_validate.ValidationError)):
            validate(broken)
