#!/usr/bin/env bash
# Build the e2e images (cache, initializer, trainer-e2e) and load them into the kind cluster.
#
#   hack/e2e-images.sh build   docker build the three images
#   hack/e2e-images.sh load    kind load docker-image each into $KIND_CLUSTER_NAME (an archive
#                              of one platform where that fails, as on Docker 29's image store)
#   hack/e2e-images.sh all     both
#   hack/e2e-images.sh list    print the image references, one per line
#
# Env: IMAGE_REGISTRY (kind.local/kubeflow-data-cache), IMAGE_TAG (e2e),
#      KIND_CLUSTER_NAME (kubeflow-data-cache-e2e), KIND (kind), DOCKER (docker).
# The defaults match tests/e2e/e2e_objects.py; a test checks they agree.
set -euo pipefail
cd "$(dirname "$0")/.."

REGISTRY="${IMAGE_REGISTRY:-kind.local/kubeflow-data-cache}"
TAG="${IMAGE_TAG:-e2e}"
CLUSTER="${KIND_CLUSTER_NAME:-kubeflow-data-cache-e2e}"
KIND="${KIND:-kind}"
DOCKER="${DOCKER:-docker}"

CACHE="$REGISTRY/cache:$TAG"
INITIALIZER="$REGISTRY/initializer:$TAG"
TRAINER="$REGISTRY/trainer-e2e:$TAG"

list() {
  printf '%s\n' "$CACHE" "$INITIALIZER" "$TRAINER"
}

# A buildx builder of the docker-container driver (`docker buildx use ...`) keeps what it builds
# to itself unless told to load it: the trainer image's FROM the cache image then went to a
# registry that does not exist, and `kind load` found nothing. Said at once instead.
in_local_store() {
  if ! "$DOCKER" image inspect "$1" >/dev/null 2>&1; then
    echo "error: $1 was built but is not in Docker's local image store: the active buildx builder" \
      "keeps its images (see \`docker buildx ls\`); run \`docker buildx use default\` and build again" >&2
    exit 1
  fi
}

build() {
  "$DOCKER" build --tag "$CACHE" images/cache
  in_local_store "$CACHE"
  "$DOCKER" build --tag "$INITIALIZER" images/initializer
  in_local_store "$INITIALIZER"
  # The trainer image starts from the cache image just built (its venv, its lock).
  "$DOCKER" build --tag "$TRAINER" --build-arg "CACHE_IMAGE=$CACHE" images/trainer-e2e
  in_local_store "$TRAINER"
}

load() {
  local image archive arch workers api platform
  # The workers only: the control plane is tainted, and each copy there is a GB of disk for nothing.
  workers="$("$KIND" get nodes --name "$CLUSTER" | grep -v -- '-control-plane$' | paste -sd, - || true)"
  local where=(--name "$CLUSTER")
  [[ -n "$workers" ]] && where+=(--nodes "$workers")
  for image in $(list); do
    if "$KIND" load docker-image "${where[@]}" "$image"; then
      continue
    fi
    # Docker 29's containerd image store can make `kind load docker-image` fail with "content
    # digest ... not found" (kubernetes-sigs/kind#3795): the saved index names platforms whose
    # layers are not there. One platform saved to an archive loads.
    echo "kind load docker-image failed for $image; retrying with a single-platform archive" >&2
    arch="$("$DOCKER" version --format '{{.Server.Arch}}')"
    archive="$(mktemp "${TMPDIR:-/tmp}/e2e-image.XXXXXX")"
    # A GB or more: removed whether or not the load works.
    # `image save --platform` came with Docker 28 (API 1.48); an older CLI or engine has no such
    # flag, and no containerd image store to need it: it saves the one platform it has. The
    # client's API version is the one client and engine agreed on.
    platform=(--platform "linux/$arch")
    api="$("$DOCKER" version --format '{{.Client.APIVersion}}' 2>/dev/null || true)"  # 1.48, say
    if [[ $api =~ ^1\.([0-9]+)$ ]] && (( 10#${BASH_REMATCH[1]} < 48 )); then
      platform=()
    fi
    # ${a[@]+"${a[@]}"}: an empty array under `set -u` is an unbound variable to bash before 4.4
    # (macOS's /bin/bash is 3.2).
    if ! { "$DOCKER" image save ${platform[@]+"${platform[@]}"} --output "$archive" "$image" &&
      "$KIND" load image-archive "${where[@]}" "$archive"; }; then
      rm -f "$archive"
      echo "error: loading $image into kind cluster $CLUSTER failed" >&2
      exit 1
    fi
    rm -f "$archive"
  done
}

case "${1:-}" in
  build) build ;;
  load) load ;;
  all) build && load ;;
  list) list ;;
  *)
    echo "usage: $0 build|load|all|list" >&2
    exit 2
    ;;
esac
