#!/usr/bin/env bash
# Shows the log of a background job (pretrain or refresh_index) on one worker or all, each line
# prefixed with the worker's host name.
#
# Usage: tpu/logs.sh --name=NAME [--worker=0|N|all] [--job=pretrain|refresh_index] [--lines=100]
#          [--follow] [--zone=ZONE] [--project=PROJECT] [--dry-run]
#
#   --worker=W   0 (default; the trainer's process 0 logs the metrics), N, N,M, N-M or all
#   --job=JOB    pretrain (default) or refresh_index
#   --lines=N    how many of the last lines to show (default 100)
#   --follow     keep printing new lines until Ctrl-C
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

WORKER=0
JOB=pretrain
LINES=100
FOLLOW=0
VALUE_FLAGS+=(worker job lines)
SWITCH_FLAGS+=(follow)
parse_flags "$@"
require_flags name
resolve_zone
[[ $WORKER =~ ^(all|[0-9]+([,-][0-9]+)*)$ ]] ||
  die "--worker=$WORKER: give a worker index (0, 3), a list (1,4), a range (0-7) or all."
contains "$JOB" pretrain refresh_index || die "--job=$JOB: use pretrain or refresh_index."
[[ $LINES =~ ^[0-9]+$ ]] || die "--lines=$LINES: give a number of lines."

follow=""
if ((FOLLOW)); then follow=" -F"; fi
tpu_ssh "$WORKER" \
  "tail -n $LINES$follow $REMOTE_LOGS/$JOB.log | sed -u \"s/^/[\$(hostname)] /\""
