#!/usr/bin/env bash
# The one launcher behind every slurm/*.sh job script. A job script sources it, then launches:
#
#   source "${REPRO_ROOT:-${SLURM_SUBMIT_DIR:-.}}/slurm/launch.sh"
#   launch_train experiments/scaling/scale_8b.yaml "$@"      # or: launch_step eval lambada ...
#
# Sourcing loads the cluster settings (slurm/cluster.env, copied from slurm/cluster.env.example, or
# the environment), checks them and prepares the job: run directory, per-job log, the rank-0 host and
# port, NCCL settings, the Python environment. Nothing runs on the compute tasks before every check
# passed. Steps run one task per GPU (`srun slurm/task.sh repro ...`). USR1 or TERM to the batch
# shell is forwarded to the step; when the trainer stopped for it (it checkpoints, exits 0 and leaves
# RUN_DIR/stopped_by_signal), the job requeues itself and the next start resumes from the checkpoint.
#
# Arguments after the config (the job script's "$@"):
#   --smoke     tiny GPT on CPU (gloo), TP = the allocation's task count, a small WikiText-2 corpus
#   --dry-run   check and print the step without running it
#   --set K=V   config overrides passed to `repro train`
set -euo pipefail

die() { echo "launch.sh: error: $*" >&2; exit 2; }
note() { echo "launch.sh: $*"; }

need() {  # need VAR "what it is"
  [[ -n "${!1:-}" ]] || die "$1 is not set: $2. Set it in slurm/cluster.env (see slurm/cluster.env.example) or export it before sbatch"
}

load_cluster_env() {
  REPRO_ROOT="$(cd "${REPRO_ROOT:-${SLURM_SUBMIT_DIR:-$PWD}}" && pwd)"
  [[ -f "$REPRO_ROOT/slurm/launch.sh" ]] \
    || die "REPRO_ROOT=$REPRO_ROOT is not the repository: submit from the repository root or set REPRO_ROOT"
  local env_file="${REPRO_CLUSTER_ENV:-$REPRO_ROOT/slurm/cluster.env}"
  if [[ -f "$env_file" ]]; then
    set -a
    # shellcheck source=/dev/null
    source "$env_file"
    set +a
  elif [[ -n "${REPRO_CLUSTER_ENV:-}" ]]; then
    die "REPRO_CLUSTER_ENV=$REPRO_CLUSTER_ENV does not exist: copy slurm/cluster.env.example there"
  fi
  need REPRO_RUNS_DIR "the shared directory for run directories (checkpoints, metrics, logs)"
  need REPRO_DATA_DIR "the shared data directory filled by \`repro data fetch\` (vocabularies, eval sets, corpora)"
  REPRO_ENV_ACTIVATE="${REPRO_ENV_ACTIVATE:-$REPRO_ROOT/.venv/bin/activate}"
  need SLURM_JOB_ID "this runs inside a Slurm job: submit the script with sbatch"
}

activate_env() {
  if [[ "$REPRO_ENV_ACTIVATE" != none ]]; then
    [[ -f "$REPRO_ENV_ACTIVATE" ]] \
      || die "REPRO_ENV_ACTIVATE=$REPRO_ENV_ACTIVATE does not exist: point it at your venv/conda activation script, or 'none'"
    set +u  # conda's activation scripts read unset variables
    # shellcheck source=/dev/null
    source "$REPRO_ENV_ACTIVATE"
    set -u
  fi
  command -v repro >/dev/null || die "\`repro\` is not on PATH after REPRO_ENV_ACTIVATE=$REPRO_ENV_ACTIVATE: install the package (pip install -e .) in that environment"
}

setup_job() {
  # shellcheck disable=SC2153  # REPRO_RUNS_DIR comes from the cluster env, checked by load_cluster_env
  REPRO_RUN_DIR="$REPRO_RUNS_DIR/${REPRO_RUN_NAME:-${SLURM_JOB_NAME:-job}-$SLURM_JOB_ID}"
  REPRO_LOG="$REPRO_RUN_DIR/logs/slurm-$SLURM_JOB_ID.out"
  mkdir -p "$REPRO_RUN_DIR/logs"
  note "run dir $REPRO_RUN_DIR, log $REPRO_LOG"
  exec >>"$REPRO_LOG" 2>&1
  note "job $SLURM_JOB_ID start $(date -Is), restart ${SLURM_RESTART_COUNT:-0}, nodes ${SLURM_JOB_NODELIST:-?}"
  local hosts
  mapfile -t hosts < <(scontrol show hostnames "${SLURM_JOB_NODELIST:-$(hostname -s)}")
  export MASTER_ADDR="${hosts[0]}"
  # from the job id, below Linux's ephemeral ports (32768-60999), not from the submitting shell
  export MASTER_PORT="${REPRO_MASTER_PORT:-$((15000 + SLURM_JOB_ID % 15000))}"
  export NCCL_DEBUG="${NCCL_DEBUG:-WARN}" TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}"
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" PYTHONUNBUFFERED=1 MLFLOW_DISABLE_TELEMETRY="${MLFLOW_DISABLE_TELEMETRY:-true}"
  export REPRO_DATA_DIR REPRO_RUN_DIR
  if [[ -n "${SLURM_CPUS_PER_TASK:-}" ]]; then  # srun (Slurm >= 22.05) no longer inherits sbatch's
    export SRUN_CPUS_PER_TASK="$SLURM_CPUS_PER_TASK"
  fi
  cd "$REPRO_ROOT"
}

parse_flags() {  # sets SMOKE, DRY_RUN and EXTRA (everything else) from the job script's arguments
  SMOKE=0 DRY_RUN=0 EXTRA=()
  local arg
  for arg in "$@"; do
    case "$arg" in
      --smoke) SMOKE=1 ;;
      --dry-run) DRY_RUN=1 ;;
      run_dir=*|--set=run_dir=*) die "run_dir is set by launch.sh ($REPRO_RUN_DIR, where it looks for the requeue marker): set REPRO_RUN_NAME (or REPRO_RUNS_DIR) instead" ;;
      *) EXTRA+=("$arg") ;;
    esac
  done
}

smoke_corpus() {  # sets SMOKE_DATA, the prefix of a small WikiText-2 corpus, preparing it once (under a lock)
  # Call it as is, never in $(...): there a failed prepare (or die) would end only the command
  # substitution (which also drops set -e), and the job would train on a corpus that is not there.
  SMOKE_DATA="${REPRO_SMOKE_DATA:-$REPRO_RUNS_DIR/smoke-data/wiki}"
  local text="$REPRO_DATA_DIR/wikitext/wikitext-2.valid.tokens"
  mkdir -p "$(dirname "$SMOKE_DATA")"
  (
    flock 9
    [[ -f "${SMOKE_DATA}_train.idx" ]] && exit 0
    [[ -f "$text" ]] || die "smoke mode needs $text: run \`repro data fetch --data-dir $REPRO_DATA_DIR\`"
    note "preparing the smoke corpus $SMOKE_DATA from $text"
    repro data prepare --input "$text" --output-prefix "$SMOKE_DATA" --data-dir "$REPRO_DATA_DIR" --workers 1 \
      --layout wikitext --split 90,10,0 --min-tokens 0 --no-dedup --no-eval-filter --no-progress
  ) 9>"$(dirname "$SMOKE_DATA")/.lock" || die "no smoke corpus at $SMOKE_DATA (the error is above): nothing launched"
}

smoke_args() {  # the train arguments of smoke mode for the script's CONFIG
  local config="$1"
  smoke_corpus
  export CUDA_VISIBLE_DEVICES=""  # CPU and gloo even on a GPU node
  TRAIN_ARGS=("$REPRO_ROOT/experiments/tiny/gpt_tiny.yaml" --set "name=smoke-${SLURM_JOB_NAME:-job}"
    --set "parallel.tp=$SLURM_NTASKS" --set train.device=cpu --set "data.train_prefix=${SMOKE_DATA}_train"
    --set "data.valid_prefix=${SMOKE_DATA}_valid" --set "data.cache_dir=$REPRO_RUN_DIR/cache"
    --set tracking.experiment=slurm-smoke --set "tracking.paper_ref=smoke test of $config")
}

launch_train() {  # launch_train CONFIG [--smoke] [--dry-run] [--set K=V ...]
  local config="$1"
  shift
  parse_flags "$@"
  TRAIN_ARGS=("$config")
  if [[ "$SMOKE" == 1 ]]; then
    smoke_args "$config"
  fi
  TRAIN_ARGS+=(--set "run_dir=$REPRO_RUN_DIR" ${EXTRA[@]+"${EXTRA[@]}"})  # (bash < 4.4: empty arrays)
  (  # one job at a time: the check creates a fresh sqlite store (the jobs of a sweep start together)
    flock 9 || note "no file lock on $REPRO_RUNS_DIR (a filesystem without flock): checking unlocked"
    repro slurm check --ntasks "$SLURM_NTASKS" "${TRAIN_ARGS[@]}"
  ) 9>"$REPRO_RUNS_DIR/.check.$(id -u).lock"
  run_step train "${TRAIN_ARGS[@]}"
}

launch_step() {  # launch_step REPRO-ARGS... [--dry-run]: any other `repro` command, one task per GPU
  parse_flags "$@"
  [[ "$SMOKE" == 0 ]] || die "--smoke is for training scripts only"
  run_step ${EXTRA[@]+"${EXTRA[@]}"}
}

forward() {  # forward SIGNAL to the running step (srun passes it to every task)
  note "received SIG$1 at $(date -Is): forwarding it to the step"
  if [[ -n "${STEP_PID:-}" ]]; then
    kill -s "$1" "$STEP_PID" 2>/dev/null || true
  fi
}

run_step() {  # srun one task per GPU running `repro ARGS...`; requeue the job if it stopped for a signal
  # --export=ALL: the tasks get this shell's environment (venv, MASTER_*, NCCL_*, REPRO_*) even when
  # the job was submitted with --export=NONE (srun would inherit that from sbatch)
  local cmd=(srun --export=ALL --kill-on-bad-exit=1 --label bash "$REPRO_ROOT/slurm/task.sh" repro "$@") status=0
  note "step: ${cmd[*]}"
  [[ "$DRY_RUN" == 0 ]] || return 0
  rm -f "$REPRO_RUN_DIR/stopped_by_signal"
  trap 'forward USR1' USR1
  trap 'forward TERM' TERM
  "${cmd[@]}" &
  STEP_PID=$!
  while true; do  # a trapped signal interrupts `wait`; wait again until the step is gone
    status=0
    wait "$STEP_PID" || status=$?
    kill -0 "$STEP_PID" 2>/dev/null || break
  done
  if [[ "$status" -gt 128 ]]; then  # the step ended between a trapped signal and kill -0: its own status
    status=0
    wait "$STEP_PID" || status=$?
  fi
  trap - USR1 TERM
  STEP_PID=""
  note "step exited with $status at $(date -Is)"
  if [[ "$status" == 0 && -f "$REPRO_RUN_DIR/stopped_by_signal" ]]; then
    note "the trainer checkpointed at iteration $(cat "$REPRO_RUN_DIR/stopped_by_signal"): requeueing job $SLURM_JOB_ID"
    scontrol requeue "$SLURM_JOB_ID"
  fi
  return "$status"
}

load_cluster_env
activate_env
setup_job
