#!/usr/bin/env bash
# Builds the gateway image exactly from docker/Dockerfile with buildah (no Docker engine, no registry for base
# images) and probes it the way a user runs it. Called by .ci/run; see docs/container-image.md.
#
#   tools/build-image.sh [--install-missing] [--rebuild-base] [--keep] [--probe-only] [--context DIR]
#
#   --install-missing  apt-get install buildah and mmdebstrap where missing (CI)
#   --rebuild-base     make the local Python base again even if a fresh one is cached
#   --keep             keep the built image (localhost/specgate:probe) in the cache's storage afterwards
#   --probe-only       probe the image kept by an earlier --keep run, without building
#   --context DIR      build another checkout (default: this repository)
#
# The base: python:3.11-slim is not pulled from a registry; a stand-in with Debian's python3 (3.11) is made with
# mmdebstrap from Debian packages and cached in buildah's storage (rebuilt after SPECGATE_IMAGE_BASE_MAX_AGE_DAYS,
# default 7, or when its recipe changes). The host's CA bundle is mounted into every RUN step, so pip in the
# build reaches the package index the way the host does (proxies with their own CA included).
#
# Storage: buildah with the vfs driver and chroot isolation, as root (no overlay or user namespaces needed),
# under SPECGATE_IMAGE_CACHE (default /var/cache/specgate-image), apart from any other container storage.
# Every step has a time limit; the first failing step ends the script with exit 1 and says which one.
set -euo pipefail

repo="$(cd "$(dirname "$0")/.." && pwd)"
context="$repo"
install_missing=0
rebuild_base=0
keep=0
probe_only=0
while [ $# -gt 0 ]; do
    case "$1" in
        --install-missing) install_missing=1 ;;
        --rebuild-base) rebuild_base=1 ;;
        --keep) keep=1 ;;
        --probe-only) probe_only=1 keep=1 ;;
        --context) context="$(cd "$2" && pwd)"; shift ;;
        -h | --help) sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "build-image: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done

cache="${SPECGATE_IMAGE_CACHE:-/var/cache/specgate-image}"
max_age_days="${SPECGATE_IMAGE_BASE_MAX_AGE_DAYS:-7}"
ca_bundle="${SPECGATE_IMAGE_CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}"
mirror="${SPECGATE_IMAGE_DEBIAN_MIRROR:-http://deb.debian.org}"
suite=bookworm # Debian 12: Python 3.11, like python:3.11-slim
base_image="localhost/specgate-pybase:$suite"
image="localhost/specgate:probe"
model="probe/model"

log() { printf 'build-image: %s\n' "$*"; }
die() {
    printf '\nbuild-image: FAILED: %s\n' "$*" >&2
    exit 1
}
buildah_cmd=(buildah --root "$cache/storage" --runroot "$cache/run" --storage-driver vfs)
bh() { "${buildah_cmd[@]}" "$@"; }
now() { date +%s; }

# -- tools ---------------------------------------------------------------------------------------------------
missing=()
for tool in buildah mmdebstrap; do command -v "$tool" >/dev/null 2>&1 || missing+=("$tool"); done
if [ ${#missing[@]} -gt 0 ]; then
    [ "$install_missing" = 1 ] || die "missing ${missing[*]}: apt-get install ${missing[*]} (or pass --install-missing)"
    log "installing ${missing[*]} with apt"
    export DEBIAN_FRONTEND=noninteractive
    timeout 300 apt-get update -q >/dev/null || die "apt-get update (to install ${missing[*]})"
    timeout 600 apt-get install -y -q "${missing[@]}" >/dev/null || die "apt-get install ${missing[*]}"
fi
[ "$(id -u)" = 0 ] || die "run as root (buildah's vfs storage and chroot isolation without user namespaces)"
[ -r "$ca_bundle" ] || die "no CA bundle at $ca_bundle (set SPECGATE_IMAGE_CA_BUNDLE)"
[ -f "$context/docker/Dockerfile" ] || die "no docker/Dockerfile in $context"
mkdir -p "$cache"
work="$(mktemp -d)"
pids=()
containers=()
cleanup() {
    local pid ctr
    for pid in "${pids[@]}"; do kill -- "-$pid" 2>/dev/null || true; done
    for pid in "${pids[@]}"; do timeout 10 tail --pid="$pid" -f /dev/null 2>/dev/null || kill -9 -- "-$pid" 2>/dev/null || true; done
    for ctr in "${containers[@]}"; do bh rm "$ctr" >/dev/null 2>&1 || true; done
    if [ "$keep" = 0 ]; then bh rmi "$image" >/dev/null 2>&1 || true; fi
    bh rmi --prune >/dev/null 2>&1 || true # the builder stage's leftovers; the base stays
    rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# step NAME SECONDS CMD...: runs CMD with a time limit, its output in $work/NAME.log; on failure the log's tail.
step() {
    local name="$1" limit="$2" rc=0
    shift 2
    timeout --kill-after=10 "$limit" "$@" >"$work/$name.log" 2>&1 || rc=$?
    if [ "$rc" != 0 ]; then
        tail -n 40 "$work/$name.log" >&2
        [ "$rc" = 124 ] && die "$name: no result within ${limit}s"
        die "$name (exit $rc; the output's last lines above)"
    fi
}

# -- the local Python base (cached) ------------------------------------------------------------------------------
mm_args=(
    --variant=apt --include=python3,python3-pip,python3-venv,ca-certificates,passwd
    --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr # merged /usr without usrmerge (and the perl it pulls in)
    --aptopt='Acquire::Check-Valid-Until "false"'      # a snapshot or a skewed clock must not break the base
    --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/info/*'
    --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-exclude=/usr/share/doc/*'
    --dpkgopt='path-include=/usr/share/doc/*/copyright'
)
sources=(
    "deb $mirror/debian $suite main" "deb $mirror/debian $suite-updates main"
    "deb $mirror/debian-security $suite-security main"
)
recipe="$(printf '%s\n' 1 "$suite" "${mm_args[@]}" "${sources[@]}" | sha256sum | cut -c1-16)"
base_fresh() {
    local label created
    label="$(bh inspect --type image --format '{{index .OCIv1.Config.Labels "org.specgate.base.recipe"}}' \
        "$base_image" 2>/dev/null)" || return 1
    [ "$label" = "$recipe" ] || return 1
    created="$(bh inspect --type image --format '{{.OCIv1.Created.Unix}}' "$base_image")" || return 1
    [ $(($(now) - created)) -lt $((max_age_days * 86400)) ]
}
t0="$(now)"
if [ "$probe_only" = 1 ]; then
    base_s=0
elif [ "$rebuild_base" = 0 ] && base_fresh; then
    log "base $base_image: cached (recipe $recipe)"
    base_s=0
else
    log "base $base_image: mmdebstrap $suite (python3 from Debian packages)"
    step mmdebstrap 900 mmdebstrap "${mm_args[@]}" "$suite" "$work/rootfs.tar" "${sources[@]}"
    ctr="$(bh from scratch)"
    containers+=("$ctr")
    mnt="$(bh mount "$ctr")"
    step untar 300 tar -C "$mnt" --numeric-owner -xf "$work/rootfs.tar"
    rm -f "$work/rootfs.tar" "$mnt"/usr/lib/python3*/EXTERNALLY-MANAGED # pip installs system-wide, as in python:*
    ln -sf /usr/bin/python3 "$mnt/usr/local/bin/python"
    bh umount "$ctr" >/dev/null
    bh config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin --env LANG=C.UTF-8 \
        --cmd python3 --label "org.specgate.base.recipe=$recipe" "$ctr"
    step commit-base 300 "${buildah_cmd[@]}" commit --rm "$ctr" "$base_image"
    containers=()
    base_s=$(($(now) - t0))
    log "base made in ${base_s}s"
fi

# -- the image, exactly from docker/Dockerfile -------------------------------------------------------------------
t1="$(now)"
if [ "$probe_only" = 0 ]; then
    log "building $image from $context/docker/Dockerfile"
    # --format docker keeps HEALTHCHECK (the OCI format has no field for it).
    step build 900 "${buildah_cmd[@]}" bud --isolation chroot --format docker --pull=never \
        -v "$ca_bundle:/etc/ssl/certs/ca-certificates.crt:ro" \
        --build-arg "PYTHON_IMAGE=$base_image" -f "$context/docker/Dockerfile" -t "$image" "$context"
fi
build_s=$(($(now) - t1))
# The size as `buildah images` (and `docker images`) shows it: all layers, uncompressed.
size() { bh images --json "$1" | python3 -c 'import json, sys; print(json.load(sys.stdin)[0]["size"])'; }
[ "$probe_only" = 1 ] || log "built in ${build_s}s: $(size "$image")"

# -- probes ------------------------------------------------------------------------------------------------------
t2="$(now)"
bh inspect --type image "$image" >"$work/inspect.json"
cfg() { python3 -c 'import json, sys; print(json.dumps(json.load(open(sys.argv[1]))["Docker"]["config"].get(sys.argv[2])))' \
    "$work/inspect.json" "$1"; }
user="$(cfg User | tr -d '"')"
entrypoint="$(cfg Entrypoint | tr -d ' ')"
healthcheck="$(cfg Healthcheck)"
[ "${user%%:*}" != "" ] && [ "${user%%:*}" != 0 ] && [ "${user%%:*}" != root ] || die "image user is '$user', not a non-root uid"
[ "$entrypoint" = '["specgate","serve"]' ] || die "entrypoint is $entrypoint, not [\"specgate\",\"serve\"]"
[ "$healthcheck" != null ] || die "the image has no HEALTHCHECK"

# new_ctr VAR: a working container of the image in VAR (not in a subshell: the cleanup must know it).
new_ctr() {
    local -n var="$1"
    var="$(bh from --pull=never "$image")"
    containers+=("$var")
}
new_ctr ctr
run=("${buildah_cmd[@]}" run --isolation chroot)

version="$(timeout 60 "${run[@]}" "$ctr" -- specgate --version)" || die "specgate --version"
expected="$(sed -n 's/^version = "\(.*\)"/\1/p' "$context/pyproject.toml")"
[ "$version" = "specgate $expected" ] || die "specgate --version says '$version', pyproject.toml '$expected'"
uid="$(timeout 60 "${run[@]}" "$ctr" -- id -u)" || die "id -u"
[ "$uid" != 0 ] || die "the image runs as root"
log "probe: $version, uid $uid, entrypoint $entrypoint"
step validate 60 "${run[@]}" "$ctr" -- specgate validate /etc/specgate/rules.yaml
step validate-packaged 60 "${run[@]}" "$ctr" -- sh -c \
    'cd / && specgate validate "$(python -c "from gateway.config.packaged import DEFAULT_RULES; print(DEFAULT_RULES)")"'
log "probe: specgate validate: $(tail -n 1 "$work/validate.log")"

# Nothing of the build left: no compilers, no package or pip caches, no tests, no sources or wheels.
mnt="$(bh mount "$ctr")"
leftovers="$(
    cd "$mnt"
    for f in usr/bin/gcc usr/bin/cc usr/bin/g++ usr/bin/c++ usr/bin/clang usr/bin/make usr/bin/ld src wheels; do
        [ -e "$f" ] && echo "/$f"
    done
    find root/.cache tmp var/cache/apt/archives var/lib/apt/lists -mindepth 1 -not -name partial -not -name lock \
        -not -path 'var/cache/apt/archives/partial*' -not -path 'var/lib/apt/lists/partial*' 2>/dev/null | head -n 5
    find usr -xdev \( -path '*/gateway/tests' -o -path '*/site-packages/tests' -o -path '*/dist-packages/tests' \
        -o -name 'test_*.py' -path '*/gateway/*' \) 2>/dev/null | head -n 5
)"
bh umount "$ctr" >/dev/null
[ -z "$leftovers" ] || die "the image carries build leftovers: $(echo "$leftovers" | tr '\n' ' ')"
log "probe: no compilers, caches, tests, sources or wheels in the image"

free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
sim_port="$(free_port)"
gw_port="$(free_port)"
cat >"$work/rules.yaml" <<EOF
version: 1
pools:
  - name: sim
    kind: standard
    models: [$model]
    endpoints:
      - {url: "http://127.0.0.1:$sim_port", weight: 1}
classes:
  - name: all
    route: {preferred: sim}
EOF
chmod 644 "$work/rules.yaml"
chmod 755 "$work"
new_ctr sim_ctr
# Each in its own process group, so the cleanup ends it and everything it started.
setsid "${run[@]}" "$sim_ctr" -- specgate sim "$model" --host 127.0.0.1 --port "$sim_port" --time-scale 0.01 \
    >"$work/sim.log" 2>&1 &
pids+=($!)
# The image's entrypoint as `docker run` would start it: SPECGATE_RULES points at the mounted routing YAML.
setsid "${run[@]}" --env "SPECGATE_PORT=$gw_port" --env SPECGATE_ADMIN_PORT=0 --env SPECGATE_HOST=127.0.0.1 \
    --env SPECGATE_HEALTH_INTERVAL_S=1 -v "$work/rules.yaml:/etc/specgate/rules.yaml:ro" "$ctr" -- specgate serve \
    >"$work/serve.log" 2>&1 &
pids+=($!)

cat >"$work/probe_http.py" <<'EOF'
import json, sys, time, urllib.error, urllib.request

port, model = sys.argv[1], sys.argv[2]
base = f"http://127.0.0.1:{port}"

def get(path: str) -> int:
    try:
        with urllib.request.urlopen(base + path, timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0

deadline = time.monotonic() + 60
for path in ("/health", "/ready"):
    while (status := get(path)) != 200:
        if time.monotonic() > deadline:
            sys.exit(f"GET {path}: {status or 'no answer'} after 60 s")
        time.sleep(0.5)
    print(f"GET {path}: 200")
body = {"model": model, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8, "temperature": 0}
req = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps(body).encode(),
                             headers={"content-type": "application/json"})
with urllib.request.urlopen(req, timeout=30) as r:
    answer = json.load(r)
    pool = r.headers.get("x-specgate-pool")
if r.status != 200 or pool != "sim" or not answer["choices"][0]["message"]["content"]:
    sys.exit(f"POST /v1/chat/completions: {r.status}, pool {pool}, {answer}")
print(f"POST /v1/chat/completions: 200 from pool {pool}, {answer['usage']['completion_tokens']} tokens")
EOF
if ! timeout 120 python3 "$work/probe_http.py" "$gw_port" "$model" >"$work/http.log" 2>&1; then
    cat "$work/http.log" >&2
    echo "-- specgate serve:" >&2; tail -n 20 "$work/serve.log" >&2
    echo "-- specgate sim:" >&2; tail -n 20 "$work/sim.log" >&2
    die "the gateway started from the image did not answer as it should"
fi
sed 's/^/build-image: probe: /' "$work/http.log"

# The image's HEALTHCHECK command, run inside the container: passes against the gateway, fails without one.
hc_cmd="$(python3 -c 'import json, sys; t = json.loads(sys.argv[1])["Test"]; assert t[0] == "CMD", t; print(json.dumps(t[1:]))' "$healthcheck")" ||
    die "HEALTHCHECK is not in exec form: $healthcheck"
mapfile -t hc < <(python3 -c 'import json, sys; print("\n".join(json.loads(sys.argv[1])))' "$hc_cmd")
step healthcheck 30 "${run[@]}" --env "SPECGATE_PORT=$gw_port" "$ctr" -- "${hc[@]}"
if timeout 30 "${run[@]}" --env "SPECGATE_PORT=$(free_port)" "$ctr" -- "${hc[@]}" >/dev/null 2>&1; then
    die "the HEALTHCHECK command passes with nothing listening"
fi
log "probe: HEALTHCHECK passes against the gateway, fails with nothing listening"
probe_s=$(($(now) - t2))

log "ok: image $(size "$image") (base $(size "$base_image")); base ${base_s}s, build ${build_s}s, probes ${probe_s}s"
