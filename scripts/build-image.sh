#!/usr/bin/env bash
# Builds the image every ElasticCTR pod runs, elastic-ctr:VERSION (VERSION from setup.cfg), from the
# Dockerfile with podman, and prints its size.
#
#   scripts/build-image.sh                      # s3:// data (pyarrow's S3 client)
#   scripts/build-image.sh --hadoop 3.3.6       # + hdfs:// data (Java and Hadoop's libhdfs)
#   scripts/build-image.sh --containers-conf    # only write the containers.conf and print its path
#
# Without a reachable container registry the Dockerfile's base (Debian bookworm, Python 3.11) is
# bootstrapped with mmdebstrap and imported into podman's store (kept there: later builds reuse it).
# The host's CA bundle reaches the build as a build secret (pip behind an HTTPS-intercepting proxy),
# never as a layer. podman's settings for this host go into a containers.conf of our own, which
# CONTAINERS_CONF points at for every podman call of this script (and of tests/test_image.py):
#   - the OCI runtime: runc when installed (crun refuses hybrid cgroup v1/v2 hosts),
#   - the cgroup manager: cgroupfs when systemd is not running,
#   - default_ulimits: podman's defaults as root (RLIMIT_NOFILE 1048576, RLIMIT_NPROC 4194304) can
#     exceed the host's hard limits, and a container then fails to start ("error setting rlimit
#     type 6/7: operation not permitted"); they are capped at `ulimit -H` (and NPROC at pid_max).
#
# Environment: ELASTIC_CTR_IMAGE_CACHE (where containers.conf goes; default ~/.cache/elastic-ctr-image),
# ELASTIC_CTR_OCI_RUNTIME (force a runtime), ELASTIC_CTR_DEBIAN_MIRROR (default http://deb.debian.org).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

# The Dockerfile's default base; the bootstrapped one is the same Debian release and Python.
upstream_base="python:3.11-slim-bookworm"
suite="bookworm"
python_version="3.11"

usage() {
  cat <<EOF
usage: $0 [--tag NAME:TAG] [--hadoop VERSION] [--base IMAGE | --bootstrap] [--containers-conf]
  --tag NAME:TAG      image name (default elastic-ctr:VERSION from setup.cfg)
  --hadoop VERSION    add Java and Hadoop's libhdfs for hdfs:// data (downloads Hadoop in the build)
  --base IMAGE        build FROM this image (same Debian release and Python as $upstream_base)
  --bootstrap         bootstrap the base with mmdebstrap even when a registry is reachable
  --containers-conf   write the containers.conf for this host, print its path and exit
EOF
}

version="$(sed -n 's/^version *= *//p' setup.cfg | head -n 1)"
tag="elastic-ctr:${version}"
hadoop=""
base=""
bootstrap=0
conf_only=0
while [ $# -gt 0 ]; do
  case "$1" in
    --tag) tag="${2:?--tag needs NAME:TAG}"; shift 2 ;;
    --hadoop) hadoop="${2:?--hadoop needs a Hadoop version, e.g. 3.3.6}"; shift 2 ;;
    --base) base="${2:?--base needs an image}"; shift 2 ;;
    --bootstrap) bootstrap=1; shift ;;
    --containers-conf) conf_only=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "build-image: unknown argument $1" >&2; usage >&2; exit 2 ;;
  esac
done

say() { echo "build-image: $*" >&2; }

if ! command -v podman >/dev/null 2>&1; then
  say "podman not available (Debian: apt-get install -y podman runc mmdebstrap)"
  exit 3
fi

# --- containers.conf for this host ------------------------------------------------------------
cache="${ELASTIC_CTR_IMAGE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/elastic-ctr-image}"
mkdir -p "$cache"
conf="$cache/containers.conf"
runtime="${ELASTIC_CTR_OCI_RUNTIME:-}"
if [ -z "$runtime" ] && command -v runc >/dev/null 2>&1; then
  runtime=runc
fi
# "NAME=SOFT:HARD" for ulimit's option $1 (NAME $2), capped at this host's hard limit and at $3 if
# given (nothing when unlimited).
ulimit_within_host() {
  local hard soft
  hard="$(ulimit -H"$1")"
  soft="$(ulimit -S"$1")"
  if [ "$hard" = unlimited ]; then
    return
  fi
  if [ -n "${3:-}" ] && [ "$hard" -gt "$3" ]; then
    hard="$3"
  fi
  if [ "$soft" = unlimited ] || [ "$soft" -gt "$hard" ]; then
    soft="$hard"
  fi
  printf '"%s=%s:%s"' "$2" "$soft" "$hard"
}
limits="$(ulimit_within_host n nofile)"
# Measured: runc could not set an RLIMIT_NPROC above the kernel's pid_max (conmon's own limit) here.
nproc="$(ulimit_within_host u nproc "$(cat /proc/sys/kernel/pid_max 2>/dev/null || echo 4194304)")"
if [ -n "$nproc" ]; then
  limits="${limits:+$limits, }$nproc"
fi
{
  echo "# Written by scripts/build-image.sh for this host; CONTAINERS_CONF points podman here."
  echo "[containers]"
  if [ -n "$limits" ]; then
    echo "default_ulimits = [$limits]"
  fi
  echo "[engine]"
  if [ -n "$runtime" ]; then
    echo "runtime = \"$runtime\""
  fi
  if [ ! -d /run/systemd/system ]; then
    echo "cgroup_manager = \"cgroupfs\""
    echo "events_logger = \"file\""
  fi
} > "$conf.tmp"
mv "$conf.tmp" "$conf"
export CONTAINERS_CONF="$conf"
if [ "$conf_only" = 1 ]; then
  echo "$conf"
  exit 0
fi

# --- the base ---------------------------------------------------------------------------------
registry_reachable() {
  # 401 (authentication required) means the registry answers.
  local code
  code="$(curl -s -o /dev/null -m 8 -w '%{http_code}' https://registry-1.docker.io/v2/ 2>/dev/null || true)"
  [ "$code" != 000 ] && [ -n "$code" ]
}

mirror="${ELASTIC_CTR_DEBIAN_MIRROR:-http://deb.debian.org}"
# What the bootstrapped base holds; its hash names the base, so a change bootstraps a new one.
packages="python3,python3-venv,ca-certificates,libgomp1"
recipe="minbase $suite $packages $mirror"
bootstrap_base() {
  local name
  name="localhost/elastic-ctr-base:${suite}-py${python_version}-$(printf '%s' "$recipe" | sha256sum | cut -c1-12)"
  if podman image exists "$name"; then
    say "reusing the bootstrapped base $name" >&2
    echo "$name"
    return
  fi
  if ! command -v mmdebstrap >/dev/null 2>&1; then
    say "no registry reachable and mmdebstrap not installed (Debian: apt-get install -y mmdebstrap)"
    exit 3
  fi
  say "no registry: bootstrapping $suite (minbase + $packages) with mmdebstrap"
  local start=$SECONDS
  # Documentation and man pages left out, as in the python:slim images (the dpkg filter stays in
  # the base, so packages the Dockerfile installs leave them out too).
  mmdebstrap --variant=minbase --include="$packages" --quiet \
      --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright' \
      --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/info/*' \
      --dpkgopt='path-exclude=/usr/share/locale/*' \
      "$suite" - \
      "deb $mirror/debian $suite main" \
      "deb $mirror/debian $suite-updates main" \
      "deb $mirror/debian-security $suite-security main" \
    | podman import --change 'ENV LANG=C.UTF-8' --change 'CMD ["python3"]' - "$name" >/dev/null
  local found
  found="$(podman run --rm --network none "$name" python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])' || true)"
  if [ "$found" != "$python_version" ]; then
    podman rmi "$name" >/dev/null 2>&1 || true
    say "the bootstrapped base has Python ${found:-(it did not start)}, the Dockerfile's base $python_version"
    exit 1
  fi
  say "bootstrapped $name in $((SECONDS - start)) s"
  echo "$name"
}

if [ -z "$base" ]; then
  if podman image exists "$upstream_base" && [ "$bootstrap" = 0 ]; then
    base="$upstream_base"
  elif [ "$bootstrap" = 0 ] && registry_reachable; then
    base="$upstream_base"
  else
    base="$(bootstrap_base)"
  fi
fi

# --- the build --------------------------------------------------------------------------------
build=(podman build --layers --tag "$tag" --file Dockerfile
       --build-arg "BASE=$base" --label "org.opencontainers.image.version=$version")
if [ -n "$hadoop" ]; then
  build+=(--build-arg "HADOOP_VERSION=$hadoop")
fi
ca_bundle=""
for candidate in "${SSL_CERT_FILE:-}" /etc/ssl/certs/ca-certificates.crt /etc/pki/tls/certs/ca-bundle.crt; do
  if [ -n "$candidate" ] && [ -s "$candidate" ]; then
    ca_bundle="$candidate"
    break
  fi
done
if [ -n "$ca_bundle" ]; then
  build+=(--secret "id=ca-bundle,src=$ca_bundle")
fi

say "building $tag from $base"
start=$SECONDS
"${build[@]}" .
bytes="$(podman image inspect --format '{{.Size}}' "$tag")"
say "built $tag in $((SECONDS - start)) s"
echo "$tag $((bytes / 1000000)) MB"
