#!/usr/bin/env bash
# Make `uv` available (on PATH, or as `python3 -m uv`), installing it with pip when it is missing.
# Used by `make` and .ci/run. Debian-family Pythons refuse pip installs outside a venv
# (PEP 668, "externally-managed-environment"): then uv goes to the user's site (~/.local), which
# touches no system package. Without pip at all, it says how to get uv instead.
set -euo pipefail

if command -v uv >/dev/null 2>&1 || python3 -m uv --version >/dev/null 2>&1; then
  exit 0
fi
if ! python3 -m pip --version >/dev/null 2>&1; then
  echo "error: uv is missing and python3 has no pip to install it: install uv" \
    "(https://docs.astral.sh/uv/getting-started/installation/) or pip (Debian/Ubuntu: apt install python3-pip)" >&2
  exit 1
fi
python3 -m pip install --quiet uv 2>/dev/null \
  || python3 -m pip install --quiet --user --break-system-packages uv \
  || { echo "error: pip could not install uv; install it by hand" \
         "(https://docs.astral.sh/uv/getting-started/installation/)" >&2; exit 1; }
python3 -m uv --version >/dev/null
