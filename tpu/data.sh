#!/usr/bin/env bash
# Stages a run's data in a GCS work directory and prints the work directory (and the overrides)
# to give tpu/launch.sh and tpu/refresher.sh. Your own corpus (a JSONL file, or a folder of them;
# one {"title": ..., "text": ...} object per line) is copied to WORKDIR/corpus/; with no --corpus
# there is nothing to copy: the config's own corpus is used (the embedded one unless it says
# otherwise). The trainer builds the blocks and examples in WORKDIR/data itself.
#
# Usage: tpu/data.sh --name=NAME (--bucket=BUCKET | --workdir=gs://BUCKET/PATH) [--corpus=PATH]
#          [--create-bucket] [--zone=ZONE] [--project=PROJECT] [--dry-run]
#
#   --bucket=BUCKET     work directory gs://BUCKET/realm_jax/NAME
#   --workdir=gs://...  or this one
#   --corpus=PATH       a local .jsonl file or a folder of them to upload
#   --create-bucket     create the bucket first, in the region of --zone (keep data and TPU together)
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

BUCKET=""
WORKDIR=""
CORPUS=""
CREATE_BUCKET=0
VALUE_FLAGS+=(bucket workdir corpus)
SWITCH_FLAGS+=(create-bucket)
parse_flags "$@"
require_flags name
resolve_zone

if [[ -n $BUCKET && -n $WORKDIR ]]; then
  die "--bucket and --workdir both name the work directory: give one."
elif [[ -n $BUCKET ]]; then
  BUCKET=${BUCKET#gs://}
  BUCKET=${BUCKET%/}
  [[ $BUCKET != */* ]] || die "--bucket=$BUCKET: give the bucket's name only; for a path, use --workdir."
  [[ $BUCKET =~ ^$BUCKET_NAME$ ]] ||
    die "--bucket=$BUCKET: a bucket name is 3-63 lowercase letters, digits, '-', '_' or '.'."
  WORKDIR="gs://$BUCKET/realm_jax/$NAME"
elif [[ -z $WORKDIR ]]; then
  die "missing required flag: --bucket or --workdir (see --help)."
fi
check_workdir

if ((CREATE_BUCKET)); then
  bucket=${WORKDIR#gs://}
  run gcloud storage buckets create "gs://${bucket%%/*}" --location="${ZONE%-*}" \
    --uniform-bucket-level-access "${PROJECT_ARGS[@]}"
fi

# The corpus' path in GCS, for the trainer's and refresher's config.
paths=""
if [[ -z $CORPUS ]]; then
  note "corpus: the config's own (nothing to upload)"
elif [[ -d $CORPUS ]]; then
  [[ -n $(find "$CORPUS" -name '*.jsonl' -print -quit) ]] ||
    die "--corpus=$CORPUS: the folder holds no *.jsonl file."
  paths="$WORKDIR/corpus"
  run gcloud storage rsync --recursive "$CORPUS" "$paths" "${PROJECT_ARGS[@]}"
elif [[ -f $CORPUS && $CORPUS == *.jsonl ]]; then
  paths="$WORKDIR/corpus/${CORPUS##*/}"
  run gcloud storage cp "$CORPUS" "$paths" "${PROJECT_ARGS[@]}"
else
  die "--corpus=$CORPUS: give an existing .jsonl file (one JSON object per line) or a folder of them."
fi

note "workdir: $WORKDIR"
args=$(quote "--workdir=$WORKDIR")  # printed to be pasted: quoted like the commands
if [[ -n $paths ]]; then
  args+=" -- --config.corpus.source=jsonl $(quote "--config.corpus.paths=('$paths',)")"
fi
note "next: tpu/launch.sh --name=$NAME $args"
note "      tpu/refresher.sh --name=OTHER_VM $args"
