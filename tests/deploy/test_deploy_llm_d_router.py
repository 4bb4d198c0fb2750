"""deploy/k8s/llm-d-router: the residency scorer in the endpoint picker's config, KV events on every
replica, and the placement loop wired to the replicas' residency endpoints."""

from __future__ import annotations

import pytest
import yaml
from deploy_files import container, find, one, render


@pytest.fixture(scope="module")
def stack():
    return render("llm-d-router")


def env(deployment: dict, name: str) -> dict:
    return next(
        e
        for e in container(deployment, deployment["spec"]["template"]["spec"]["containers"][0]["name"])["env"]
        if e["name"] == name
    )


def test_the_picker_scores_residency(stack):
    config = yaml.safe_load(one(stack, "ConfigMap", "loraserve-epp-config")["data"]["plugins.yaml"])
    declared = {plugin["type"] for plugin in config["plugins"]}
    assert "lora-load-state-scorer" in declared and "lora-affinity-scorer" not in declared
    for profile in config["schedulingProfiles"]:
        assert {ref["pluginRef"] for ref in profile["plugins"]} <= declared
    image = container(one(stack, "Deployment", "loraserve-epp"), "epp")["image"]
    assert image.startswith("ghcr.io/llm-d/llm-d-router:")
    rules = one(stack, "Role", "loraserve-epp-llm-d")["rules"]
    assert {"llm-d.ai"} == {group for rule in rules for group in rule["apiGroups"]}


def test_replicas_publish_kv_events_on_their_declared_ports(stack):
    from engine.kv_events.config import KVEventsConfig

    server = one(stack, "Deployment", "loraserve")
    spec = container(server, "loraserve")
    names = [e["name"] for e in spec["env"]]
    raw = env(server, "LORASERVE_KV_EVENTS_CONFIG")["value"]
    # $(VAR) refers to variables defined before it: POD_IP here, LORASERVE_MODEL in the ConfigMap
    assert names.index("POD_IP") < names.index("LORASERVE_KV_EVENTS_CONFIG")
    model = one(stack, "ConfigMap", "loraserve-config")["data"]["LORASERVE_MODEL"]
    config = KVEventsConfig.parse(raw.replace("$(POD_IP)", "10.0.0.7").replace("$(LORASERVE_MODEL)", model))
    assert config.publishes and config.topic == f"kv@10.0.0.7@{model}"
    ports = {p["name"]: p["containerPort"] for p in spec["ports"]}
    assert config.endpoint == f"tcp://*:{ports['kv-events']}"
    assert config.replay_endpoint == f"tcp://*:{ports['kv-replay']}"
    policy = one(stack, "NetworkPolicy", "loraserve-routing")
    allowed = {
        (peer["podSelector"]["matchLabels"]["app.kubernetes.io/name"], port["port"])
        for rule in policy["spec"]["ingress"]
        for peer in rule["from"]
        for port in rule["ports"]
    }
    assert {("loraserve-epp", "kv-events"), ("loraserve-epp", "kv-replay")} <= allowed


def test_the_placement_loop_reaches_every_replicas_residency_endpoints(stack):
    from loraserve.cli import build_parser

    placement = one(stack, "Deployment", "loraserve-placement")
    spec = container(placement, "placement")
    assert spec["command"] == ["loraserve", "placement"]
    args = build_parser({}).parse_args(["placement", *spec["args"]])
    host, port = args.replicas_dns.rsplit(":", 1)
    metrics = one(stack, "Service", host)
    assert metrics["spec"]["clusterIP"] == "None"  # headless: its name resolves to every ready pod
    assert int(port) in [p["port"] for p in metrics["spec"]["ports"]]
    # the loop and the replicas hold the same key, from one Secret
    keys = [
        env(d, "LORASERVE_PLACEMENT_KEY")["valueFrom"]["secretKeyRef"]
        for d in (placement, one(stack, "Deployment", "loraserve"))
    ]
    assert keys[0] == keys[1]
    secret = one(stack, "Secret", keys[0]["name"])
    assert keys[0]["key"] in secret["stringData"] and len(secret["stringData"][keys[0]["key"]]) >= 16
    policy = one(stack, "NetworkPolicy", "loraserve-routing")
    assert any(
        peer["podSelector"]["matchLabels"] == placement["spec"]["template"]["metadata"]["labels"]
        and [p["port"] for p in rule["ports"]] == ["metrics"]
        for rule in policy["spec"]["ingress"]
        for peer in rule["from"]
    )
    assert find(stack, "InferencePool")  # on top of the inference-gateway overlay
