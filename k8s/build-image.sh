#!/usr/bin/env bash
# Builds k8s/Dockerfile.<flavour> with podman, from the repository root:
#
#   k8s/build-image.sh cpu|cuda [podman build flags...]      (tag: radixray:<flavour>)
#
# BASE_IMAGE   the base (default: the Dockerfile's, Ray's image). Set BASE_IMAGE=debian to
#              build on a base made from Debian's packages (k8s/base-image.sh; made if absent),
#              for machines that reach no container registry.
# IMAGE        the tag (default radixray:<flavour>).
# TORCH_INDEX_URL, BUILTIN_MODELS, VLLM_VERSION   passed on as build arguments when set.
#
# pip inside the build uses this machine's pip configuration (`pip config list`: index URLs,
# wheel folders, certificate, constraints), written to a pip.conf that is mounted, with the local
# folders and files it names, into each build step only: nothing of it is stored in the image.
# The build steps use the host's network (`--network host`).
set -euo pipefail
cd "$(dirname "$0")/.."

flavour="${1:?usage: k8s/build-image.sh cpu|cuda [podman build flags...]}"
shift
dockerfile="k8s/Dockerfile.$flavour"
[ -f "$dockerfile" ] || { echo "build-image: no $dockerfile" >&2; exit 1; }
command -v podman >/dev/null || { echo "build-image: podman is not installed" >&2; exit 1; }
image="${IMAGE:-radixray:$flavour}"

args=()
if [ "${BASE_IMAGE:-}" = debian ]; then
    base=radixray-base:bookworm
    podman image exists "$base" || k8s/base-image.sh "$base"
    args+=(--build-arg "BASE_IMAGE=localhost/$base")
elif [ -n "${BASE_IMAGE:-}" ]; then
    args+=(--build-arg "BASE_IMAGE=$BASE_IMAGE")
fi
for name in TORCH_INDEX_URL BUILTIN_MODELS VLLM_VERSION; do
    if [ -n "${!name:-}" ]; then args+=(--build-arg "$name=${!name}"); fi
done

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
# The pip settings in force here (environment over user over site-wide files), as one [global]
# section, and a bind mount (read-only, same path) for each local file or folder they name.
python3 - "$work/pip.conf" "$flavour" > "$work/mounts" <<'PY'
import os, subprocess, sys

out, flavour = sys.argv[1], sys.argv[2]
listing = subprocess.run([sys.executable, "-m", "pip", "config", "list"],
                         capture_output=True, text=True).stdout
files, env = {}, {}
for line in listing.splitlines():
    key, sep, value = line.partition("=")
    if sep and "." in key:
        scope, name = key.split(".", 1)
        (env if scope == ":env:" else files)[name] = value.strip().strip("'\"")
settings = {**files, **env}
if flavour == "cuda":
    # wheel folders on a build machine may hold CPU builds of torch, which `torch==X` also
    # matches: the CUDA image takes its torch from the index only.
    settings.pop("find-links", None)
mounts = set()
with open(out, "w") as f:
    f.write("[global]\n")
    for name, value in sorted(settings.items()):
        f.write(f"{name} = {value}\n")
        for word in value.split():
            path = word.removeprefix("file://").rstrip("/")
            if word.startswith("file://") and path.endswith("/simple"):
                path = os.path.dirname(path)  # a local index's pages link to files beside it
            if path.startswith("/") and os.path.exists(path):
                mounts.add(os.path.realpath(path) if os.path.islink(path) else path)
for path in sorted(mounts):
    print(f"{path}:{path}:ro")
PY
args+=(--volume "$work/pip.conf:/etc/pip.conf:ro")
args+=(--build-arg "PIP_SETTINGS=$(sha256sum "$work/pip.conf" | cut -c1-16)")
while read -r mount; do args+=(--volume "$mount"); done < "$work/mounts"

start=$(date +%s)
podman build --network host -f "$dockerfile" -t "$image" "${args[@]}" "$@" .
echo "build-image: $image built in $(( $(date +%s) - start )) s;" \
     "size $(podman image inspect "$image" --format '{{.Size}}') bytes"
