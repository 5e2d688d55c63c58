#!/usr/bin/env bash
# Idempotent machine + venv setup for fsdp-sentinel (Debian 12, run as root).
#
# Why each step exists:
#  - bcc comes from Debian (python3-bpfcc): PyPI's "bcc" is an unrelated package.
#  - bcc compiles probes at load time and needs kernel headers. When the running
#    kernel has none we install Debian's nearest linux-headers package and link
#    it in. Our probes read only tracepoint/uprobe arguments, so the (possibly
#    mismatched) struct layouts in those headers are never used for offsets.
#  - The venv must see Debian's bcc module but nothing else of the system
#    site-packages, so a .pth file points at a folder holding one symlink.
#  - torch==2.13.0 is installed first: it is a CPU build on local disk, while an
#    unpinned torch would pull a multi-GB CUDA build.
# A second run installs nothing: every step checks before it acts.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=$ROOT/.venv
PY=${PYTHON:-python3}

say() { echo "setup: $*"; }

if [ "$(id -u)" != 0 ]; then
    say "needs root (apt-get, tracefs, headers); run as root" >&2
    exit 1
fi

# --- Debian packages ------------------------------------------------------
DEB_PKGS=(python3-bpfcc libbpfcc bpfcc-tools iproute2 iputils-ping gcc make libibverbs1 chromium prometheus zstd procps shellcheck systemd)
missing=()
for p in "${DEB_PKGS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
KREL=$(uname -r)
if [ ! -e "/lib/modules/$KREL/build/include" ]; then
    if ! dpkg-query -W -f='${Status}' linux-headers-cloud-amd64 2>/dev/null | grep -q "install ok installed"; then
        missing+=(linux-headers-cloud-amd64)
    fi
fi
if [ ${#missing[@]} -gt 0 ]; then
    say "installing Debian packages: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    if ! apt-get install -y -qq --no-install-recommends "${missing[@]}" >/tmp/fsdp-sentinel-apt.log 2>&1; then
        apt-get update -qq >/dev/null
        apt-get install -y -qq --no-install-recommends "${missing[@]}" >/tmp/fsdp-sentinel-apt.log 2>&1 \
            || { cat /tmp/fsdp-sentinel-apt.log; exit 1; }
    fi
    # prometheus' Debian package starts a system service; the tests start
    # their own server on a free port. Stop only the one this install started.
    if [[ " ${missing[*]} " == *" prometheus "* ]]; then
        if command -v systemctl >/dev/null && systemctl is-active -q prometheus 2>/dev/null; then
            systemctl stop prometheus || true
        fi
        pkill -x -u prometheus prometheus 2>/dev/null || true
    fi
fi

# --- kernel headers for bcc -------------------------------------------------
if [ ! -e "/lib/modules/$KREL/build/include" ]; then
    arch_dir=$(ls -d /usr/src/linux-headers-*-cloud-amd64 2>/dev/null | sort -V | tail -1)
    common_dir=$(ls -d /usr/src/linux-headers-*-common 2>/dev/null | sort -V | tail -1)
    if [ -z "$arch_dir" ] || [ -z "$common_dir" ]; then
        say "no linux-headers found under /usr/src" >&2; exit 1
    fi
    say "kernel $KREL has no headers of its own; using $(basename "$arch_dir") for bcc (probes read tracepoint/uprobe arguments only)"
    mkdir -p "/lib/modules/$KREL"
    ln -sfn "$arch_dir" "/lib/modules/$KREL/build"
    ln -sfn "$common_dir" "/lib/modules/$KREL/source"
fi

# --- tracefs ------------------------------------------------------------------
if [ ! -e /sys/kernel/tracing/events ]; then
    mount -t tracefs tracefs /sys/kernel/tracing 2>/dev/null || true
fi
if [ ! -e /sys/kernel/debug/tracing ] && [ -d /sys/kernel/debug ]; then
    mount -t debugfs debugfs /sys/kernel/debug 2>/dev/null || true
fi

# --- venv -------------------------------------------------------------------
if [ ! -x "$VENV/bin/python" ]; then
    say "creating $VENV"
    "$PY" -m venv "$VENV"
fi
SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
BCC_SRC=$(ls -d /usr/lib/python3/dist-packages/bcc)
mkdir -p "$VENV/bcc-only"
ln -sfn "$BCC_SRC" "$VENV/bcc-only/bcc"
echo "$VENV/bcc-only" > "$SITE/debian-bcc.pth"

STAMP=$VENV/.fsdp-sentinel-installed
if [ ! -f "$STAMP" ] || [ pyproject.toml -nt "$STAMP" ]; then
    if ! "$VENV/bin/python" -c 'import torch, sys; sys.exit(torch.__version__.split("+")[0] != "2.13.0")' 2>/dev/null; then
        say "installing torch==2.13.0 (CPU build from local disk)"
        "$VENV/bin/pip" install -q torch==2.13.0
    fi
    say "installing fsdp-sentinel[dev] (editable)"
    "$VENV/bin/pip" install -q -e ".[dev]"
    touch "$STAMP"
fi
"$VENV/bin/python" -c 'import bcc' || { say "bcc does not import in the venv" >&2; exit 1; }
