#!/usr/bin/env bash
# Fill the chart's crds/ with the pinned Trainer release's CRDs and its charts/ with the JobSet and
# LWS subcharts: what `helm install` and `helm package` use. Neither is committed.
#
# With network: download the CRDs of the Trainer release named by `appVersion` in Chart.yaml and
# check each against the sha256 sum recorded below; `helm dependency update` fetches the subcharts
# (through the venv's helm_python, or the helm CLI where there is no venv: an admin needs no Python).
# Offline (or when a download fails): copy the same files from ../shared and say so. A download
# whose sum does not match is an error, never a silent fallback.
#
# Env: CHART_DIR (default charts/kubeflow-trainer), SHARED_DIR (default ../shared),
#      TRAINER_CRDS_URL (default the release's raw GitHub folder), OFFLINE=1 (skip the network),
#      PY (default .venv/bin/python).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CHART_DIR=${CHART_DIR:-$ROOT/charts/kubeflow-trainer}
SHARED_DIR=${SHARED_DIR:-$ROOT/../shared}
PY=${PY:-$ROOT/.venv/bin/python}
CURL_TIMEOUT_SECONDS=60

# The one Trainer version: Chart.yaml's appVersion.
TRAINER_VERSION=$(awk '/^appVersion:/ {gsub(/["\047]/, "", $2); print $2}' "$CHART_DIR/Chart.yaml")
if [[ -z "$TRAINER_VERSION" ]]; then
  echo "error: no appVersion in $CHART_DIR/Chart.yaml" >&2
  exit 1
fi
TRAINER_CRDS_URL=${TRAINER_CRDS_URL:-https://raw.githubusercontent.com/kubeflow/trainer/$TRAINER_VERSION/manifests/base/crds}

# Recorded sums: "<trainer version> <file> <sha256>". A version bump needs its three lines here.
SUMS="
v2.1.0 trainer.kubeflow.org_clustertrainingruntimes.yaml be1a629914db7bef3b4f864be82a0bfcb7ab5fb8e2fd58542de024b9f5f559f0
v2.1.0 trainer.kubeflow.org_trainingruntimes.yaml bcf07e6094259d389a00d84013e7723b975570373ee00f07dc5faec7b002f155
v2.1.0 trainer.kubeflow.org_trainjobs.yaml 65ea8f95f298103275e00b690bda5e090355f7eb5d6e4d15236b557f088b8078
"
# A read loop, not mapfile: macOS's /bin/bash is 3.2.
FILES=()
while IFS= read -r f; do FILES+=("$f"); done < <(awk -v v="$TRAINER_VERSION" '$1 == v {print $2}' <<<"$SUMS")
if [[ ${#FILES[@]} -eq 0 ]]; then
  echo "error: no sha256 sums recorded for Trainer $TRAINER_VERSION in $0; add its CRD files and sums" >&2
  exit 1
fi

expected_sum() { awk -v v="$TRAINER_VERSION" -v f="$1" '$1 == v && $2 == f {print $3}' <<<"$SUMS"; }

check_sum() { # file, name-for-messages
  local got want
  if command -v sha256sum >/dev/null; then
    got=$(sha256sum "$1" | cut -d' ' -f1)
  else # macOS
    got=$(shasum -a 256 "$1" | cut -d' ' -f1)
  fi
  want=$(expected_sum "$(basename "$1")")
  if [[ "$got" != "$want" ]]; then
    echo "error: $2 has sha256 $got, expected $want (recorded in $0)" >&2
    return 1
  fi
}

staging=$(mktemp -d)
trap 'rm -rf "$staging"' EXIT

source_used=""
if [[ "${OFFLINE:-0}" != 1 ]] && command -v curl >/dev/null; then
  source_used="$TRAINER_CRDS_URL"
  for f in "${FILES[@]}"; do
    if ! curl -fsSL --max-time "$CURL_TIMEOUT_SECONDS" -o "$staging/$f" "$TRAINER_CRDS_URL/$f" 2>"$staging/curl.err"; then
      echo "download of $TRAINER_CRDS_URL/$f failed ($(head -c 200 "$staging/curl.err")); falling back to $SHARED_DIR" >&2
      source_used=""
      break
    fi
    check_sum "$staging/$f" "$TRAINER_CRDS_URL/$f"
  done
fi

if [[ -z "$source_used" ]]; then
  shared_crds="$SHARED_DIR/crds/trainer-$TRAINER_VERSION"
  if [[ ! -d "$shared_crds" ]]; then
    echo "error: offline and no pinned copy at $shared_crds" >&2
    exit 1
  fi
  source_used="$shared_crds (offline copy)"
  for f in "${FILES[@]}"; do
    cp "$shared_crds/$f" "$staging/$f"
    check_sum "$staging/$f" "$shared_crds/$f"
  done
fi

rm -rf "$CHART_DIR/crds"
mkdir -p "$CHART_DIR/crds"
for f in "${FILES[@]}"; do cp "$staging/$f" "$CHART_DIR/crds/$f"; done
echo "crds: Trainer $TRAINER_VERSION from $source_used -> $CHART_DIR/crds/ (${#FILES[@]} files, sha256 checked)"

if [[ -x "$PY" ]]; then
  deps_flag=--network
  [[ "${OFFLINE:-0}" == 1 ]] && deps_flag=""
  SHARED_DIR="$SHARED_DIR" "$PY" "$ROOT/hack/helm.py" deps $deps_flag "$CHART_DIR" | sed 's/^/subcharts: /'
else
  # No venv (an admin's machine): the helm CLI fetches the pinned subcharts; offline, without
  # helm, or when helm fails, the same packages are copied from $SHARED_DIR/charts.
  if [[ "${OFFLINE:-0}" != 1 ]] && command -v helm >/dev/null 2>&1 &&
    helm dependency build "$CHART_DIR" 2>"$staging/helm.err" | sed 's/^/subcharts: /'; then
    exit 0
  fi
  if [[ -s "$staging/helm.err" ]]; then
    echo "helm dependency build failed ($(head -c 300 "$staging/helm.err")); falling back to $SHARED_DIR/charts" >&2
  fi
  # "<name>-<version>.tgz" for each entry under Chart.yaml's dependencies.
  packages=$(awk '/^dependencies:/ {on = 1; next} on && /^[^ #]/ {on = 0}
    on && $1 == "-" && $2 == "name:" {name = $3} on && $1 == "version:" {print name "-" $2 ".tgz"}' "$CHART_DIR/Chart.yaml")
  mkdir -p "$CHART_DIR/charts"
  for package in $packages; do
    if [[ -f "$CHART_DIR/charts/$package" ]]; then
      continue
    fi
    if [[ ! -f "$SHARED_DIR/charts/$package" ]]; then
      echo "error: subchart $package is in neither $CHART_DIR/charts nor $SHARED_DIR/charts: put the helm CLI" \
        "on PATH (with network), or build the development venv (\`make setup\`)" >&2
      exit 1
    fi
    cp "$SHARED_DIR/charts/$package" "$CHART_DIR/charts/$package"
    echo "subcharts: copied $SHARED_DIR/charts/$package (offline copy)"
  done
fi
