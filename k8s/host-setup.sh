#!/usr/bin/env bash
# Prepares a Debian machine (as root) to build and run the images and the GCS fault-tolerance
# benchmark: podman, runc, mmdebstrap (k8s/base-image.sh) and redis-server
# (bench/gcs_restart.py), each installed with apt only where it is missing. On a host whose
# kernel or sandbox crun cannot use (cgroup v1/v2 hybrid mounts, or no CAP_SYS_RESOURCE so that
# containers cannot raise their rlimits), it also makes podman use runc with cgroupfs and the
# host's own limits, in /etc/containers/containers.conf.d/50-radixray.conf. CI runs it.
set -euo pipefail

missing=()
command -v podman >/dev/null || missing+=(podman)
command -v runc >/dev/null || missing+=(runc)
command -v mmdebstrap >/dev/null || missing+=(mmdebstrap)
command -v redis-server >/dev/null || missing+=(redis-server)
if [ "${#missing[@]}" -gt 0 ]; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q >/dev/null
    apt-get install -y -q --no-install-recommends "${missing[@]}" uidmap slirp4netns \
        netavark aardvark-dns fuse-overlayfs >/dev/null
fi
# the redis-server package starts a system service on 6379; nothing here uses it
if command -v systemctl >/dev/null && systemctl is-active -q redis-server 2>/dev/null; then
    systemctl disable --now redis-server >/dev/null 2>&1 || true
fi

cap_eff=$(awk '/^CapEff/ {print $2}' /proc/self/status)
has_sys_resource=$(( (16#$cap_eff >> 24) & 1 ))
if [ -d /sys/fs/cgroup/unified ] || [ "$has_sys_resource" = 0 ]; then
    mkdir -p /etc/containers/containers.conf.d
    cat > /etc/containers/containers.conf.d/50-radixray.conf <<CONF
# written by k8s/host-setup.sh: crun cannot run containers on this host
[containers]
default_ulimits = ["nofile=$(ulimit -Hn):$(ulimit -Hn)", "nproc=4096:4096"]
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
CONF
fi
