#!/usr/bin/env bash
# Compatibility shim for the original elastic-control.sh: same flags, now the
# Python CLI. Uses the project's .venv when present, else the current python3.
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [ -x "$here/.venv/bin/python" ]; then
  exec "$here/.venv/bin/python" -m elastic_control "$@"
fi
exec "${PYTHON:-python3}" -m elastic_control "$@"
