"""Every environment variable the project reads: one line each, its default and who reads it.

The one list of them. `docs/configuration.md` ("Environment variables") is its generated Markdown
(`python -m trtllm_backend.env_vars` prints it); `tests/repo/test_env_vars.py` fails when a `MORPHSERVE_*` name in
the code, scripts or Docker files is missing here or from that page, or when a name here is used nowhere.
Python readers in `trtllm_backend` take the name (and the default) from here; the kernels (`plugins/`, which
import nothing from `trtllm_backend`), the tests and the shell and Compose files spell the name out.

Standard library only: the launcher imports it before torch is loaded.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

# Who reads a variable: the engine's process (the model in Triton's Python stub, or any LLMEngine), the
# launcher (`python -m trtllm_backend.serve`), the test suite, the Docker files (compose.yaml, Dockerfiles,
# `make docker-test`), or the benchmark tools.
READERS = ("server", "launcher", "gateway", "tests", "docker", "tools")


@dataclass(frozen=True)
class EnvVar:
    name: str
    default: str  # the value when unset or empty; "" where unset means "none" (the meaning says what then)
    read_by: tuple[str, ...]
    where: str  # the file(s) that read or set it
    meaning: str

    def value(self, env: Mapping[str, str] | None = None) -> str:
        """The variable in `env` (default: this process's environment); empty or unset: the default."""
        return (os.environ if env is None else env).get(self.name) or self.default


_ALL: list[EnvVar] = []


def _var(name: str, default: str, read_by: str, where: str, meaning: str) -> EnvVar:
    readers = tuple(read_by.split())
    assert set(readers) <= set(READERS), (name, readers)
    var = EnvVar(name, default, readers, where, meaning)
    _ALL.append(var)
    return var


# --- the engine's process ----------------------------------------------------------------------------------------
CPU_KERNELS = _var(
    "MORPHSERVE_CPU_KERNELS",
    "1",
    "server tests",
    "plugins/cpu_kernels.py",
    "`0`: run on torch ops instead of the C++ kernels (the reference path)",
)
KERNELS_LIBRARY = _var(
    "MORPHSERVE_KERNELS_LIBRARY",
    "",
    "server tools",
    "plugins/cpu_kernels.py; set by tools/kernel_builds_ab.py, tools/microbench/decode_attention.py",
    "path of another build of the C++ kernels to load (A/B of builds); unset: the build under `build/`",
)
FUSED_DECODE = _var(
    "MORPHSERVE_FUSED_DECODE",
    "1",
    "server tools tests",
    "plugins/decode_layer.py (read every step); set by tools/bench_engine.py `--fused-ab`",
    "`0`: decode op by op instead of all layers in one call (for A/B)",
)
FORCE_MORPH = _var(
    "MORPHSERVE_FORCE_MORPH",
    "",
    "server tests",
    "trtllm_backend/config.py",
    "forced morph actions by iteration, e.g. `down:2@5,up:2@40` (a test hook); `EngineConfig(force_morph=...)` "
    "wins where set",
)
CONTROL_DIR = _var(
    "MORPHSERVE_CONTROL_DIR",
    "",
    "launcher server",
    "trtllm_backend/triton/shutdown.py, trtllm_backend/triton/server.py",
    "the drain handshake's folder; the launcher sets it for `tritonserver`, the model's stubs inherit it; "
    "unset (a server started by hand): no handshake",
)
OMP_WAIT_POLICY = _var(
    "OMP_WAIT_POLICY",
    "ACTIVE",
    "server launcher docker",
    "trtllm_backend/openmp_env.py, the Makefile, docker/Dockerfile",
    "how OpenMP threads wait between parallel regions; the launchers set the project's value where it is unset",
)
GOMP_SPINCOUNT = _var(
    "GOMP_SPINCOUNT",
    "200000",
    "server launcher docker",
    "trtllm_backend/openmp_env.py, the Makefile, docker/Dockerfile",
    "how long an OpenMP thread spins before it sleeps; set beside `OMP_WAIT_POLICY`",
)

# --- the launcher ------------------------------------------------------------------------------------------------
TRITON_ADDRESS = _var(
    "MORPHSERVE_TRITON_ADDRESS",
    "",
    "launcher docker",
    "trtllm_backend/serve.py",
    "default of `--address`, Triton's HTTP and gRPC bind address; unset: 127.0.0.1 when `--openai-port` "
    "fronts it with a key, else every interface",
)
ADMIN_KEY = _var(
    "MORPHSERVE_ADMIN_KEY",
    "",
    "launcher docker",
    "trtllm_backend/triton/admin.py, trtllm_backend/serve.py",
    "the key Triton's admin APIs require ([security.md](security.md)); unset: a random key per start",
)
ADMIN_KEY_FILE = _var(
    "MORPHSERVE_ADMIN_KEY_FILE",
    "",
    "launcher",
    "trtllm_backend/triton/admin.py",
    "where the launcher writes the admin key (mode 0600); unset: `admin-key.<http port>` in "
    "`$XDG_RUNTIME_DIR/morphserve` or `<tmp>/morphserve-<uid>`",
)
OPEN_ADMIN = _var(
    "MORPHSERVE_OPEN_ADMIN",
    "",
    "launcher docker",
    "trtllm_backend/triton/admin.py",
    "`1`: leave Triton's admin APIs open to anyone (`--open-admin`); unset: closed",
)

# --- the OpenAI gateway ------------------------------------------------------------------------------------------
OPENAI_GATEWAY_API_KEY = _var(
    "OPENAI_GATEWAY_API_KEY",
    "",
    "gateway launcher docker",
    "trtllm_backend/openai/__main__.py, trtllm_backend/openai/process.py, trtllm_backend/serve.py",
    "the key clients must send (default of the gateway's `--api-key`); unset: no key",
)

# --- the test suite ----------------------------------------------------------------------------------------------
TEST_FRAGMENTS = _var(
    "MORPHSERVE_TEST_FRAGMENTS",
    "",
    "tests",
    "tests/conftest.py, tests/engine_fixtures.py",
    "run the model tests on another fragment set; unset: `model_repository/smollm2/1/fragments`",
)
SOAK = _var(
    "MORPHSERVE_SOAK",
    "",
    "tests",
    "tests/triton/test_fuzz_server.py; set by `make soak`",
    "`1`: the long fuzzing run (2,400 cases) instead of a few hundred",
)
FUZZ_SEED = _var(
    "MORPHSERVE_FUZZ_SEED",
    "",
    "tests",
    "tests/triton/test_fuzz_server.py",
    "replay a fuzzing run with the seed it printed; unset: a random seed",
)

# --- Docker: docker/compose.yaml and the images ------------------------------------------------------------------
HTTP_PORT = _var(
    "MORPHSERVE_HTTP_PORT",
    "8000",
    "docker",
    "docker/compose.yaml, docker/Dockerfile, docker/Dockerfile.gpu",
    "Triton's HTTP port (host networking); with the `replicas` profile, the balancer's",
)
GRPC_PORT = _var(
    "MORPHSERVE_GRPC_PORT",
    "8001",
    "docker",
    "docker/compose.yaml, docker/Dockerfile, docker/Dockerfile.gpu",
    "Triton's gRPC port; with the `replicas` profile, the balancer's",
)
METRICS_PORT = _var(
    "MORPHSERVE_METRICS_PORT",
    "8002",
    "docker",
    "docker/compose.yaml, docker/Dockerfile, docker/Dockerfile.gpu",
    "Triton's metrics port, the one Prometheus scrapes",
)
POLICY = _var(
    "MORPHSERVE_POLICY",
    "balanced",
    "docker",
    "docker/compose.yaml",
    "`--param morph_policy=` of the servers: `balanced`, `accuracy`, `performance`, `full`, `int4`, `int4:N`, `q4_1`",
)
MEMORY_BUDGET_BYTES = _var(
    "MORPHSERVE_MEMORY_BUDGET_BYTES",
    "",
    "docker",
    "docker/compose.yaml",
    "`--param memory_budget_bytes=`; unset: the full-precision model + base KV pool + one staging fragment",
)
MAX_KV_TOKENS = _var(
    "MORPHSERVE_MAX_KV_TOKENS",
    "16384",
    "docker",
    "docker/compose.yaml",
    "`--param max_tokens_in_paged_kv_cache=`: the KV pool with every layer at full precision",
)
NUM_THREADS = _var(
    "MORPHSERVE_NUM_THREADS",
    "",
    "docker",
    "docker/compose.yaml",
    "`replicas` profile: `--param num_threads=` per replica; unset: torch's default",
)
IMAGE = _var(
    "MORPHSERVE_IMAGE",
    "morphserve/triton-cpu:latest",
    "docker",
    "docker/compose.yaml, docker/test_compose.sh",
    "the CPU server's image tag (`make docker-test`: `morphserve/triton-cpu:test`)",
)
GPU_IMAGE = _var(
    "MORPHSERVE_GPU_IMAGE",
    "morphserve/triton-gpu:latest",
    "docker",
    "docker/compose.yaml",
    "the GPU server's image tag",
)
GPU_COUNT = _var("MORPHSERVE_GPU_COUNT", "1", "docker", "docker/compose.yaml", "GPUs the `gpu` service reserves")
BASE_IMAGE = _var(
    "MORPHSERVE_BASE_IMAGE",
    "python:3.11-slim-bookworm",
    "docker",
    "docker/compose.yaml, docker/build_base_image.sh, docker/test_compose.sh",
    "the images' `BASE_IMAGE` build argument (`docker/build_base_image.sh` and `make docker-test`: "
    "`morphserve/base:bookworm-py311`)",
)
FRAGMENTS_DIR = _var(
    "MORPHSERVE_FRAGMENTS_DIR",
    "",
    "docker",
    "docker/compose.fragments.yaml, docker/test_compose.sh",
    "the host's fragments folder (with `manifest.json`) that `compose.fragments.yaml` mounts; required there",
)
OPENAI_PORT = _var(
    "MORPHSERVE_OPENAI_PORT", "9000", "docker", "docker/compose.yaml", "`openai` profile: the gateway's port"
)
OPENAI_API_KEY = _var(
    "MORPHSERVE_OPENAI_API_KEY",
    "",
    "docker",
    "docker/compose.yaml",
    "`openai` profile: the gateway's API key; setting it also keeps Triton on 127.0.0.1",
)
LB_IMAGE = _var(
    "MORPHSERVE_LB_IMAGE",
    "morphserve/lb:latest",
    "docker",
    "docker/compose.yaml, docker/test_compose.sh",
    "`replicas` profile: the balancer's image tag",
)
LB_BASE_IMAGE = _var(
    "MORPHSERVE_LB_BASE_IMAGE",
    "debian:bookworm-slim",
    "docker",
    "docker/compose.yaml",
    "`replicas` profile: the balancer image's `BASE_IMAGE` build argument",
)
LB_BIND_ADDR = _var(
    "MORPHSERVE_LB_BIND_ADDR",
    "0.0.0.0",
    "docker",
    "docker/compose.yaml, docker/test_compose.sh",
    "`replicas` profile: the balancer's listen address",
)
LB_ADMIN_PORT = _var(
    "MORPHSERVE_LB_ADMIN_PORT",
    "8404",
    "docker",
    "docker/compose.yaml, docker/test_compose.sh",
    "`replicas` profile: HAProxy's stats, `/metrics` and `/healthz`",
)
REPLICA1_HTTP_PORT = _var(
    "MORPHSERVE_REPLICA1_HTTP_PORT",
    "8100",
    "docker",
    "docker/compose.yaml, docker/test_compose.sh",
    "`replicas` profile: replica 1's HTTP port",
)
REPLICA1_GRPC_PORT = _var(
    "MORPHSERVE_REPLICA1_GRPC_PORT",
    "8101",
    "docker",
    "docker/compose.yaml, docker/test_compose.sh",
    "`replicas` profile: replica 1's gRPC port",
)
REPLICA1_METRICS_PORT = _var(
    "MORPHSERVE_REPLICA1_METRICS_PORT",
    "8102",
    "docker",
    "docker/compose.yaml, docker/test_compose.sh",
    "`replicas` profile: replica 1's metrics port",
)
REPLICA2_HTTP_PORT = _var(
    "MORPHSERVE_REPLICA2_HTTP_PORT",
    "8200",
    "docker",
    "docker/compose.yaml, docker/test_compose.sh",
    "`replicas` profile: replica 2's HTTP port",
)
REPLICA2_GRPC_PORT = _var(
    "MORPHSERVE_REPLICA2_GRPC_PORT",
    "8201",
    "docker",
    "docker/compose.yaml, docker/test_compose.sh",
    "`replicas` profile: replica 2's gRPC port",
)
REPLICA2_METRICS_PORT = _var(
    "MORPHSERVE_REPLICA2_METRICS_PORT",
    "8202",
    "docker",
    "docker/compose.yaml, docker/test_compose.sh",
    "`replicas` profile: replica 2's metrics port",
)

# --- Docker: the end-to-end test, docker/test_compose.sh (`make docker-test`) ----------------------------------
DOCKER_ROOT = _var(
    "MORPHSERVE_DOCKER_ROOT",
    "/var/lib/docker-morphserve",
    "docker",
    "docker/test_compose.sh",
    "the test's dockerd data root (its image cache, outside the clone)",
)
TEST_PORT_BASE = _var(
    "MORPHSERVE_TEST_PORT_BASE",
    "",
    "docker",
    "docker/test_compose.sh",
    "first of the 13 ports the test uses; unset: a free range",
)
TEST_LOAD_S = _var(
    "MORPHSERVE_TEST_LOAD_S",
    "45",
    "docker",
    "docker/test_compose.sh",
    "seconds of traffic before the dashboard is rendered",
)
TEST_IDLE_S = _var(
    "MORPHSERVE_TEST_IDLE_S",
    "20",
    "docker",
    "docker/test_compose.sh",
    "seconds of quiet after the traffic (the controller restores layers)",
)
TEST_POLICY = _var(
    "MORPHSERVE_TEST_POLICY",
    "performance",
    "docker",
    "docker/test_compose.sh",
    "the morph policy of the run on mounted INT4 fragments",
)
TEST_KV_TOKENS = _var(
    "MORPHSERVE_TEST_KV_TOKENS",
    "512",
    "docker",
    "docker/test_compose.sh",
    "the KV pool of that run, small so that the traffic morphs",
)
TEST_REPLICA_THREADS = _var(
    "MORPHSERVE_TEST_REPLICA_THREADS",
    "1",
    "docker",
    "docker/test_compose.sh",
    "`num_threads` of each replica in the `replicas` part",
)
TEST_BURST = _var(
    "MORPHSERVE_TEST_BURST", "16", "docker", "docker/test_compose.sh", "requests of the burst sent through the balancer"
)
PIP_EXTRA_ARGS = _var(
    "MORPHSERVE_PIP_EXTRA_ARGS",
    "",
    "docker",
    "docker/test_compose.sh",
    "extra pip arguments for the image build (e.g. an index with CPU torch where no local wheel exists)",
)

ALL: tuple[EnvVar, ...] = tuple(_ALL)
BY_NAME: dict[str, EnvVar] = {v.name: v for v in ALL}


def markdown_table() -> str:
    rows = ["| Variable | Default | Read by | Where | Meaning |", "|---|---|---|---|---|"]
    for v in ALL:
        default = f"`{v.default}`" if v.default else "(unset)"
        rows.append(f"| `{v.name}` | {default} | {', '.join(v.read_by)} | {v.where} | {v.meaning} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(markdown_table())
