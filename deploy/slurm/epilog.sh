#!/bin/bash
# Slurm Epilog (slurm.conf: Epilog=/etc/slurm/fsdp-sentinel-epilog.sh).
# Stops this job's fsdp-sentinel daemon: SIGTERM lets it do its own cleanup
# (undo any tc change, detach the probes, flush the trace, remove its
# socket); after FSDP_SENTINEL_STOP_TIMEOUT seconds it is killed, and the next
# daemon on the node restores any tc state it left from its state file. Then
# the job's folder goes: nothing of the job is left on the node but its trace.
set -u

conf=${FSDP_SENTINEL_CONF:-/etc/default/fsdp-sentinel-slurm}
FSDP_SENTINEL_RUN_DIR=/run/fsdp-sentinel
FSDP_SENTINEL_STOP_TIMEOUT=20
# shellcheck source-path=SCRIPTDIR source=fsdp-sentinel.env
[ -r "$conf" ] && . "$conf"

log() { logger -t fsdp-sentinel-epilog -- "job ${SLURM_JOB_ID:-?}: $*" 2>/dev/null || echo "fsdp-sentinel-epilog: $*" >&2; }

job=${SLURM_JOB_ID:?SLURM_JOB_ID is not set: run as a Slurm Epilog}
case $job in *[!0-9_]*) exit 0 ;; esac
dir=$FSDP_SENTINEL_RUN_DIR/job-$job
[ -d "$dir" ] || exit 0

pid=$(cat "$dir/daemon.pid" 2>/dev/null || true)
# Only our daemon: the pid must still be an fsdp-sentinel run on this job's socket.
if [ -n "$pid" ] && grep -qa -- "$dir/ingest.sock" "/proc/$pid/cmdline" 2>/dev/null; then
    kill -TERM "$pid"
    for _ in $(seq 1 $((FSDP_SENTINEL_STOP_TIMEOUT * 10))); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.1
    done
    if kill -0 "$pid" 2>/dev/null; then
        log "daemon $pid still running after ${FSDP_SENTINEL_STOP_TIMEOUT}s: killed"
        kill -KILL "$pid"
    fi
fi
rm -rf -- "$dir"
exit 0
