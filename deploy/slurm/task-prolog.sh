#!/bin/bash
# Slurm TaskProlog (slurm.conf: TaskProlog=/etc/slurm/fsdp-sentinel-task-prolog.sh).
# Runs as the job's user before each task; the lines it prints as
# "export NAME=value" go into the task's environment. It points the ranks'
# hooks at this job's daemon (started by prolog.sh) and names the job.
set -u
conf=${FSDP_SENTINEL_CONF:-/etc/default/fsdp-sentinel-slurm}
FSDP_SENTINEL_RUN_DIR=/run/fsdp-sentinel
# shellcheck source-path=SCRIPTDIR source=fsdp-sentinel.env
[ -r "$conf" ] && . "$conf"
sock=$FSDP_SENTINEL_RUN_DIR/job-${SLURM_JOB_ID:?}/ingest.sock
if [ -S "$sock" ]; then
    echo "export FSDP_SENTINEL_SOCKET=$sock"
    echo "export FSDP_SENTINEL_JOB=$SLURM_JOB_ID"
fi
exit 0
