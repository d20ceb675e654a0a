#!/usr/bin/env bash
# Make uv available and print the command that runs it (`uv`, or `python3 -m uv`) on stdout.
# Used by `make` and .ci/run. A uv older than UV_MIN_VERSION is not used: uv 0.4 installed PyPI's
# CUDA torch from the lock without its nvidia libraries, and compiled CUDA pins into the lock.
# Missing or too old, uv is installed with pip at UV_VERSION, the release the locks are made with.
# Debian-family Pythons refuse pip installs outside a venv (PEP 668,
# "externally-managed-environment"): then uv goes to the user's site (~/.local), which touches no
# system package. Without pip at all, it says how to get uv instead.
set -euo pipefail

UV_MIN_VERSION=0.5.0
UV_VERSION=0.13.9

# True when "$@ --version" runs and reports at least UV_MIN_VERSION.
recent_enough() {
  local version
  version="$("$@" --version 2>/dev/null | awk '{print $2}')" || return 1
  [[ "$version" =~ ^[0-9]+\.[0-9]+ ]] \
    && [[ "$(printf '%s\n' "$UV_MIN_VERSION" "$version" | sort -V | head -n1)" == "$UV_MIN_VERSION" ]]
}

if command -v uv >/dev/null 2>&1 && recent_enough uv; then
  echo uv
  exit 0
fi
if recent_enough python3 -m uv; then
  echo "python3 -m uv"
  exit 0
fi
if ! python3 -m pip --version >/dev/null 2>&1; then
  echo "error: uv $UV_MIN_VERSION or newer is missing and python3 has no pip to install it: install uv" \
    "(https://docs.astral.sh/uv/getting-started/installation/) or pip (Debian/Ubuntu: apt install python3-pip)" >&2
  exit 1
fi
echo "installing uv $UV_VERSION with pip (none found, or older than $UV_MIN_VERSION)" >&2
python3 -m pip install --quiet "uv==$UV_VERSION" >&2 2>/dev/null \
  || python3 -m pip install --quiet --user --break-system-packages "uv==$UV_VERSION" >&2 \
  || { echo "error: pip could not install uv $UV_VERSION; install it by hand" \
         "(https://docs.astral.sh/uv/getting-started/installation/)" >&2; exit 1; }
recent_enough python3 -m uv || { echo "error: uv $UV_VERSION was installed, but python3 -m uv does not run it" >&2; exit 1; }
echo "python3 -m uv"
