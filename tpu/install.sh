#!/usr/bin/env bash
# Installs realm_jax on every worker of a TPU VM or pod slice: Python venv in ~/realm_jax/.venv,
# jax[tpu] and realm_jax (editable, with gcsfs for the gs:// work directory) from a git checkout in
# ~/realm_jax, then prints the number of TPU devices JAX sees (every worker must print the slice's
# total). Safe to run again: it fetches --ref and reinstalls.
#
# Usage: tpu/install.sh --name=NAME [--repo=URL] [--ref=REF] [--python=python3.11]
#          [--zone=ZONE] [--project=PROJECT] [--dry-run]
#
#   --repo=URL       git URL the workers clone (default: this checkout's `origin` remote)
#   --ref=REF        branch, tag or commit to check out (default: this checkout's HEAD commit,
#                    so that every worker runs the same code; push it first)
#   --python=EXE     the Python the venv is made with, installed with apt (default python3.11)
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

REPO=""
REF=""
PYTHON=python3.11
VALUE_FLAGS+=(repo ref python)
parse_flags "$@"
require_flags name
resolve_zone

here=$(dirname "${BASH_SOURCE[0]}")
if [[ -z $REPO ]]; then
  REPO=$(git -C "$here" remote get-url origin 2>/dev/null) ||
    die "no --repo given and this checkout has no 'origin' remote:" \
      "pass --repo=https://github.com/OWNER/realm_jax.git."
fi
if [[ -z $REF ]]; then
  REF=$(git -C "$here" rev-parse HEAD 2>/dev/null) ||
    die "no --ref given and $here is not in a git checkout: pass --ref=BRANCH|TAG|COMMIT."
fi
[[ $PYTHON =~ ^python3\.[0-9]+$ ]] || die "--python=$PYTHON: give an apt Python such as python3.11."

steps=(
  "set -eu"  # POSIX: the login shell runs it
  # The apt lock can be held for minutes by unattended upgrades on a fresh VM.
  "sudo DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 update -qq"
  "sudo DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq $PYTHON $PYTHON-venv git"
  "[ -d $REMOTE_REPO/.git ] || git clone --quiet $(quote "$REPO") $REMOTE_REPO"
  "cd $REMOTE_REPO"
  "git fetch --quiet origin $(quote "$REF")"
  "git checkout --quiet --detach FETCH_HEAD"
  "[ -x .venv/bin/python ] || $PYTHON -m venv .venv"
  ".venv/bin/pip install --quiet --upgrade pip"
  # jax[tpu] brings libtpu; realm_jax has no tpu extra of its own. The gcs extra (gcsfs) lets it
  # read and write the gs:// work directory.
  ".venv/bin/pip install --quiet \"jax[tpu]\" -e '.[gcs]'"
  "echo \"\$(hostname): realm_jax \$(git rev-parse --short HEAD)\""
  ".venv/bin/python -c \"import jax; print(jax.device_count())\""
)
command=$(printf '%s; ' "${steps[@]}")
tpu_ssh all "${command%; }"
