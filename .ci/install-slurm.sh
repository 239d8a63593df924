#!/usr/bin/env bash
# install a single-host SLURM (slurmctld + slurmd + client tools) and munge from Debian.
# idempotent: does nothing when the daemons are already on PATH. quiet unless it fails.
set -euo pipefail

have_all() {
    local tool
    for tool in slurmctld slurmd munged sbatch srun sinfo scontrol; do
        command -v "$tool" >/dev/null 2>&1 || [ -x "/usr/sbin/$tool" ] || return 1
    done
}

if have_all; then
    exit 0
fi

if ! command -v apt-get >/dev/null 2>&1; then
    echo "install-slurm: apt-get not found; install slurm-wlm and munge by hand" >&2
    exit 1
fi

sudo=""
if [ "$(id -u)" != 0 ]; then
    if command -v sudo >/dev/null 2>&1; then sudo="sudo -n"; else
        echo "install-slurm: need root (or sudo) to apt-get install slurm-wlm munge" >&2
        exit 1
    fi
fi

export DEBIAN_FRONTEND=noninteractive
log=$(mktemp)
# the post-install scripts try to start services; there is no init in a container, so
# forbid it (policy-rc.d exit 101 = "action not allowed") and start the daemons ourselves.
policy=/usr/sbin/policy-rc.d
made_policy=0
if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' | $sudo tee "$policy" >/dev/null
    $sudo chmod +x "$policy"
    made_policy=1
fi
status=0
# two test sessions may install at once: wait for dpkg's lock instead of failing on it
apt_opts=(-o DPkg::Lock::Timeout=600 -o Dpkg::Use-Pty=0)
{
    $sudo apt-get "${apt_opts[@]}" update -qq &&
    $sudo apt-get "${apt_opts[@]}" install -y -qq --no-install-recommends slurm-wlm munge
} >"$log" 2>&1 || status=$?
if [ "$made_policy" = 1 ]; then $sudo rm -f "$policy"; fi
if [ "$status" != 0 ]; then
    echo "install-slurm: apt-get failed (exit $status); last lines:" >&2
    tail -n 20 "$log" >&2
    rm -f "$log"
    exit "$status"
fi
rm -f "$log"
have_all || { echo "install-slurm: installed, but SLURM tools are still missing" >&2; exit 1; }
