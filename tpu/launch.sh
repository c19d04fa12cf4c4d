#!/usr/bin/env bash
# Starts REALM pre-training (experiments/pretrain.py) on every worker of a slice at once, in the
# background: each worker logs to ~/realm_jax_logs/pretrain.log (tpu/logs.sh shows it). The
# trainer calls jax.distributed.initialize() itself (--config.distributed=True): the workers of a
# TPU slice find each other. Run it again on the same --workdir and training resumes from the
# newest checkpoint.
#
# Usage: tpu/launch.sh --name=NAME --workdir=gs://BUCKET/PATH [--variant=VARIANT]
#          [--zone=ZONE] [--project=PROJECT] [--dry-run] [-- --config.x=y ...]
#        tpu/launch.sh --name=NAME --stop
#
#   --workdir=gs://...  the run's work directory (tpu/data.sh prints one); required
#   --variant=VARIANT   realm_jax/configs/pretrain.py:VARIANT (default paper_v4_64; also
#                       paper_v3_128, paper_v5e_256, paper, demo, tiny)
#   --stop              stop the trainer on every worker instead
#   -- ARGS             more flags for pretrain.py, e.g. -- --config.num_steps=1000
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

WORKDIR=""
VARIANT=paper_v4_64
STOP=0
VALUE_FLAGS+=(workdir variant)
SWITCH_FLAGS+=(stop)
ACCEPTS_EXTRA_ARGS=1
parse_flags "$@"
resolve_zone

if ((STOP)); then
  require_flags name
  tpu_ssh all "$(stop_command pretrain)"
  exit 0
fi
require_flags name workdir
check_workdir
check_config_args
tpu_ssh all "$(background_command pretrain TF_CPP_MIN_LOG_LEVEL=1 experiments/pretrain.py \
  --config="realm_jax/configs/pretrain.py:$VARIANT" --workdir="$WORKDIR" \
  --config.distributed=True "${EXTRA_ARGS[@]}")"
note "follow worker 0: tpu/logs.sh --name=$NAME --follow"
