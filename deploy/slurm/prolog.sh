#!/bin/bash
# Slurm Prolog (slurm.conf: Prolog=/etc/slurm/fsdp-sentinel-prolog.sh, with
# PrologFlags=Alloc so it runs on every node of the allocation at its start).
# Starts one fsdp-sentinel node daemon for this job, keyed by SLURM_JOB_ID,
# with exactly CAP_BPF, CAP_PERFMON and CAP_NET_ADMIN (not full root), and
# waits until its socket is up. epilog.sh stops it; task-prolog.sh points the
# job's ranks at its socket. A failure here never fails the job: it logs and
# exits 0 (training goes on without the daemon).
set -u

conf=${FSDP_SENTINEL_CONF:-/etc/default/fsdp-sentinel-slurm}
FSDP_SENTINEL_BIN=/opt/fsdp-sentinel/bin/fsdp-sentinel
FSDP_SENTINEL_RUN_DIR=/run/fsdp-sentinel
FSDP_SENTINEL_TRACE_DIR=/var/log/fsdp-sentinel
FSDP_SENTINEL_METRICS_ADDR=0.0.0.0:18965
FSDP_SENTINEL_REMEDIATE=dry-run
# shellcheck source-path=SCRIPTDIR source=fsdp-sentinel.env
[ -r "$conf" ] && . "$conf"

log() { logger -t fsdp-sentinel-prolog -- "job ${SLURM_JOB_ID:-?}: $*" 2>/dev/null || echo "fsdp-sentinel-prolog: $*" >&2; }

job=${SLURM_JOB_ID:?SLURM_JOB_ID is not set: run as a Slurm Prolog}
case $job in *[!0-9_]*) log "odd SLURM_JOB_ID, not starting"; exit 0 ;; esac
dir=$FSDP_SENTINEL_RUN_DIR/job-$job
if ! { mkdir -p "$dir" && chmod 0750 "$dir"; }; then
    log "cannot make $dir"
    exit 0
fi
# The job's own group may send to the socket (the daemon makes it 0660).
[ -n "${SLURM_JOB_GID:-}" ] && chgrp "$SLURM_JOB_GID" "$dir"

args=(run --socket "$dir/ingest.sock" --remediate "$FSDP_SENTINEL_REMEDIATE")
if [ -n "$FSDP_SENTINEL_TRACE_DIR" ] && mkdir -p "$FSDP_SENTINEL_TRACE_DIR"; then
    args+=(--trace-out "$FSDP_SENTINEL_TRACE_DIR/job-$job.jsonl.zst")
fi
# One metrics server per node: a second job on a shared node runs without one.
metrics_taken=
for other in "$FSDP_SENTINEL_RUN_DIR"/job-*/metrics; do
    [ -e "$other" ] && [ "$other" != "$dir/metrics" ] && metrics_taken=1
done
if [ -n "$metrics_taken" ]; then
    args+=(--metrics-addr off)
else
    args+=(--metrics-addr "$FSDP_SENTINEL_METRICS_ADDR")
    : > "$dir/metrics"
fi

# uid 0 with a bounding set of the three: root's capabilities shrink to them.
setsid setpriv --bounding-set -all,+bpf,+perfmon,+net_admin --inh-caps -all -- \
    "$FSDP_SENTINEL_BIN" "${args[@]}" </dev/null >>"$dir/daemon.log" 2>&1 &
echo $! > "$dir/daemon.pid"

# Wait (bcc compiles the probes: seconds) until the socket is there, then let
# the job's group reach it.
for _ in $(seq 1 120); do
    if [ -S "$dir/ingest.sock" ]; then
        [ -n "${SLURM_JOB_GID:-}" ] && chgrp "$SLURM_JOB_GID" "$dir/ingest.sock"
        log "daemon $(cat "$dir/daemon.pid") up, socket $dir/ingest.sock"
        exit 0
    fi
    kill -0 "$(cat "$dir/daemon.pid")" 2>/dev/null || break
    sleep 0.5
done
log "daemon did not come up (see $dir/daemon.log); the job runs without it"
exit 0
