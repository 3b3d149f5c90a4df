#!/usr/bin/env bash
# Creates ./.venv with the pinned dependencies (runtime, tests and tooling) and installs ElasticCTR into it
# (editable). Safe to run again: it only installs what is missing or changed.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
python="${PYTHON:-python3}"

if ! "$python" -c 'import sys; sys.exit(0 if (3, 10) <= sys.version_info[:2] < (3, 12) else 1)'; then
  echo "setup: ElasticCTR needs Python 3.10 or 3.11 (paddlepaddle 2.6.2 wheels); found $("$python" --version 2>&1)" >&2
  exit 1
fi

if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv" >&2
  "$python" -m venv .venv
fi

stamp=.venv/.elastic-ctr-installed
want="$(cat requirements.txt requirements-dev.txt setup.cfg | sha256sum | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "setup: installing pinned dependencies (a few minutes the first time)" >&2
  .venv/bin/python -m pip install -q --disable-pip-version-check -r requirements-dev.txt
  .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps -e .
  echo "$want" > "$stamp"
fi

# Redis is the peer the cube benchmark (and its tests) measure against; h2load (nghttp2-client) is the C gRPC
# load generator of the serving benchmark.
if ! command -v redis-server >/dev/null 2>&1 || ! command -v h2load >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "setup: installing redis-server and nghttp2-client (benchmark peer, gRPC load generator)" >&2
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server nghttp2-client >/dev/null) \
      || echo "setup: warning: could not install redis-server/nghttp2-client; the benchmarks will skip them" >&2
  fi
fi
# podman, runc and mmdebstrap build and run the container image (tests/test_image.py; scripts/build-image.sh).
if ! command -v podman >/dev/null 2>&1 || ! command -v runc >/dev/null 2>&1 || ! command -v mmdebstrap >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "setup: installing podman, runc and mmdebstrap (the image tests)" >&2
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq podman runc mmdebstrap >/dev/null) \
      || echo "setup: warning: could not install podman; the image tests will skip" >&2
  fi
fi
# nft enforces NetworkPolicies on the pod harness's direct pod-to-pod connections (tests/pod_harness/network.py).
if ! command -v nft >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "setup: installing nftables (the pod harness)" >&2
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nftables >/dev/null) \
      || echo "setup: warning: could not install nftables; the pod harness tests will skip" >&2
  fi
fi
# promtool (Debian's prometheus package) checks the rendered alert rules and runs their unit tests
# (tests/test_kube_monitoring.py); the Prometheus server the package also holds is not used.
if ! command -v promtool >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "setup: installing prometheus (promtool, the alert rules' tests)" >&2
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null) \
      || echo "setup: warning: could not install prometheus; the promtool tests will skip" >&2
  fi
fi
echo "setup: ready (.venv)" >&2
