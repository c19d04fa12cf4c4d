#!/usr/bin/env bash
# Starts REALM pre-training (experiments/pretrain.py) on every worker of a slice at once, in the
# background: each worker logs to ~/realm_jax_logs/pretrain.log (tpu/logs.sh shows it). First,
# worker 0 compiles the run's training step for the slice's topology (experiments/compile_for.py,
# the same config and flags; its report in ~/realm_jax_logs/compile.json): a config that does not
# compile or does not fit the chips stops here, before any worker starts. The
# trainer calls jax.distributed.initialize() itself (--config.distributed=True): the workers of a
# TPU slice find each other. Run it again on the same --workdir and training resumes from the
# newest checkpoint.
#
# Usage: tpu/launch.sh --name=NAME --workdir=gs://BUCKET/PATH [--variant=VARIANT]
#          [--topology=SLICE | --no-compile] [--zone=ZONE] [--project=PROJECT] [--dry-run]
#          [-- --config.x=y ...]
#        tpu/launch.sh --name=NAME --stop
#
#   --workdir=gs://...  the run's work directory (tpu/data.sh prints one); required
#   --variant=VARIANT   realm_jax/configs/pretrain.py:VARIANT (default paper_v4_64; also
#                       paper_v3_128, paper_v5e_256, paper, demo, tiny)
#   --topology=SLICE    the slice to compile for (default: the variant's, v4-64 for paper_v4_64,
#                       v3-128, v5litepod-256; needed for other variants)
#   --no-compile        start without compiling first
#   --stop              stop the trainer on every worker instead
#   -- ARGS             more flags for pretrain.py, e.g. -- --config.num_steps=1000
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

WORKDIR=""
VARIANT=paper_v4_64
TOPOLOGY=""
STOP=0
NO_COMPILE=0
VALUE_FLAGS+=(workdir variant topology)
SWITCH_FLAGS+=(stop no-compile)
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
if ((!NO_COMPILE)); then
  if [[ -z $TOPOLOGY ]]; then
    case $VARIANT in
      paper_v4_64) TOPOLOGY=v4-64 ;;
      paper_v3_128) TOPOLOGY=v3-128 ;;
      paper_v5e_256) TOPOLOGY=v5litepod-256 ;;
      *) die "--variant=$VARIANT names no slice: give --topology=SLICE (the slice's accelerator type, e.g. v4-64) to compile its step first, or --no-compile." ;;
    esac
  fi
  [[ $TOPOLOGY =~ ^[a-z0-9:x-]+$ ]] || die "--topology=$TOPOLOGY: give a slice such as v4-64 or v5litepod-256."
  # Worker 0 compiles the step for the whole slice (the TPU compiler, no TPU used); the workers
  # start only when it compiled and fits.
  compile_args=""
  for arg in --config="realm_jax/configs/pretrain.py:$VARIANT" --topology="$TOPOLOGY" \
      --out="$REMOTE_LOGS/compile.json" "${EXTRA_ARGS[@]}"; do
    compile_args+=" $(quote "$arg")"
  done
  tpu_ssh 0 "set -eu; mkdir -p $REMOTE_LOGS; cd $REMOTE_REPO; .venv/bin/python experiments/compile_for.py$compile_args"
fi
tpu_ssh all "$(background_command pretrain TF_CPP_MIN_LOG_LEVEL=1 experiments/pretrain.py \
  --config="realm_jax/configs/pretrain.py:$VARIANT" --workdir="$WORKDIR" \
  --config.distributed=True "${EXTRA_ARGS[@]}")"
note "follow worker 0: tpu/logs.sh --name=$NAME --follow"
