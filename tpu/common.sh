# shellcheck shell=bash
# Sourced by the tpu/*.sh scripts, never run: flag parsing, defaults, and `run`, which prints each
# command quoted so that it can be pasted into a shell, then runs it unless --dry-run.
#
# A script lists its own flags in VALUE_FLAGS (take a value) and SWITCH_FLAGS (on/off), sets their
# defaults in the variables of the same name (--accelerator-type -> ACCELERATOR_TYPE), and calls
# `parse_flags "$@"`. Lines of the output that are not commands start with '#', so that the output
# of --dry-run is itself a shell script.

if ((BASH_VERSINFO[0] < 4 || (BASH_VERSINFO[0] == 4 && BASH_VERSINFO[1] < 4))); then
  echo "tpu/${0##*/}: needs bash >= 4.4, this is $BASH_VERSION (on macOS: brew install bash)." >&2
  exit 2
fi

SCRIPT="tpu/${0##*/}"
COMMON_HELP="Flags of every tpu/ script:
  --name=NAME        the TPU VM or pod slice (required)
  --zone=ZONE        default: \$REALM_TPU_ZONE, else the generation's zone in create.sh
                     (v3 europe-west4-a, v4 us-central2-b, v5e us-west4-a, v5p us-east5-a)
                     and us-central2-b (v4) in the others
  --project=PROJECT  default: gcloud's configured project
  --dry-run          print the commands without running them
  -h, --help         this help"

NAME=""
ZONE="${REALM_TPU_ZONE:-}"
PROJECT=""
DRY_RUN=0
PROJECT_ARGS=()        # --project=PROJECT for every gcloud command, when given
VALUE_FLAGS=(name zone project)
SWITCH_FLAGS=(dry-run)
ACCEPTS_EXTRA_ARGS=0   # 1: arguments after `--` are passed on (EXTRA_ARGS)
EXTRA_ARGS=()

# Where realm_jax lives on every worker (install.sh), and where the background jobs log.
REMOTE_REPO="\$HOME/realm_jax"
REMOTE_LOGS="\$HOME/realm_jax_logs"

die() {
  printf '%s: error: %s\n' "$SCRIPT" "$*" >&2
  exit 2
}

note() {
  printf '# %s\n' "$*"
}

usage() {
  # The script's header comment (after the shebang), then the common flags.
  sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"
  printf '\n%s\n' "$COMMON_HELP"
}

contains() {
  local want=$1 item
  shift
  for item in "$@"; do
    [[ $item == "$want" ]] && return 0
  done
  return 1
}

set_flag() {
  local var=${1//-/_}
  printf -v "${var^^}" '%s' "$2"
}

parse_flags() {
  local arg flag value
  while (($#)); do
    arg=$1
    shift
    case $arg in
      -h | --help)
        usage
        exit 0
        ;;
      --)
        ((ACCEPTS_EXTRA_ARGS)) || die "$SCRIPT takes no arguments after '--' (got: $*)."
        EXTRA_ARGS=("$@")
        return 0
        ;;
      --*=*)
        flag=${arg%%=*}
        flag=${flag#--}
        value=${arg#*=}
        if contains "$flag" "${SWITCH_FLAGS[@]}"; then
          die "--$flag is a switch and takes no value (got '$arg')."
        fi
        ;;
      --*)
        flag=${arg#--}
        if contains "$flag" "${SWITCH_FLAGS[@]}"; then
          set_flag "$flag" 1
          continue
        fi
        if contains "$flag" "${VALUE_FLAGS[@]}"; then
          if (($# == 0)) || [[ $1 == -* ]]; then
            die "--$flag needs a value: --$flag=VALUE."
          fi
          value=$1
          shift
        fi
        ;;
      *)
        die "unexpected argument '$arg': flags are written --flag=VALUE (see --help)."
        ;;
    esac
    if ! contains "$flag" "${VALUE_FLAGS[@]}"; then
      die "unknown flag --$flag. Flags:" \
        "$(printf -- '--%s ' "${VALUE_FLAGS[@]}" "${SWITCH_FLAGS[@]}")(see --help)."
    fi
    set_flag "$flag" "$value"
  done
  [[ -z $NAME ]] || check_name
  [[ -z $PROJECT ]] || PROJECT_ARGS=(--project="$PROJECT")
}

# Fails naming every flag in "$@" that is still empty.
require_flags() {
  local flag var missing=()
  for flag in "$@"; do
    var=${flag//-/_}
    var=${var^^}
    [[ -n ${!var} ]] || missing+=("--$flag")
  done
  ((${#missing[@]} == 0)) || die "missing required flag(s): ${missing[*]} (see --help)."
}

# TPU names: lowercase letters, digits and hyphens, starting with a letter (GCE resource names).
check_name() {
  [[ $NAME =~ ^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$ ]] ||
    die "--name=$NAME: use lowercase letters, digits and hyphens, starting with a letter (at most 63)."
}

# GCS bucket names: 3-63 lowercase letters, digits, '-', '_' and '.', starting and ending with a
# letter or digit.
BUCKET_NAME='[a-z0-9][-_.a-z0-9]{1,61}[a-z0-9]'

# Checks WORKDIR (launch.sh, refresher.sh, data.sh): every worker must reach it, so it is in GCS.
check_workdir() {
  WORKDIR=${WORKDIR%/}
  [[ $WORKDIR =~ ^gs://$BUCKET_NAME(/.+)?$ ]] ||
    die "--workdir=$WORKDIR: every worker must reach it, so give a gs://BUCKET/PATH (tpu/data.sh prints one)."
}

# Checks VARIANT and EXTRA_ARGS, the config variant and flags given to a realm_jax entry point.
check_config_args() {
  local arg
  [[ $VARIANT =~ ^[a-z0-9_]+$ ]] ||
    die "--variant=$VARIANT: give a variant of realm_jax/configs/pretrain.py such as paper_v4_64."
  for arg in "${EXTRA_ARGS[@]}"; do
    case $arg in
      --config=* | --workdir=*)
        die "'$arg' after --: use --variant and --workdir of $SCRIPT instead." ;;
      --dry-run | --help | -h)
        die "'$arg' after --: the flags after -- are the trainer's; put $arg before --." ;;
      --*) ;;
      *) die "'$arg' after --: give flags such as --config.num_steps=1000." ;;
    esac
  done
}

# Sets ZONE when neither --zone nor $REALM_TPU_ZONE gave one: to a zone that offers the TPU
# generation $1 (default v4, the generation of the default slice v4-64).
resolve_zone() {
  [[ -z $ZONE ]] || return 0
  case ${1:-v4} in
    v3) ZONE=europe-west4-a ;;
    v4) ZONE=us-central2-b ;;
    v5litepod) ZONE=us-west4-a ;;
    v5p) ZONE=us-east5-a ;;
  esac
}

# Prints $1 quoted for a POSIX shell, like printf %q but so that a long remote --command stays
# readable: as it is when that is safe, else in single quotes (in double quotes when it holds single
# quotes and nothing special to double quotes), and for --flag=VALUE only the value.
SAFE_WORD='^[A-Za-z0-9_./:=,@%+-]+$'
FLAG_VALUE='^(--[A-Za-z0-9.-]+=)(.*)$'
quote() {
  if [[ $1 =~ $SAFE_WORD ]]; then
    printf '%s' "$1"
  elif [[ $1 =~ $FLAG_VALUE ]]; then
    printf '%s' "${BASH_REMATCH[1]}"
    quote "${BASH_REMATCH[2]}"
  elif [[ $1 == *\'* && $1 != *[\"\$\`\\!]* ]]; then
    printf '"%s"' "$1"
  else
    printf "'%s'" "${1//\'/\'\\\'\'}"
  fi
}

# Prints a command, quoted so that it can be pasted into a shell, then runs it unless --dry-run.
run() {
  local arg line=""
  for arg in "$@"; do
    line+="${line:+ }$(quote "$arg")"
  done
  printf '%s\n' "$line"
  ((DRY_RUN)) || "$@"
}

# Runs the remote shell command $2 on worker(s) $1 (N, N,M, N-M or all) of the TPU $NAME.
tpu_ssh() {
  run gcloud compute tpus tpu-vm ssh "$NAME" --zone="$ZONE" "${PROJECT_ARGS[@]}" --worker="$1" \
    --command="$2"
}

# The remote command that starts `ENV python ARGS...` in the background in ~/realm_jax, appending
# to ~/realm_jax_logs/JOB.log, unless JOB is already running there. Usage:
#   background_command JOB 'VAR=value ...' ARGS...
background_command() {
  local job=$1 env=$2 arg args=""
  shift 2
  for arg in "$@"; do
    args+=" $(quote "$arg")"
  done
  local pid="$REMOTE_LOGS/$job.pid" log="$REMOTE_LOGS/$job.log"
  printf '%s' "set -eu; mkdir -p $REMOTE_LOGS; cd $REMOTE_REPO 2>/dev/null || " \
    "{ echo \"\$(hostname): no $REMOTE_REPO: run tpu/install.sh first\" >&2; exit 1; }; " \
    "if [ -s $pid ] && kill -0 \$(cat $pid) 2>/dev/null; then echo \"\$(hostname): $job is " \
    "already running (pid \$(cat $pid)): stop it with $SCRIPT --name=$NAME --stop\" >&2; exit 1; fi; " \
    "${env:+export $env; }nohup .venv/bin/python$args >> $log 2>&1 < /dev/null & " \
    "echo \$! > $pid; echo \"\$(hostname): $job started (pid \$!), log $log\""
}

# The remote command that stops the background JOB started by background_command.
stop_command() {
  local job=$1
  local pid="$REMOTE_LOGS/$job.pid"
  printf '%s' "if [ -s $pid ] && kill \$(cat $pid) 2>/dev/null; then " \
    "echo \"\$(hostname): stopped $job\"; else echo \"\$(hostname): $job was not running\"; fi; " \
    "rm -f $pid"
}
