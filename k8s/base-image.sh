#!/usr/bin/env bash
# A base image for k8s/Dockerfile.* made from Debian's packages alone, for machines that reach a
# Debian mirror but no container registry. It has what the Dockerfiles expect of Ray's images
# (rayproject/ray): the user `ray` (uid 1000, group users) with home /home/ray, a Python 3.11
# whose `pip` that user can install into (a venv at /home/ray/venv, first on PATH), and a C
# compiler (radixray's CPU kernels compile at first use). It has no Ray: the Dockerfiles install
# `ray[serve]==RAY_VERSION` from the package registry.
#
#   k8s/base-image.sh [TAG]          (default radixray-base:bookworm; needs root, mmdebstrap, podman)
#
# DEBIAN_MIRROR picks the mirror (default: the first one in this machine's apt sources, else
# deb.debian.org). Any other base works as well: see k8s/README.md, "Build the image".
set -euo pipefail

tag="${1:-radixray-base:bookworm}"
suite="${DEBIAN_SUITE:-bookworm}"     # bookworm's python3 is 3.11, as Ray's py311 images
mirror="${DEBIAN_MIRROR:-}"
if [ -z "$mirror" ]; then
    mirror="$(grep -hoE '^URIs: *[^ ]+' /etc/apt/sources.list.d/*.sources 2>/dev/null \
              | head -n1 | awk '{print $2}')"
    mirror="${mirror:-http://deb.debian.org/debian}"
fi
for tool in mmdebstrap podman; do
    command -v "$tool" >/dev/null || { echo "base-image: $tool is not installed" >&2; exit 1; }
done

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

mmdebstrap --variant=minbase --mode=root \
    --include=python3,python3-venv,python3-pip,python3-dev,ca-certificates,gcc,libc6-dev,procps \
    --customize-hook='chroot "$1" useradd --create-home --uid 1000 --gid users --shell /bin/bash ray' \
    --customize-hook='chroot "$1" runuser -u ray -- python3 -m venv /home/ray/venv' \
    --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*' \
    "$suite" "$work/rootfs.tar" "$mirror"

podman import \
    --change 'USER=ray' \
    --change 'WORKDIR=/home/ray' \
    --change 'ENV=PATH=/home/ray/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV=VIRTUAL_ENV=/home/ray/venv' \
    --change 'ENV=LANG=C.UTF-8' \
    --change 'CMD=["/bin/bash"]' \
    "$work/rootfs.tar" "$tag"
podman image ls "$tag"
