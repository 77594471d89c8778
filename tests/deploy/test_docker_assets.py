"""Fast static checks of the deployment assets in docker/ (no daemon, no image build).

The end-to-end run (image build, `docker compose up`, requests, Prometheus) is docker/test_compose.sh.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess

import pytest
import yaml

from trtllm_backend.priority import PRIORITY_MAX, PRIORITY_MIN

from tests import ROOT

DOCKER = ROOT / "docker"
DASHBOARD = DOCKER / "grafana" / "dashboards" / "morphserve.json"
METRICS_SRC = ROOT / "trtllm_backend" / "triton" / "metrics.py"

PRIORITY_LABELS = {str(p) for p in range(PRIORITY_MIN, PRIORITY_MAX + 1)}
# The fixed metric contract (used when the glue's source is absent): name -> allowed label values.
EXPORTED = {
    "morphserve_requests": {"state": {"active", "waiting", "scheduled"}},
    "morphserve_kv_cache_blocks": {"type": {"max", "used", "free"}},
    "morphserve_kv_cache_usage_ratio": {},
    "morphserve_int4_layers": {},
    "morphserve_lm_head_int8": {},
    "morphserve_kv_capacity_blocks": {},
    "morphserve_memory_bytes": {"type": {"budget", "used"}},
    "morphserve_preemptions_total": {},
    "morphserve_prompt_tokens_total": {},
    "morphserve_generation_tokens_total": {},
    "morphserve_requests_total": {"status": {"success", "error", "cancelled"}},
    "morphserve_layer_swaps_total": {"direction": {"down", "up"}},
    "morphserve_kv_resizes_total": {"direction": {"grow", "shrink"}},
    "morphserve_swap_failures_total": {},
    "morphserve_restores_called_off_total": {},
    "morphserve_invariant_violations_total": {},
    "morphserve_prefix_cache_blocks_total": {"result": {"hit", "miss"}},
    "morphserve_prefix_cache_reused_tokens_total": {},
    "morphserve_prefix_cache_evictions_total": {},
    "morphserve_prefix_cache_evicted_miss_blocks_total": {},
    "morphserve_prefix_cache_hit_rate": {},
    "morphserve_requests_waiting_by_priority": {"priority": PRIORITY_LABELS},
}
HISTOGRAMS = {
    "morphserve_time_to_first_token_seconds",
    "morphserve_time_per_output_token_seconds",
    "morphserve_e2e_request_latency_seconds",
    "morphserve_request_queue_time_seconds",
    "morphserve_swap_prepare_seconds",
    "morphserve_swap_apply_seconds",
    "morphserve_priority_time_to_first_token_seconds",
    "morphserve_priority_request_queue_time_seconds",
}
NAME_RE = re.compile(r"\bmorphserve_[a-z0-9_]+")


def exported_names() -> set[str]:
    """Names the server declares, parsed from the Triton glue's metric table (the source of truth)."""
    names = set(re.findall(r"""["'](morphserve_[a-z0-9_]+)["']""", METRICS_SRC.read_text()))
    assert names, f"{METRICS_SRC} declares no morphserve_ metric"
    return names


def test_the_fixed_contract_matches_the_server():
    """EXPORTED/HISTOGRAMS (the label values the dashboard and deploy/ rules may use) are the server's names."""
    assert exported_names() == set(EXPORTED) | HISTOGRAMS


def dashboard_exprs() -> list[tuple[str, str]]:
    dash = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in dash["panels"] for t in p.get("targets", [])]


def test_every_dashboard_query_names_an_exported_metric():
    names = exported_names()
    exprs = dashboard_exprs()
    assert len(exprs) >= 15
    for title, expr in exprs:
        used = NAME_RE.findall(expr)
        assert used, f"panel {title!r}: query names no morphserve_ metric: {expr}"
        for name in used:
            base = re.sub(r"_(bucket|sum|count)$", "", name)
            if base != name:  # a histogram series: its family must be a histogram we export
                assert base in names and base in HISTOGRAMS, f"panel {title!r}: {name} is not a histogram series"
            else:
                assert name in names, f"panel {title!r}: {name} is not exported by the server"
                assert name not in HISTOGRAMS, f"panel {title!r}: query the _bucket series of {name}"


def test_dashboard_label_values_and_counter_use():
    for title, expr in dashboard_exprs():
        for name, labels in re.findall(r"(morphserve_[a-z0-9_]+)\{([^}]*)\}", expr):
            for key, value in re.findall(r'(\w+)="([^"]*)"', labels):
                allowed = EXPORTED.get(name, {}).get(key)
                assert allowed and value in allowed, f"panel {title!r}: {name}{{{key}={value!r}}} is never exported"
        for name in NAME_RE.findall(expr):  # counters only make sense as rates/increases
            if name.endswith(("_total", "_bucket")):
                assert re.search(r"(rate|increase)\(\s*" + name, expr), f"panel {title!r}: raw counter {name}"


def test_dashboard_layout_and_datasource():
    dash = json.loads(DASHBOARD.read_text())
    ds = yaml.safe_load((DOCKER / "grafana/provisioning/datasources/prometheus.yaml").read_text())["datasources"][0]
    ids, cells = set(), set()
    for p in dash["panels"]:
        assert p["id"] not in ids
        ids.add(p["id"])
        assert p["datasource"]["uid"] == ds["uid"]
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not (cells & mine), f"panel {p['title']!r} overlaps another"
        cells |= mine
    titles = " ".join(p["title"].lower() for p in dash["panels"])
    for topic in (
        "request rate",
        "waiting",
        "time to first token",
        "time per output token",
        "kv cache blocks",
        "int4 layers",
        "swaps",
        "resizes",
    ):
        assert topic in titles, f"the dashboard lacks a {topic!r} panel"


def compose() -> dict:
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())


def test_compose_services_and_profiles():
    svc = compose()["services"]
    assert "profiles" not in svc["triton"], "the CPU server must start with a plain `docker compose up`"
    assert svc["triton-gpu"]["profiles"] == ["gpu"]
    assert svc["triton-gpu"]["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    assert svc["prometheus"]["profiles"] == svc["grafana"]["profiles"] == ["monitoring"]
    assert svc["replica-1"]["profiles"] == svc["replica-2"]["profiles"] == svc["lb"]["profiles"] == ["replicas"]
    for name, s in svc.items():
        assert s["network_mode"] == "host", name
    text = (DOCKER / "compose.yaml").read_text()
    for var in (
        "MORPHSERVE_HTTP_PORT",
        "MORPHSERVE_GRPC_PORT",
        "MORPHSERVE_METRICS_PORT",
        "MORPHSERVE_POLICY",
        "MORPHSERVE_MEMORY_BUDGET_BYTES",
        "PROMETHEUS_PORT",
        "GRAFANA_PORT",
    ):
        assert "${" + var + ":-" in text, f"{var} needs a default"
    for mount in svc["prometheus"]["volumes"] + svc["grafana"]["volumes"]:
        assert (DOCKER / mount.split(":")[0]).exists(), mount


def compose_params(service: str, env: dict[str, str] | None = None) -> dict[str, str]:
    """The --param NAME=VALUE flags compose passes, with ${VAR:-default} resolved like compose does."""
    env = env or {}
    sub = lambda m: env.get(m.group(1)) or m.group(2)  # noqa: E731 -- ':-' also replaces empty values
    args = [re.sub(r"\$\{(\w+):-([^}]*)\}", sub, str(a)) for a in compose()["services"][service]["command"]]
    return dict(args[i + 1].split("=", 1) for i, a in enumerate(args) if a == "--param")


@pytest.mark.parametrize("policy", ["balanced", "accuracy", "performance", "full", "int4", "int4:8"])
def test_compose_parameters_are_valid_server_parameters(policy):
    """What compose passes must load: the launcher rejects unknown names and bad values before Triton starts."""
    from trtllm_backend.triton import params as triton_params

    for service in ("triton", "triton-gpu"):
        params = compose_params(service, {"MORPHSERVE_POLICY": policy})
        assert params["morph_policy"] == policy
        triton_params.parse_params(params)  # raises ParamError naming the parameter
    assert compose_params("triton-gpu")["device"] == "cuda"
    for value in ("", "4000000000"):  # empty = the server's automatic budget
        triton_params.parse_params(compose_params("triton", {"MORPHSERVE_MEMORY_BUDGET_BYTES": value}))
    for replica in ("replica-1", "replica-2"):
        for threads in ("", "1"):
            params = replica_params(replica, {"MORPHSERVE_POLICY": policy, "MORPHSERVE_NUM_THREADS": threads})
            assert params["morph_policy"] == policy and params["num_threads"] == threads
            triton_params.parse_params(params)


def resolve(value, env: dict[str, str] | None = None) -> str:
    """${VAR:-default} as compose resolves it (':-' also replaces an empty value)."""
    env = env or {}
    return re.sub(r"\$\{(\w+):-([^}]*)\}", lambda m: env.get(m.group(1)) or m.group(2), str(value))


def replica_params(service: str, env: dict[str, str]) -> dict[str, str]:
    """A replica's --param flags: its shell command expanded with the container environment compose gives it."""
    svc = compose()["services"][service]
    container_env = {k: resolve(v, env) for k, v in svc["environment"].items()}
    (cmd,) = svc["command"]
    assert svc["entrypoint"] == ["/bin/sh", "-c"] and cmd.startswith("exec python3 -m trtllm_backend.serve ")
    # `$$` is compose's escape for a literal `$`: the shell expands these from the container's environment.
    expanded = re.sub(r"\$\$(\w+)", lambda m: container_env[m.group(1)], cmd)
    args = [a or b for a, b in re.findall(r'"([^"]*)"|(\S+)', expanded)]
    return dict(args[i + 1].split("=", 1) for i, a in enumerate(args) if a == "--param")


def test_replicas_have_their_own_ports_and_the_balancer_knows_them():
    svc = compose()["services"]
    ports = [
        tuple(resolve(svc[r]["environment"][f"MORPHSERVE_{k}_PORT"]) for k in ("HTTP", "GRPC", "METRICS"))
        for r in ("replica-1", "replica-2")
    ]
    assert len({p for trio in ports for p in trio}) == 6, f"two replicas share a port: {ports}"
    lb = {k: resolve(v) for k, v in svc["lb"]["environment"].items()}
    assert (lb["REPLICA1_HTTP_PORT"], lb["REPLICA1_GRPC_PORT"]) == ports[0][:2]
    assert (lb["REPLICA2_HTTP_PORT"], lb["REPLICA2_GRPC_PORT"]) == ports[1][:2]
    assert (lb["LB_HTTP_PORT"], lb["LB_GRPC_PORT"]) == ("8000", "8001"), "clients keep the usual ports"
    assert set(svc["lb"]["depends_on"]) == {"replica-1", "replica-2"}


def test_haproxy_config():
    """Least-request balancing and /v2/health/ready checks on every server of both backends; `haproxy -c`
    accepts it where HAProxy is installed (the balancer image runs the same file)."""
    cfg = (DOCKER / "lb" / "haproxy.cfg").read_text()
    blocks = {m.group(1): m.group(2) for m in re.finditer(r"^backend (\S+)\n(.*?)(?=^\S|\Z)", cfg, re.M | re.S)}
    assert set(blocks) == {"triton_http", "triton_grpc"}, blocks
    for name, block in blocks.items():
        assert "balance leastconn" in block and "option httpchk GET /v2/health/ready" in block, name
        servers = re.findall(r"^\s+server (\S+) (.*)$", block, re.M)
        assert [s for s, _ in servers] == ["replica-1", "replica-2"], name
        assert all(" check" in rest for _, rest in servers) or "default-server check" in block, name
    for _, rest in re.findall(r"^\s+server (\S+) (.*)$", blocks["triton_grpc"], re.M):
        assert "proto h2" in rest and "check-proto h1" in rest, "gRPC needs HTTP/2 to the server, HTTP/1.1 checks"
    assert re.search(r"^frontend grpc\n\s+bind \S+ proto h2$", cfg, re.M), "the gRPC frontend must speak h2"
    haproxy = shutil.which("haproxy")
    if haproxy:
        env = dict(
            os.environ,
            LB_BIND_ADDR="127.0.0.1",
            LB_HTTP_PORT="18000",
            LB_GRPC_PORT="18001",
            LB_ADMIN_PORT="18404",
            REPLICA1_HTTP_PORT="18100",
            REPLICA1_GRPC_PORT="18101",
            REPLICA2_HTTP_PORT="18200",
            REPLICA2_GRPC_PORT="18201",
        )
        r = subprocess.run(
            [haproxy, "-c", "-f", str(DOCKER / "lb" / "haproxy.cfg")], env=env, capture_output=True, text=True
        )
        assert r.returncode == 0, r.stdout + r.stderr


def compose_cli() -> list[str] | None:
    """docker compose v2: the CLI plugin test_compose.sh installs, a system one, or a v2 docker-compose."""
    for cfg in (ROOT / "build/docker/config", None):
        env = dict(os.environ, **({"DOCKER_CONFIG": str(cfg)} if cfg else {}))
        if (
            shutil.which("docker")
            and subprocess.run(["docker", "compose", "version"], env=env, capture_output=True).returncode == 0
        ):
            return ["env", f"DOCKER_CONFIG={cfg}", "docker", "compose"] if cfg else ["docker", "compose"]
    exe = shutil.which("docker-compose")
    if exe and b"v2." in subprocess.run([exe, "version"], capture_output=True).stdout:
        return [exe]
    return None


@pytest.mark.parametrize("profiles", [[], ["monitoring"], ["gpu"], ["monitoring", "gpu"], ["replicas"]])
def test_compose_config_is_valid(profiles):
    cli = compose_cli()
    if cli is None:
        pytest.skip("no compose v2 here (docker/test_compose.sh installs one and runs the same check)")
    args = [a for p in profiles for a in ("--profile", p)]
    r = subprocess.run(
        [*cli, "-f", str(DOCKER / "compose.yaml"), *args, "config", "--services"], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    expect = (
        {"triton"}
        | ({"prometheus", "grafana"} if "monitoring" in profiles else set())
        | ({"triton-gpu"} if "gpu" in profiles else set())
        | ({"replica-1", "replica-2", "lb"} if "replicas" in profiles else set())
    )
    assert set(r.stdout.split()) == expect


def test_fragments_override_mounts_read_only():
    services = yaml.safe_load((DOCKER / "compose.fragments.yaml").read_text())["services"]
    assert set(services) == {"triton", "replica-1", "replica-2"}
    for svc in services.values():
        (mount,) = svc["volumes"]
        assert mount.startswith("${MORPHSERVE_FRAGMENTS_DIR:?")
        assert mount.endswith(":/opt/morphserve/model_repository/smollm2/1/fragments:ro")


def test_prometheus_config():
    cfg = yaml.safe_load((DOCKER / "prometheus.yml").read_text())
    targets = [t for job in cfg["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]]
    assert "localhost:8002" in targets  # compose.yaml rewrites exactly this string for another port
    # The replicas' metrics ports, at compose's defaults (compose rewrites these strings too).
    svc = compose()["services"]
    for replica in ("replica-1", "replica-2"):
        port = resolve(svc[replica]["environment"]["MORPHSERVE_METRICS_PORT"])
        assert f"localhost:{port}" in targets, replica
        assert f"s/localhost:{port}/" in " ".join(svc["prometheus"]["command"]), f"compose does not rewrite {port}"
    promtool = shutil.which("promtool")
    if promtool:
        r = subprocess.run(
            [promtool, "check", "config", str(DOCKER / "prometheus.yml")], capture_output=True, text=True
        )
        assert r.returncode == 0, r.stdout + r.stderr


def test_dockerfiles():
    cpu = (DOCKER / "Dockerfile").read_text()
    assert "ARG BASE_IMAGE=python:3.11-slim-bookworm" in cpu
    assert "/v2/health/ready" in cpu and "HEALTHCHECK" in cpu
    assert re.search(r"^USER (?!root|0)", cpu, re.M), "the server must not run as root"
    exposed = re.findall(r"^EXPOSE (.+)$", cpu, re.M)
    assert exposed == ["8000 8001 8002"], exposed
    assert "trtllm_backend.serve" in cpu
    gpu = (DOCKER / "Dockerfile.gpu").read_text()
    assert "UNTESTED" in gpu and "trtllm_backend.serve" in gpu


def test_dockerignore_keeps_the_context_small():
    rules = [r for r in (ROOT / ".dockerignore").read_text().splitlines() if r.strip() and not r.startswith("#")]
    assert rules[0] == "*", "allow-list style: start from nothing"
    # Generated model artifacts (git-ignored) stay out too: the image builds or mounts its own.
    for line in (ROOT / ".gitignore").read_text().splitlines():
        if line.startswith("model_repository/"):
            assert line.rstrip("/") in rules, f".dockerignore lacks {line}"
    assert not any(r.startswith("!.venv") or r.startswith("!build") for r in rules)
