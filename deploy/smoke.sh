#!/usr/bin/env bash
# The whole container check, one script (`.ci/run` runs it in a stage of its own):
#
#   deploy/smoke.sh
#
#  1. a Docker engine: the one DOCKER_HOST (or the default socket) reaches, else
#     a dockerd of its own (root), stopped at the end;
#  2. the base image without a registry (deploy/make-base-image.sh: debootstrap
#     from this machine's Debian mirror, `docker import`);
#  3. the wheelhouse, filled by the host's pip (the CPU torch wheel among them),
#     linked into ./wheels for an air-gapped build;
#  4. the image from the project's Dockerfile (BASE_IMAGE = that base);
#  5. Debian stand-ins for eclipse-mosquitto and prom/prometheus (nothing can be
#     pulled here; XRONOS_MOSQUITTO_IMAGE / XRONOS_PROMETHEUS_IMAGE set by the
#     caller are used as they are);
#  6. compose.yaml up (Mosquitto with deploy/mosquitto's password file and ACLs,
#     controller, nodes node-a/b/c at 1, 0.5 and 0.25 CPUs, Prometheus; Grafana,
#     whose image cannot be made here, is left out), a job triggered with plain
#     mosquitto_pub, followed to `completed`, its model loaded with transformers
#     from the checkpoints volume;
#  7. `xronos deploy` of three node containers with different --cpus on the same
#     engine, their targets seen up by Prometheus, a second job on them with
#     `xronos train`, its model loaded;
#  8. everything torn down: nothing left running, the volumes gone.
#
# Any failure exits non-zero naming the step, with the services' last log lines.
# Bounded by XRONOS_SMOKE_TIMEOUT seconds (default 600). What is slow to remake
# is cached in XRONOS_CACHE (default /var/cache/xronos-smoke): the base root
# filesystem, the wheelhouse, and (own engine) the engine's images and layers.
# XRONOS_SMOKE_NO_CACHE=1 builds the image without the layer cache (a cold build).
# Needs: docker, docker-compose, python3 (3.11) with the project's dependencies,
# and for a first run root, debootstrap and the Debian mirror.
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
CACHE=${XRONOS_CACHE:-/var/cache/xronos-smoke}
LIMIT=${XRONOS_SMOKE_TIMEOUT:-600}
BASE=${XRONOS_SMOKE_BASE:-xronos-smoke/base:bookworm}
IMAGE=${XRONOS_SMOKE_IMAGE:-xronos:smoke}
PROJECT=xronos-smoke
PORTS="8883 8884 9090 9100 9101 9102 9103 9111 9112 9113"
WORK=$(mktemp -d /tmp/xronos-smoke.XXXXXX)
export XRONOS_CACHE=$CACHE PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1
STEP=start
ENGINE_PID=
WATCHDOG_PID=
TEARDOWN=()  # commands that undo what was done, run last first
START=$(date +%s.%N)
declare -A SECONDS_OF=()

say() { printf 'smoke: %s\n' "$*" >&2; }
fail() { say "$*"; exit 1; }
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }
step() { STEP=$1; say "== $1"; }
xronos() { python3 -m xronos.cli "$@"; }
compose() { docker-compose -p "$PROJECT" -f "$REPO/compose.yaml" --project-directory "$REPO" "$@"; }
secret() { python3 -c 'import secrets; print(secrets.token_urlsafe(18))'; }

diagnose() {
  say "--- diagnostics (step: $STEP)"
  docker ps -a --format '{{.Names}}\t{{.Status}}' 2>/dev/null | sed 's/^/smoke:   /' >&2 || true
  for c in $(docker ps -aq --filter "label=com.docker.compose.project=$PROJECT" --filter label=io.xronos.role 2>/dev/null); do
    say "--- logs of $(docker inspect -f '{{.Name}}' "$c" 2>/dev/null)"
    docker logs --tail 25 "$c" 2>&1 | sed 's/^/smoke:   /' >&2 || true
  done
  [ -s "$WORK/dockerd.log" ] && { say "--- dockerd"; tail -n 10 "$WORK/dockerd.log" | sed 's/^/smoke:   /' >&2; }
  return 0
}

finish() {
  local rc=$?
  trap - EXIT INT TERM
  [ -n "$WATCHDOG_PID" ] && kill "$WATCHDOG_PID" 2>/dev/null
  if [ "$rc" -ne 0 ]; then
    say "FAILED at step: $STEP (exit $rc)"
    diagnose
  fi
  STEP=teardown
  local i
  for ((i = ${#TEARDOWN[@]} - 1; i >= 0; i--)); do eval "${TEARDOWN[i]}" >/dev/null 2>&1 || true; done
  if [ -n "$ENGINE_PID" ]; then
    kill "$ENGINE_PID" 2>/dev/null || true
    for _ in $(seq 60); do kill -0 "$ENGINE_PID" 2>/dev/null || break; sleep 0.5; done
    kill -0 "$ENGINE_PID" 2>/dev/null && { say "dockerd $ENGINE_PID did not stop; killing it"; kill -9 "$ENGINE_PID" || true; }
  fi
  # dockerd leaves its network namespace mounted in its exec root
  awk -v w="$WORK/" 'index($2, w) == 1 { print $2 }' /proc/mounts | sort -r | xargs -r -n1 umount 2>/dev/null || true
  rm -rf "$WORK"
  say "total $(since "$START") s; $([ "$rc" -eq 0 ] && echo passed || echo FAILED)"
  exit "$rc"
}
trap finish EXIT
trap 'say "interrupted"; exit 130' INT
trap 'say "stopped after ${LIMIT} s (XRONOS_SMOKE_TIMEOUT)"; exit 124' TERM
# bash runs a trap only once the command in the foreground returns: the watchdog also stops
# this script's children (a hung docker build or compose client), but not its dockerd, which
# the teardown still needs
( sleep "$LIMIT"; kill -TERM $$ 2>/dev/null
  for child in $(pgrep -P $$); do
    [ "$child" = "$BASHPID" ] || [ "$child" = "$(cat "$WORK/dockerd.pid" 2>/dev/null)" ] || kill -TERM "$child" 2>/dev/null
  done ) &
WATCHDOG_PID=$!

# wait_for SECONDS WHAT COMMAND...: run COMMAND until it succeeds
wait_for() {
  local limit=$1 deadline=$(( $(date +%s) + $1 )) what=$2; shift 2
  until "$@" >/dev/null 2>&1; do
    [ "$(date +%s)" -lt "$deadline" ] || fail "$what: not within $limit s"
    sleep 2
  done
}

# -- 0. what the run needs -------------------------------------------------------------
step preflight
for tool in docker docker-compose python3; do
  command -v "$tool" >/dev/null || fail "$tool is not installed (.ci/run: apt-get install --no-install-recommends docker.io docker-compose debootstrap)"
done
python3 -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' \
  || fail "python3 is not 3.11: the wheelhouse is filled for the host's Python and must match the base image's (3.11)"
python3 -c 'import xronos.cli, docker, yaml' 2>/dev/null || fail "the project's dependencies are not installed (pip install -e .)"
mkdir -p "$CACHE"
exec 8>"$CACHE/.smoke.lock"
flock -n 8 || fail "another smoke run holds $CACHE/.smoke.lock"
for port in $PORTS; do
  ! python3 -c "import socket, sys; socket.create_connection(('127.0.0.1', $port), 0.5)" 2>/dev/null \
    || fail "port $port is taken on this host (the stack uses host networking): stop what listens there"
done

# what compose.yaml reads: throwaway passwords (never printed), the images, the volumes' prefix
for user in CONTROLLER OPERATOR NODE_A NODE_B NODE_C EDGE_1 EDGE_2 EDGE_3; do export "XRONOS_PASSWORD_$user=$(secret)"; done
export GRAFANA_ADMIN_PASSWORD=$(secret) XRONOS_IMAGE=$IMAGE XRONOS_BASE_IMAGE=$BASE XRONOS_VOLUME_PREFIX=$PROJECT \
  XRONOS_MOSQUITTO_PASSWD=$WORK/mosquitto/passwd

# -- 1. an engine ------------------------------------------------------------------------
step engine
if docker info >/dev/null 2>&1; then
  say "using the engine at ${DOCKER_HOST:-the default socket}"
else
  [ "$(id -u)" -eq 0 ] || fail "no Docker engine is reachable and this is not root: start one or set DOCKER_HOST"
  command -v dockerd >/dev/null || fail "dockerd is not installed (apt-get install --no-install-recommends docker.io)"
  export DOCKER_HOST="unix://$WORK/docker.sock"
  for driver in overlay2 vfs; do  # vfs where overlay mounts are refused (an engine inside a container)
    mkdir -p "$CACHE/engine-$driver"
    dockerd --storage-driver "$driver" --iptables=false --bridge=none --data-root "$CACHE/engine-$driver" \
      --exec-root "$WORK/exec" --pidfile "$WORK/dockerd.pid" -H "$DOCKER_HOST" >"$WORK/dockerd.log" 2>&1 &
    ENGINE_PID=$!
    for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; kill -0 "$ENGINE_PID" 2>/dev/null || break; sleep 0.5; done
    docker info >/dev/null 2>&1 && break
    kill "$ENGINE_PID" 2>/dev/null; wait "$ENGINE_PID" 2>/dev/null || true; ENGINE_PID=
  done
  [ -n "$ENGINE_PID" ] || { tail -n 5 "$WORK/dockerd.log" >&2; fail "dockerd did not start"; }
  say "started dockerd (pid $ENGINE_PID, $(docker info -f '{{.Driver}}'), data in $CACHE) at $DOCKER_HOST"
fi
ENGINE_URL=${DOCKER_HOST:-unix:///var/run/docker.sock}
# leftovers of a run that was killed
compose --profile tools down -v --remove-orphans >/dev/null 2>&1 || true
docker rm -f xronos-node-edge-1 xronos-node-edge-2 xronos-node-edge-3 >/dev/null 2>&1 || true

# -- 2. the base image ---------------------------------------------------------------------
step base-image
t=$(now)
docker image inspect "$BASE" >/dev/null 2>&1 || "$REPO/deploy/make-base-image.sh" "$BASE"
SECONDS_OF[base]=$(since "$t")

# -- 3. the wheelhouse ---------------------------------------------------------------------
step wheelhouse
t=$(now)
mkdir -p "$CACHE/wheels"
python3 -c "import tomllib; print('\n'.join(tomllib.load(open('$REPO/pyproject.toml', 'rb'))['project']['dependencies']))" \
  >"$WORK/requirements.txt"
printf '%s\n' 'setuptools>=68' wheel >>"$WORK/requirements.txt"
stamp=$(sha256sum "$WORK/requirements.txt" | cut -c1-16)
if [ "$(cat "$CACHE/wheels/.requirements" 2>/dev/null)" != "$stamp" ]; then
  pip download -q --disable-pip-version-check --only-binary=:all: -d "$CACHE/wheels" -r "$WORK/requirements.txt" 2>&1 \
    | grep -v -e 'is ignored' >&2 || true
  [ "${PIPESTATUS[0]}" -eq 0 ] || fail "pip download failed"
  echo "$stamp" >"$CACHE/wheels/.requirements"
fi
torch=$(sed -n 's/^torch==//p' "$WORK/requirements.txt")
ls "$CACHE/wheels/torch-$torch+cpu-"*.whl >/dev/null 2>&1 \
  || fail "the wheelhouse has no CPU build of torch $torch (pip took PyPI's CUDA one): put torch-$torch+cpu in pip's --find-links, or fill $CACHE/wheels from https://download.pytorch.org/whl/cpu"
! ls "$CACHE/wheels/"nvidia_* >/dev/null 2>&1 || fail "CUDA wheels in $CACHE/wheels: remove them"
for wheel in "$CACHE/wheels/"*.whl; do  # linked in for the build, taken out again at the end
  [ -e "$REPO/wheels/${wheel##*/}" ] && continue
  ln "$wheel" "$REPO/wheels/" 2>/dev/null || cp "$wheel" "$REPO/wheels/"
  echo "$REPO/wheels/${wheel##*/}" >>"$WORK/linked-wheels"
done
TEARDOWN+=('[ -f "$WORK/linked-wheels" ] && xargs rm -f <"$WORK/linked-wheels"')
SECONDS_OF[wheels]=$(since "$t")

# -- 4. the image --------------------------------------------------------------------------
step build
t=$(now)
# the builder stage tagged too: the layer cache of the next run stays referenced, and the
# images an earlier run left behind can be pruned (own engine only)
for target in final builder; do  # (no cache: the whole image; tagging its builder stage then reuses it)
  docker build $([ $target = final ] && echo ${XRONOS_SMOKE_NO_CACHE:+--no-cache}) --build-arg "BASE_IMAGE=$BASE" \
    $([ $target = builder ] && echo "--target builder -t $IMAGE-builder" || echo "-t $IMAGE") "$REPO" >"$WORK/build.log" 2>&1 \
    || { tail -n 30 "$WORK/build.log" >&2; fail "docker build ($target) failed"; }
done
SECONDS_OF[build]=$(since "$t")
[ -z "$ENGINE_PID" ] || docker image prune -f >/dev/null
size=$(docker image inspect -f '{{.Size}}' "$IMAGE")
say "built $IMAGE in ${SECONDS_OF[build]} s${XRONOS_SMOKE_NO_CACHE:+ (no cache)}: $((size / 1000000)) MB"
docker run --rm --network none "$IMAGE" --version >&2
docker run --rm --network none --entrypoint sh "$IMAGE" -c \
  'test "$(id -u)" != 0 && ! command -v gcc && ! command -v cc && python -c "import torch; assert not torch.version.cuda"' \
  >/dev/null || fail "the image runs as root, has a compiler, or a CUDA torch"

# -- 5. stand-ins for the images that cannot be pulled here --------------------------------
step stand-in-images
standin() {  # standin NAME DOCKERFILE-BODY
  docker image inspect "$1" >/dev/null 2>&1 && return 0
  printf 'FROM %s\n%s\n' "$BASE" "$2" | docker build -q --network host -t "$1" -f - "$WORK" >/dev/null 2>"$WORK/standin.log" \
    || { tail -n 20 "$WORK/standin.log" >&2; fail "could not build the stand-in $1"; }
}
if [ -z "${XRONOS_MOSQUITTO_IMAGE:-}" ]; then
  export XRONOS_MOSQUITTO_IMAGE=xronos-smoke/mosquitto:bookworm
  # the official image's layout: user mosquitto = 1883, /mosquitto/{config,data}, clients included
  standin "$XRONOS_MOSQUITTO_IMAGE" 'RUN groupadd --system --gid 1883 mosquitto \
 && useradd --system --uid 1883 --gid 1883 --no-create-home --home-dir /var/lib/mosquitto mosquitto \
 && apt-get update -q && apt-get install -y -q --no-install-recommends mosquitto mosquitto-clients \
 && rm -rf /var/lib/apt/lists/* && mkdir -p /mosquitto/config /mosquitto/data && chown mosquitto:mosquitto /mosquitto/data
CMD ["mosquitto", "-c", "/mosquitto/config/mosquitto.conf"]'
fi
if [ -z "${XRONOS_PROMETHEUS_IMAGE:-}" ]; then
  export XRONOS_PROMETHEUS_IMAGE=xronos-smoke/prometheus:bookworm
  # the official image's layout: /bin/prometheus, user nobody, /prometheus, wget for the health check
  standin "$XRONOS_PROMETHEUS_IMAGE" 'RUN apt-get update -q && apt-get install -y -q --no-install-recommends prometheus wget \
 && rm -rf /var/lib/apt/lists/* && mkdir -p /prometheus && chown nobody:nogroup /prometheus
USER nobody
ENTRYPOINT ["/bin/prometheus"]'
fi

# -- 6. compose.yaml: the cluster on one host, a job by mosquitto_pub -------------------------
step compose-config
mkdir -p "$WORK/mosquitto"
# the password file, by deploy/mosquitto/make-passwords.sh (passwords by environment), for the broker's user
docker run --rm --network none --user 0 --entrypoint sh \
  -e XRONOS_PASSWORD_CONTROLLER -e XRONOS_PASSWORD_OPERATOR -e XRONOS_PASSWORD_NODE_A -e XRONOS_PASSWORD_NODE_B \
  -e XRONOS_PASSWORD_NODE_C -e XRONOS_PASSWORD_EDGE_1 -e XRONOS_PASSWORD_EDGE_2 -e XRONOS_PASSWORD_EDGE_3 \
  -v "$REPO/deploy/mosquitto/make-passwords.sh:/make-passwords.sh:ro" -v "$WORK/mosquitto:/out" "$XRONOS_MOSQUITTO_IMAGE" \
  -c 'sh /make-passwords.sh /out/passwd node-a node-b node-c edge-1 edge-2 edge-3 && chown 1883:1883 /out/passwd' 2>/dev/null \
  || fail "make-passwords.sh failed"
# the TLS files, by deploy/mosquitto/make-certs.sh, readable by the broker's user and the image's
XRONOS_BROKER_NAMES="127.0.0.1 localhost" sh "$REPO/deploy/mosquitto/make-certs.sh" "$WORK/certs" \
  node-a node-b node-c edge-1 edge-2 edge-3 2>/dev/null || fail "make-certs.sh failed"
chown 1883:1883 "$WORK/certs/broker.key"
for user in controller operator node-a node-b node-c; do chown 10001:10001 "$WORK/certs/$user.key"; done
export XRONOS_CERTS=$WORK/certs
# the host's own xronos commands below are the operator's, over TLS on the operators' port
export XRONOS_BROKER=mqtts://127.0.0.1:8884 XRONOS_CA_FILE=$WORK/certs/ca.crt \
  XRONOS_CERT_FILE=$WORK/certs/operator.crt XRONOS_KEY_FILE=$WORK/certs/operator.key
compose config -q || fail "docker-compose config rejects compose.yaml"
TEARDOWN+=('compose --profile tools down -v --remove-orphans --timeout 20')

step model-and-data
# a tiny Llama and learnable rows (edge_node/toy_model.py), made in the volumes by the image itself
compose run --rm --no-deps --entrypoint python operator -c "
from edge_node.toy_model import make_data, make_model
make_model('/models/tiny', hidden=64, layers=2, heads=4, kv_heads=4, intermediate=256, vocab=256, seed=0)
make_data('/data/tiny.jsonl', rows=64, seq_len=32, vocab=256)" >/dev/null 2>"$WORK/run.log" \
  || { tail -n 20 "$WORK/run.log" >&2; fail "could not make the model and data"; }

node_online() {  # node_online ID...: every one online (retained birth) and heartbeating
  XRONOS_PASSWORD=$XRONOS_PASSWORD_OPERATOR xronos status --username operator --json --listen 2.5 >"$WORK/status.json" || return 1
  python3 - "$WORK/status.json" "$@" <<'PY'
import json, sys
view = json.load(open(sys.argv[1]))
nodes = {n["node_id"]: n for n in view["nodes"]}
sys.exit(not all(nodes.get(i, {}).get("status") == "online" and nodes[i].get("state") for i in sys.argv[2:]))
PY
}
job_state() {  # job_state JOB: its state in the retained job status
  XRONOS_PASSWORD=$XRONOS_PASSWORD_OPERATOR xronos status --username operator --json --listen 1 >"$WORK/status.json" || return 1
  python3 - "$WORK/status.json" "$1" <<'PY'
import json, sys
jobs = {j["job_id"]: j for j in json.load(open(sys.argv[1]))["jobs"]}
job = jobs.get(sys.argv[2])
print(job["state"] if job else "none", (job or {}).get("reason") or "")
PY
}
ran_on() {  # ran_on FILE JOB NODE...: the job's report (status JSON or report JSON) has exactly these ranks
  python3 - "$@" <<'PY' >&2 || fail "job $2 did not run on ${*:3}"
import json, sys
doc = json.load(open(sys.argv[1]))
report = next(j["report"] for j in doc["jobs"] if j["job_id"] == sys.argv[2]) if "jobs" in doc else doc
ranks = {n["name"]: (n["kv_groups"], n["mlp_columns"]) for n in report["nodes"]}
print(f"smoke: job {sys.argv[2]} ranks (kv groups, mlp columns): {ranks}")
sys.exit(sorted(ranks) != sorted(sys.argv[3:]))
PY
}
metrics_answer() { python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$1/metrics', timeout=3)"; }
healthy() { [ "$(docker inspect -f '{{.State.Health.Status}}' "$1")" = healthy ]; }
load_model() {  # load_model DIR: the fine-tuned model loads with plain transformers and moved from the start
  compose run --rm --no-deps --entrypoint python operator -c "
import torch
from transformers import AutoModelForCausalLM
tuned = AutoModelForCausalLM.from_pretrained('$1')
start = AutoModelForCausalLM.from_pretrained('/models/tiny')
moved = max((a - b).abs().max().item() for a, b in zip(tuned.parameters(), start.parameters()))
assert moved > 0, 'the weights did not change'
print(f'{type(tuned).__name__} from $1: {sum(p.numel() for p in tuned.parameters())} parameters, moved up to {moved:.3g}')"
}

step compose-up
t_up=$(now)
compose up -d --no-build mosquitto controller node-a node-b node-c prometheus 2>"$WORK/up.log" \
  || { cat "$WORK/up.log" >&2; fail "docker-compose up failed"; }
wait_for 60 "mosquitto healthy" healthy "${PROJECT}_mosquitto_1"
wait_for 120 "controller metrics on 9100" metrics_answer 9100
wait_for 180 "node-a, node-b and node-c online" node_online node-a node-b node-c
say "cluster up in $(since "$t_up") s"

step job-by-mosquitto_pub
# mode tp: every node takes a share (mode xronos would rightly leave the slow ones out of so small
# a model), so the collectives run between the containers
job='{"schema_version": 1, "job_id": "smoke-1", "nodes": ["node-a", "node-b", "node-c"], "job": {"model": "/models/tiny",
 "data": "/data/tiny.jsonl", "output": "/checkpoints/smoke-1", "mode": "tp", "steps": 6, "batch_size": 4,
 "seq_len": 32, "lr": 0.001, "shuffle": false}}'
docker run --rm --network host --user 0 --entrypoint mosquitto_pub -v "$WORK/certs:/certs:ro" "$XRONOS_MOSQUITTO_IMAGE" \
  -h 127.0.0.1 -p 8884 --cafile /certs/ca.crt --cert /certs/operator.crt --key /certs/operator.key -i xronos-smoke-pub \
  -u operator -P "$XRONOS_PASSWORD_OPERATOR" -q 1 -t xronos/cmd/train -m "$job" || fail "mosquitto_pub failed"
deadline=$(( $(date +%s) + 300 ))
while :; do
  read -r state reason < <(job_state smoke-1 || echo "unknown")
  case $state in
    completed) break ;;
    failed|stopped) fail "job smoke-1 $state: $reason" ;;
  esac
  [ "$(date +%s)" -lt "$deadline" ] || fail "job smoke-1 did not complete within 300 s (last state: $state)"
  sleep 2
done
SECONDS_OF[up_to_job]=$(since "$t_up")
say "job smoke-1 completed: $(since "$t_up") s after docker-compose up"
ran_on "$WORK/status.json" smoke-1 node-a node-b node-c
load_model /checkpoints/smoke-1 >&2 || fail "the model of job smoke-1 does not load"
for c in controller node-a node-b node-c prometheus; do
  wait_for 60 "$c healthy" healthy "${PROJECT}_${c}_1"
done

# -- 7. xronos deploy: three node containers through the Docker API, a job on them -----------
step deploy
compose rm -sf node-a node-b node-c >/dev/null 2>&1
tls=
if [[ $ENGINE_URL == tcp://* && -n ${DOCKER_CERT_PATH:-} ]]; then
  tls="    tls: {ca_cert: $DOCKER_CERT_PATH/ca.pem, client_cert: $DOCKER_CERT_PATH/cert.pem, client_key: $DOCKER_CERT_PATH/key.pem}"
fi
{
  echo "image: $IMAGE"
  echo "pull: never"
  echo "broker: mqtts://127.0.0.1:8883"
  echo "mqtt_certs: $WORK/certs"
  echo "mounts: [$PROJECT-models:/models:ro, $PROJECT-data:/data:ro, $PROJECT-checkpoints:/checkpoints]"
  echo "devices:"
  for spec in "edge-1 1.0 2g 9111" "edge-2 0.5 1536m 9112" "edge-3 0.25 1g 9113"; do
    read -r name cpus memory port <<<"$spec"
    printf '  - name: %s\n    base_url: %s\n    cpus: %s\n    memory: %s\n    metrics_port: %s\n' \
      "$name" "$ENGINE_URL" "$cpus" "$memory" "$port"
    [ -n "$tls" ] && echo "$tls"
  done
} >"$WORK/devices.yaml"
# the targets where compose's Prometheus reads them, unless someone's own file is there
targets=$REPO/deploy/prometheus/targets/xronos-deploy.json
[ -e "$targets" ] && targets=$WORK/xronos-deploy.json
TEARDOWN+=("xronos deploy remove --inventory '$WORK/devices.yaml' --targets '$targets'; [ '$targets' = '$WORK/xronos-deploy.json' ] || rm -f '$targets'")
xronos deploy --inventory "$WORK/devices.yaml" --targets "$targets" --dry-run >&2
xronos deploy --inventory "$WORK/devices.yaml" --targets "$targets" >&2 || fail "xronos deploy failed"
for spec in "edge-1 1000000000" "edge-2 500000000" "edge-3 250000000"; do
  read -r name nano <<<"$spec"
  [ "$(docker inspect -f '{{.HostConfig.NanoCpus}} {{.HostConfig.NetworkMode}}' "xronos-node-$name")" = "$nano host" ] \
    || fail "xronos-node-$name does not have --cpus $((nano / 10000000))/100 on the host network"
  ! docker inspect -f '{{json .Config.Env}} {{json .Args}}' "xronos-node-$name" | grep -qF "$XRONOS_PASSWORD_EDGE_1" \
    || fail "a password shows in docker inspect"
done
wait_for 180 "edge-1, edge-2 and edge-3 online" node_online edge-1 edge-2 edge-3
xronos deploy status --inventory "$WORK/devices.yaml" >&2 || fail "xronos deploy status reports a node down"
if [ "$targets" = "$REPO/deploy/prometheus/targets/xronos-deploy.json" ]; then
  prometheus_sees_edges() {
    python3 - <<'PY'
import json, sys, urllib.request
active = json.load(urllib.request.urlopen("http://127.0.0.1:9090/api/v1/targets", timeout=3))["data"]["activeTargets"]
up = {t["labels"].get("device") for t in active if t["health"] == "up"}
sys.exit(not {"edge-1", "edge-2", "edge-3"} <= up)
PY
  }
  wait_for 90 "Prometheus scraping the deployed nodes (file_sd)" prometheus_sees_edges
  say "Prometheus scrapes edge-1..3 from $targets"
fi

step job-by-xronos-train
t=$(now)
XRONOS_PASSWORD=$XRONOS_PASSWORD_OPERATOR xronos train --broker mqtts://127.0.0.1:8884 --username operator \
  --model /models/tiny --data /data/tiny.jsonl --output /checkpoints/smoke-2 --nodes edge-1,edge-2,edge-3 \
  --mode tp --steps 6 --batch-size 4 --seq-len 32 --lr 1e-3 --no-shuffle --job-id smoke-2 \
  --wait --timeout 300 --quiet --report "$WORK/report-2.json" >&2 || fail "job smoke-2 on the deployed nodes failed"
ran_on "$WORK/report-2.json" smoke-2 edge-1 edge-2 edge-3
SECONDS_OF[deploy_job]=$(since "$t")
load_model /checkpoints/smoke-2 >&2 || fail "the model of job smoke-2 does not load"

# -- 8. tear down and check that nothing is left ------------------------------------------------
step teardown
xronos deploy remove --inventory "$WORK/devices.yaml" --targets "$targets" >&2 || fail "xronos deploy remove failed"
[ "$targets" = "$WORK/xronos-deploy.json" ] || rm -f "$targets"
compose --profile tools down -v --remove-orphans --timeout 20 2>/dev/null || fail "docker-compose down failed"
left=$(docker ps -aq --filter "label=com.docker.compose.project=$PROJECT"; docker ps -aq --filter label=io.xronos.role)
[ -z "$left" ] || fail "containers left behind: $left"
! docker volume ls -q | grep -q "^$PROJECT-" || fail "volumes left behind: $(docker volume ls -q | grep "^$PROJECT-" | tr '\n' ' ')"

say "image $IMAGE: $((size / 1000000)) MB; base ${SECONDS_OF[base]} s, wheelhouse ${SECONDS_OF[wheels]} s, build ${SECONDS_OF[build]} s${XRONOS_SMOKE_NO_CACHE:+ (no cache)}"
say "docker-compose up -> job smoke-1 completed: ${SECONDS_OF[up_to_job]} s; xronos train on the deployed nodes: ${SECONDS_OF[deploy_job]} s"
