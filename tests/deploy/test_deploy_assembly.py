"""The Kubernetes pieces fit together: references resolve, selectors select, ports and timings agree."""

from __future__ import annotations

import shlex

import pytest
import yaml
from deploy_files import K8S, KUSTOMIZATIONS, container, dockerfile_stages, find, instructions, one, render


@pytest.fixture(scope="module")
def gateway_stack():
    """The largest rendering: the gpu overlay over the base, plus the inference extension."""
    return render("inference-gateway")


def selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(key) == value for key, value in selector.items())


def pod_labels(deployment: dict) -> dict:
    return deployment["spec"]["template"]["metadata"]["labels"]


def env_of(objects: list[dict]) -> dict:
    return one(objects, "ConfigMap", "loraserve-config")["data"]


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_listed_files_exist_and_patches_hit_objects(kustomization):
    folder = K8S / kustomization
    spec = yaml.safe_load((folder / "kustomization.yaml").read_text())
    for entry in spec.get("resources", []):
        assert (folder / entry).exists(), f"{kustomization}: resource {entry} does not exist"
    for patch in spec.get("patches", []):
        target = yaml.safe_load((folder / patch["path"]).read_text())
        bases = [
            obj
            for entry in spec["resources"]
            if (folder / entry).is_dir()
            for obj in render(f"{kustomization}/{entry}")
        ]
        matches = find(bases, target["kind"], target["metadata"]["name"])
        assert matches, f"{kustomization}: patch {patch['path']} targets no {target['kind']}"
        for patched in target.get("spec", {}).get("template", {}).get("spec", {}).get("containers", []):
            # A strategic-merge patch with an unknown container name adds a second, image-less container.
            names = [c["name"] for c in matches[0]["spec"]["template"]["spec"]["containers"]]
            assert patched["name"] in names, f"{patch['path']} patches container {patched['name']!r}"


def test_selectors_match_the_pods(gateway_stack):
    deployment = one(gateway_stack, "Deployment", "loraserve")
    labels = pod_labels(deployment)
    assert selects(deployment["spec"]["selector"]["matchLabels"], labels)
    assert selects(one(gateway_stack, "Service", "loraserve")["spec"]["selector"], labels)
    assert selects(one(gateway_stack, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"], labels)
    assert selects(one(gateway_stack, "InferencePool")["spec"]["selector"]["matchLabels"], labels)
    epp = one(gateway_stack, "Deployment", "loraserve-epp")
    assert selects(one(gateway_stack, "Service", "loraserve-epp")["spec"]["selector"], pod_labels(epp))
    # The EPP must not count itself as a model server.
    assert not selects(
        one(gateway_stack, "InferencePool")["spec"]["selector"]["matchLabels"], pod_labels(epp)
    )
    monitor = one(render("monitoring"), "ServiceMonitor")
    scraped = [
        s
        for s in find(gateway_stack, "Service")
        if selects(monitor["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])
    ]
    assert [s["metadata"]["name"] for s in scraped] == ["loraserve-metrics"]
    assert selects(scraped[0]["spec"]["selector"], labels)
    assert monitor["spec"]["endpoints"][0]["port"] in [p["name"] for p in scraped[0]["spec"]["ports"]]
    policy = one(gateway_stack, "NetworkPolicy", "loraserve")
    assert selects(policy["spec"]["podSelector"]["matchLabels"], labels)


def test_probes_and_ports_agree_with_the_server_settings(gateway_stack):
    deployment = one(gateway_stack, "Deployment", "loraserve")
    server = container(deployment, "loraserve")
    http, metrics = (next(p for p in server["ports"] if p["name"] == name) for name in ("http", "metrics"))
    assert len(server["ports"]) == 2
    assert int(env_of(gateway_stack)["LORASERVE_PORT"]) == http["containerPort"]
    assert env_of(gateway_stack)["LORASERVE_HOST"] == "0.0.0.0", "a pod must listen beyond loopback"
    assert server["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert server["startupProbe"]["httpGet"]["path"] == "/ready"
    assert server["livenessProbe"]["httpGet"]["path"] == "/health"
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert server[probe]["httpGet"]["port"] in (http["name"], http["containerPort"])
    (service_port,) = one(gateway_stack, "Service", "loraserve")["spec"]["ports"]  # tenants: the API only
    assert service_port["targetPort"] in (http["name"], http["containerPort"])
    assert one(gateway_stack, "InferencePool")["spec"]["targetPorts"] == [{"number": http["containerPort"]}]


def test_metrics_are_scraped_on_their_own_port_only(gateway_stack):
    """/metrics names tenants: the server serves it on LORASERVE_METRICS_PORT, which every scraper uses
    and which the tenants' Service and the gateway's pool never route to."""
    server = container(one(gateway_stack, "Deployment", "loraserve"), "loraserve")
    metrics = next(p for p in server["ports"] if p["name"] == "metrics")
    assert int(env_of(gateway_stack)["LORASERVE_METRICS_PORT"]) == metrics["containerPort"]
    pod_annotations = one(gateway_stack, "Deployment", "loraserve")["spec"]["template"]["metadata"][
        "annotations"
    ]
    assert int(pod_annotations["prometheus.io/port"]) == metrics["containerPort"]
    epp = container(one(gateway_stack, "Deployment", "loraserve-epp"), "epp")
    assert f"--model-server-metrics-port={metrics['containerPort']}" in epp["args"]
    (scrape_port,) = one(gateway_stack, "Service", "loraserve-metrics")["spec"]["ports"]
    assert scrape_port["targetPort"] in (metrics["name"], metrics["containerPort"])
    for port in one(gateway_stack, "Service", "loraserve")["spec"]["ports"]:
        assert port["targetPort"] not in (metrics["name"], metrics["containerPort"])
    policy = one(gateway_stack, "NetworkPolicy", "loraserve")["spec"]["ingress"]
    open_rules = [rule for rule in policy if not rule.get("from")]
    assert all(p["port"] != metrics["name"] for rule in open_rules for p in rule["ports"])


def test_grace_period_covers_the_prestop_sleep_and_the_drain(gateway_stack):
    deployment = one(gateway_stack, "Deployment", "loraserve")
    command = container(deployment, "loraserve")["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    drain = float(env_of(gateway_stack)["LORASERVE_SHUTDOWN_TIMEOUT"])
    grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > float(command[1]) + drain


def test_env_secret_and_volume_references_resolve(gateway_stack):
    names = {(o["kind"], o["metadata"]["name"]) for o in gateway_stack}
    deployment = one(gateway_stack, "Deployment", "loraserve")
    server = container(deployment, "loraserve")
    for source in server["envFrom"]:
        kind, ref = (
            ("ConfigMap", source["configMapRef"])
            if "configMapRef" in source
            else ("Secret", source["secretRef"])
        )
        assert (kind, ref["name"]) in names, f"envFrom names a missing {kind} {ref['name']}"
    for var in server.get("env", []):
        ref = var.get("valueFrom", {}).get("secretKeyRef")
        if ref is not None:
            assert ref.get("optional") or ("Secret", ref["name"]) in names
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    for mount in server["volumeMounts"]:
        assert mount["name"] in volumes, f"mount {mount['name']} has no volume"
    # LORASERVE_API_KEYS points at a key of the mounted Secret.
    keys_path = env_of(gateway_stack)["LORASERVE_API_KEYS"]
    mount = next(m for m in server["volumeMounts"] if keys_path.startswith(m["mountPath"] + "/"))
    secret = one(gateway_stack, "Secret", volumes[mount["name"]]["secret"]["secretName"])
    assert keys_path.removeprefix(mount["mountPath"] + "/") in secret["stringData"]


def test_api_keys_placeholder_is_a_valid_keys_file(tmp_path):
    """The Secret's file has the server's format, so replacing the placeholder key is the only edit."""
    from loraserve.tenancy.keys import load_api_keys

    secret = one(render("base"), "Secret", "loraserve-api-keys")
    path = tmp_path / "api-keys.yaml"
    path.write_text(secret["stringData"]["api-keys.yaml"])
    (key,) = load_api_keys(path)
    assert key.role == "admin"


def test_hpa_scales_the_deployment_on_the_adapter_served_metric(gateway_stack):
    hpa = one(gateway_stack, "HorizontalPodAutoscaler")
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", "loraserve")
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods"
    name = metric["pods"]["metric"]["name"]
    values = yaml.safe_load((K8S / "monitoring" / "prometheus-adapter-values.yaml").read_text())
    exposed = {rule["name"]["as"]: rule for rule in values["rules"]["custom"]}
    assert name in exposed, f"prometheus-adapter exposes {sorted(exposed)}, the HPA asks for {name}"
    rule = exposed[name]
    assert rule["seriesQuery"].startswith(name + "{"), "the rule must read the server's series of that name"
    assert set(rule["resources"]["overrides"]) == {"namespace", "pod"}, "a Pods metric needs pod mapping"
    assert "replicas" not in one(gateway_stack, "Deployment", "loraserve")["spec"], "the HPA owns replicas"


def test_gpu_overlay_asks_for_one_gpu_on_gpu_nodes():
    deployment = one(render("gpu"), "Deployment", "loraserve")
    pod = deployment["spec"]["template"]["spec"]
    resources = container(deployment, "loraserve")["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == 1
    assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])
    assert pod["nodeSelector"]
    assert env_of(render("gpu"))["LORASERVE_DEVICE"] == "cuda"
    assert "nvidia.com/gpu" not in str(one(render("base"), "Deployment", "loraserve"))


def test_inference_extension_references_resolve(gateway_stack):
    pool = one(gateway_stack, "InferencePool")
    picker = pool["spec"]["endpointPickerRef"]
    epp_service = one(gateway_stack, "Service", picker["name"])
    assert picker["port"]["number"] in [p["port"] for p in epp_service["spec"]["ports"]]
    route = one(gateway_stack, "HTTPRoute")
    (parent,) = route["spec"]["parentRefs"]
    one(gateway_stack, "Gateway", parent["name"])
    backends = [b for rule in route["spec"]["rules"] for b in rule["backendRefs"]]
    assert backends == [
        {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": pool["metadata"]["name"]}
    ]
    objective = one(gateway_stack, "InferenceObjective")
    assert objective["spec"]["poolRef"]["name"] == pool["metadata"]["name"]
    epp = container(one(gateway_stack, "Deployment", "loraserve-epp"), "epp")
    assert f"--pool-name={pool['metadata']['name']}" in epp["args"]
    assert int(picker["port"]["number"]) in [p["containerPort"] for p in epp["ports"]]


def test_endpoint_picker_scores_lora_affinity(gateway_stack):
    epp = one(gateway_stack, "Deployment", "loraserve-epp")
    config_arg = next(a for a in container(epp, "epp")["args"] if a.startswith("--config-file="))
    mount = container(epp, "epp")["volumeMounts"][0]
    filename = config_arg.split("=", 1)[1].removeprefix(mount["mountPath"] + "/")
    config_map = one(gateway_stack, "ConfigMap", "loraserve-epp-config")
    config = yaml.safe_load(config_map["data"][filename])
    declared = {plugin["type"] for plugin in config["plugins"]}
    assert "lora-affinity-scorer" in declared
    for profile in config["schedulingProfiles"]:
        for ref in profile["plugins"]:
            assert ref["pluginRef"] in declared, (
                f"profile {profile['name']} uses undeclared {ref['pluginRef']}"
            )
    role = one(gateway_stack, "Role", "loraserve-epp")
    readable = {
        (group, res) for rule in role["rules"] for group in rule["apiGroups"] for res in rule["resources"]
    }
    assert {("", "pods"), ("inference.networking.k8s.io", "inferencepools")} <= readable


def test_pod_user_matches_the_image_user(gateway_stack):
    runtime = dockerfile_stages()[-1]
    uid = next(v.split("=", 1)[1] for v in instructions(runtime, "ARG") if v.startswith("UID="))
    (user,) = instructions(runtime, "USER")
    assert shlex.split(user)[0] == "${UID}:${UID}"
    context = one(gateway_stack, "Deployment", "loraserve")["spec"]["template"]["spec"]["securityContext"]
    assert str(context["runAsUser"]) == uid and context["runAsNonRoot"] is True
