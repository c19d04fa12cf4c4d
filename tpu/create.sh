#!/usr/bin/env bash
# Creates a TPU VM or pod slice for realm_jax, directly or as a queued resource.
#
# Usage: tpu/create.sh --name=NAME --accelerator-type=TYPE [--spot | --queued [--spot | --best-effort]]
#          [--runtime-version=VERSION] [--zone=ZONE] [--project=PROJECT] [--dry-run]
#
#   --accelerator-type=TYPE  v3-N     N TensorCores, 8 per host: 8, 32, 64, 128, ..., 2048
#                            v4-N     N TensorCores = N/2 chips, 4 chips per host: 8, 16, ..., 8192
#                            v5litepod-N  N chips: 1, 4, 8 on one host; 16..256 at 4 per host
#                            v5p-N    N TensorCores = N/2 chips, 4 chips per host: 8, 16, ..., 12288
#   --runtime-version=V      default per generation: v3, v4 tpu-ubuntu2204-base,
#                            v5e v2-alpha-tpuv5-lite, v5p v2-alpha-tpuv5
#   --queued                 request it as a queued resource (waits for capacity; delete it with
#                            tpu/teardown.sh --queued)
#   --spot                   Spot VMs: cheaper, can be preempted (the run resumes from its checkpoint)
#   --best-effort            queued at the best-effort tier (gcloud alpha)
#
# Prints the chips and hosts (TPU VM workers) the type implies, e.g. v4-64: 32 chips on 8 hosts.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

ACCELERATOR_TYPE=""
RUNTIME_VERSION=""
QUEUED=0
SPOT=0
BEST_EFFORT=0
VALUE_FLAGS+=(accelerator-type runtime-version)
SWITCH_FLAGS+=(queued spot best-effort)
parse_flags "$@"
require_flags name accelerator-type

ALLOWED_TYPES="v3-N (N = 8, 32, 64, 128, 256, 512, 1024, 2048), v4-N (N a multiple of 8 up to 8192), \
v5litepod-N (N = 1, 4, 8, 16, 32, 64, 128, 256) or v5p-N (N a multiple of 8 up to 12288)"

# Sets GENERATION, CHIPS and HOSTS from ACCELERATOR_TYPE, or fails naming the allowed forms.
describe_accelerator() {
  local bad="--accelerator-type=$ACCELERATOR_TYPE is not a TPU type this script knows: use $ALLOWED_TYPES."
  [[ $ACCELERATOR_TYPE =~ ^(v3|v4|v5litepod|v5p)-([1-9][0-9]*)$ ]] || die "$bad"
  GENERATION=${BASH_REMATCH[1]}
  local n=${BASH_REMATCH[2]}
  case $GENERATION in
    v3)  # 2 TensorCores per chip, 4 chips per host
      contains "$n" 8 32 64 128 256 512 1024 2048 || die "$bad"
      CHIPS=$((n / 2)) HOSTS=$((n / 8))
      ;;
    v4 | v5p)  # 2 TensorCores per chip, 4 chips per host; pods of 4096 (v4) and 6144 (v5p) chips
      local max_cores=8192
      [[ $GENERATION == v4 ]] || max_cores=12288
      ((n % 8 == 0 && n <= max_cores)) || die "$bad"
      CHIPS=$((n / 2)) HOSTS=$((n / 8))
      ;;
    v5litepod)  # 1 TensorCore per chip; up to 8 chips on one host, 4 per host in larger slices
      contains "$n" 1 4 8 16 32 64 128 256 || die "$bad"
      CHIPS=$n HOSTS=$((n <= 8 ? 1 : n / 4))
      ;;
  esac
}

describe_accelerator
resolve_zone "$GENERATION"
if [[ -z $RUNTIME_VERSION ]]; then
  case $GENERATION in
    v3 | v4) RUNTIME_VERSION=tpu-ubuntu2204-base ;;
    v5litepod) RUNTIME_VERSION=v2-alpha-tpuv5-lite ;;
    v5p) RUNTIME_VERSION=v2-alpha-tpuv5 ;;
  esac
fi
((!(SPOT && BEST_EFFORT))) || die "--spot and --best-effort exclude each other: pick one."
((QUEUED || !BEST_EFFORT)) || die "--best-effort only exists for queued resources: add --queued."

if ((HOSTS == 1)); then
  hosts="1 host (TPU VM worker 0)"
else
  hosts="$HOSTS hosts (TPU VM workers 0-$((HOSTS - 1)))"
fi
note "$ACCELERATOR_TYPE: $CHIPS chips on $hosts, runtime $RUNTIME_VERSION, zone $ZONE"
# Spot and best-effort capacity can be preempted: the run then resumes from its newest checkpoint.
capacity=()
if ((SPOT)); then capacity=(--spot); fi
if ((BEST_EFFORT)); then capacity=(--best-effort); fi
if ((QUEUED)); then
  # --best-effort exists only in the alpha surface of gcloud.
  gcloud=(gcloud)
  if ((BEST_EFFORT)); then gcloud=(gcloud alpha); fi
  run "${gcloud[@]}" compute tpus queued-resources create "$NAME" --node-id="$NAME" \
    --zone="$ZONE" --accelerator-type="$ACCELERATOR_TYPE" --runtime-version="$RUNTIME_VERSION" \
    "${capacity[@]}" "${PROJECT_ARGS[@]}"
  note "the slice exists once the queued resource is ACTIVE:"
  note "  gcloud compute tpus queued-resources describe $NAME --zone=$ZONE"
else
  run gcloud compute tpus tpu-vm create "$NAME" --zone="$ZONE" \
    --accelerator-type="$ACCELERATOR_TYPE" --version="$RUNTIME_VERSION" "${capacity[@]}" \
    "${PROJECT_ARGS[@]}"
fi
note "next: export REALM_TPU_ZONE=$ZONE; tpu/install.sh --name=$NAME"
