#!/usr/bin/env bash
# Starts REALM's index refresher (experiments/refresh_index.py) on worker 0 of a TPU VM, in the
# background, logging to ~/realm_jax_logs/refresh_index.log. It watches the trainer's checkpoints
# in --workdir and publishes a new index for each; give it the trainer's --variant and overrides.
#
# Two places to run it:
#   --name=OTHER        a separate single-host TPU VM made with tpu/create.sh (e.g. v4-8): the
#                       refresher embeds the corpus on its TPU
#   --name=SLICE --on-trainer
#                       worker 0 of the training slice, on its CPU (the trainer holds the TPU):
#                       no extra TPU, but slow for a large corpus (see tpu/README.md)
#
# Usage: tpu/refresher.sh --name=NAME --workdir=gs://BUCKET/PATH [--on-trainer] [--variant=VARIANT]
#          [--zone=ZONE] [--project=PROJECT] [--dry-run] [-- --config.x=y ...]
#        tpu/refresher.sh --name=NAME --stop
#
#   --workdir=gs://...  the trainer's work directory; required
#   --variant=VARIANT   the trainer's config variant (default paper_v4_64)
#   --stop              stop the refresher instead
#   -- ARGS             more flags for refresh_index.py: the trainer's --config.x=y overrides
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

WORKDIR=""
VARIANT=paper_v4_64
ON_TRAINER=0
STOP=0
VALUE_FLAGS+=(workdir variant)
SWITCH_FLAGS+=(on-trainer stop)
ACCEPTS_EXTRA_ARGS=1
parse_flags "$@"
resolve_zone

if ((STOP)); then
  require_flags name
  tpu_ssh 0 "$(stop_command refresh_index)"
  exit 0
fi
require_flags name workdir
check_workdir
check_config_args
env=TF_CPP_MIN_LOG_LEVEL=1
# The trainer holds every TPU chip of its slice, so a refresher beside it runs on the CPU.
if ((ON_TRAINER)); then env+=" JAX_PLATFORMS=cpu"; fi
tpu_ssh 0 "$(background_command refresh_index "$env" experiments/refresh_index.py \
  --config="realm_jax/configs/pretrain.py:$VARIANT" --workdir="$WORKDIR" "${EXTRA_ARGS[@]}")"
note "follow it: tpu/logs.sh --name=$NAME --job=refresh_index --follow"
