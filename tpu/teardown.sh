#!/usr/bin/env bash
# Deletes a TPU VM or pod slice (or, with --queued, its queued resource and the slice in it),
# after asking. The work directory in gs:// (checkpoints, indexes, TensorBoard) is kept.
#
# Usage: tpu/teardown.sh --name=NAME [--queued] [--yes] [--zone=ZONE] [--project=PROJECT] [--dry-run]
#
#   --queued   it was made with tpu/create.sh --queued
#   --yes      do not ask
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

QUEUED=0
YES=0
SWITCH_FLAGS+=(queued yes)
parse_flags "$@"
require_flags name
resolve_zone

what="TPU $NAME in $ZONE"
if ((QUEUED)); then what="queued resource $NAME in $ZONE and its TPU"; fi
if ((!DRY_RUN && !YES)); then
  [[ -t 0 ]] || die "not deleting the $what without confirmation: run it in a terminal or pass --yes."
  read -r -p "Delete the $what? Its disks are lost; gs:// stays. [y/N] " answer
  [[ $answer =~ ^[yY]([eE][sS])?$ ]] || { note "not deleted"; exit 1; }
fi
# gcloud's own prompt is answered above (--quiet).
if ((QUEUED)); then
  run gcloud compute tpus queued-resources delete "$NAME" --zone="$ZONE" --force --quiet \
    "${PROJECT_ARGS[@]}"
else
  run gcloud compute tpus tpu-vm delete "$NAME" --zone="$ZONE" --quiet "${PROJECT_ARGS[@]}"
fi
