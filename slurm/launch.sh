#!/usr/bin/env bash
# The one launcher behind every slurm/*.sh job script. A job script sources it, then launches:
#
#   source "${REPRO_ROOT:-${SLURM_SUBMIT_DIR:-.}}/slurm/launch.sh"
#   launch_train experiments/scaling/scale_8b.yaml "$@"      # or: launch_step eval lambada ...
#
# Sourcing loads the cluster settings (the environment, then slurm/cluster.env, copied from
# slurm/cluster.env.example: a REPRO_* variable given at sbatch time wins over the file),
# checks them and prepares the job: run directory, per-job log, the rank-0 host and a free port, CPUs
# per task, NCCL settings, the Python environment. Nothing runs on the compute tasks before every
# check passed. Steps run one task per GPU (`srun slurm/task.sh repro ...`).
# Stopping: USR1 to the batch shell (the scripts' `--signal=B:USR1@300` warning before the time
# limit, or `scancel --batch --signal=USR1 JOB`) is forwarded to the step; the trainer checkpoints,
# exits 0 and leaves RUN_DIR/stopped_by_signal, the job requeues itself and the next start resumes
# from the checkpoint. A TERM that reaches the batch shell alone is forwarded as USR1. A TERM that
# Slurm sends to the job's steps (time limit reached, plain scancel, preemption) also reaches srun,
# which answers it by SIGKILLing every task ("forcing job termination"): no checkpoint. A USR1 before
# the step started (a preemption's warning during setup) requeues the job without starting it.
#
# Arguments after the config (the job script's "$@"):
#   --smoke     a tiny model of the config's family (GPT, or BERT for experiments/bert/) on CPU (gloo),
#               TP = the allocation's task count, a small WikiText-2 corpus in that family's tokenizer
#   --dry-run   check and print the step without running it
#   --set K=V   config overrides passed to `repro train`
set -euo pipefail

die() { echo "launch.sh: error: $*" >&2; exit 2; }
note() { echo "launch.sh: $*"; }
REQUEUE_FAILED=3  # the job's exit status when it checkpointed but `scontrol requeue` failed
JOB_ARGS=()       # the job script's arguments (requeue_checks), for the command that continues a run
SUBMIT_ENV=()     # NAME=VALUE of the REPRO_* variables given at submit time: that command repeats them
while IFS= read -r name; do
  [[ "$name" != REPRO_* ]] || SUBMIT_ENV+=("$name=${!name}")
done < <(compgen -e)

need() {  # need VAR "what it is"
  [[ -n "${!1:-}" ]] || die "$1 is not set: $2. Set it in slurm/cluster.env (see slurm/cluster.env.example) or export it before sbatch"
}

load_cluster_env() {
  REPRO_ROOT="$(cd "${REPRO_ROOT:-${SLURM_SUBMIT_DIR:-$PWD}}" && pwd)"
  [[ -f "$REPRO_ROOT/slurm/launch.sh" ]] \
    || die "REPRO_ROOT=$REPRO_ROOT is not the repository: submit from the repository root or set REPRO_ROOT"
  # shellcheck source=slurm/task.sh
  source "$REPRO_ROOT/slurm/task.sh"  # tasks_on_node
  local env_file="${REPRO_CLUSTER_ENV:-$REPRO_ROOT/slurm/cluster.env}"
  if [[ -f "$env_file" ]]; then
    source_cluster_env "$env_file"
  elif [[ -n "${REPRO_CLUSTER_ENV:-}" ]]; then
    die "REPRO_CLUSTER_ENV=$REPRO_CLUSTER_ENV does not exist: copy slurm/cluster.env.example there"
  fi
  need REPRO_RUNS_DIR "the shared directory for run directories (checkpoints, metrics, logs)"
  need REPRO_DATA_DIR "the shared data directory filled by \`repro data fetch\` (vocabularies, eval sets, corpora)"
  # absolute once, relative paths from the repository root: the batch shell starts in the submit
  # directory, the tasks run in REPRO_ROOT, and both must name the same run dir
  REPRO_RUNS_DIR="$(cd "$REPRO_ROOT" && realpath -m -- "$REPRO_RUNS_DIR")"
  REPRO_DATA_DIR="$(cd "$REPRO_ROOT" && realpath -m -- "$REPRO_DATA_DIR")"
  export REPRO_RUNS_DIR REPRO_DATA_DIR
  REPRO_ENV_ACTIVATE="${REPRO_ENV_ACTIVATE:-$REPRO_ROOT/.venv/bin/activate}"
  [[ -n "${SLURM_JOB_ID:-}" ]] || die "not inside a Slurm job (no SLURM_JOB_ID): submit the script with sbatch. \
A dry run also runs in a job: \`sbatch ${0#"$REPRO_ROOT"/} --dry-run\` logs its steps and launches none, and \
\`repro slurm submit --dry-run ${0#"$REPRO_ROOT"/}\` prints the sbatch command without submitting"
}

source_cluster_env() {  # source_cluster_env FILE: its variables, exported; for REPRO_* the environment's win
  # A REPRO_* value given at submit time (REPRO_RUN_NAME=x sbatch ...) is not replaced by the shared
  # file, which every job and every requeued piece reads again; other lines apply as written
  # (PATH=/site/bin:$PATH, LD_LIBRARY_PATH, NCCL_*).
  local file="$1" item name saved=()
  while IFS= read -r -d '' item; do saved+=("$item"); done < <(env -0)
  set -a +u  # a site's `LD_LIBRARY_PATH=/opt/nccl/lib:$LD_LIBRARY_PATH` with it unset is not an error here
  # shellcheck source=/dev/null
  source "$file"
  set +a -u
  for item in ${saved[@]+"${saved[@]}"}; do
    name="${item%%=*}"
    [[ "$name" =~ ^REPRO_[A-Za-z0-9_]*$ && "${!name-}" != "${item#*=}" ]] || continue
    export "${item?}" 2>/dev/null || true  # (a read-only one, which the file could not change either)
  done
  local -A what=([REPRO_RUN_NAME]="run dir" [REPRO_MASTER_PORT]="rendezvous port" [REPRO_MASTER_ADDR]="rank-0 address")
  for name in REPRO_RUN_NAME REPRO_MASTER_PORT REPRO_MASTER_ADDR; do  # one job's, never the shared file's
    [[ -n "${!name+x}" ]] || continue
    for item in ${saved[@]+"${saved[@]}"}; do
      [[ "$item" != "$name="* ]] || continue 2  # from the environment
    done
    die "$name is set in $file, which every job (and every requeued piece) reads: all of them would share one ${what[$name]}. It belongs to one job: remove the line and give it at submit time, e.g. $name=${!name} sbatch slurm/SCRIPT.sh"
  done
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
  local hosts nodelist="${SLURM_JOB_NODELIST:-$(hostname -s)}"
  hosts="$(scontrol show hostnames "$nodelist")" \
    || die "\`scontrol show hostnames $nodelist\` failed (its error is above): no rank-0 host for MASTER_ADDR"
  [[ -n "${hosts%%$'\n'*}" ]] || die "\`scontrol show hostnames $nodelist\` printed no host: no rank-0 host for MASTER_ADDR"
  pick_master_addr "${hosts%%$'\n'*}"
  pick_master_port
  note "rank-0 rendezvous $MASTER_ADDR:$MASTER_PORT"
  export NCCL_DEBUG="${NCCL_DEBUG:-WARN}" TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}"
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" PYTHONUNBUFFERED=1 MLFLOW_DISABLE_TELEMETRY="${MLFLOW_DISABLE_TELEMETRY:-true}"
  export REPRO_DATA_DIR REPRO_RUN_DIR
  set_cpus_per_task
  cd "$REPRO_ROOT"
}

resolves() {  # resolves HOST: getaddrinfo finds HOST here (DNS, /etc/hosts; an IP address always), as the ranks' will
  getent ahosts "$1" >/dev/null 2>&1
}

node_addr() {  # node_addr NODE: its NodeAddr in `scontrol show node` (the address slurmctld reaches it by), else nothing
  local record
  record="$(scontrol show node -o "$1" 2>/dev/null)" || return 0
  [[ ! "$record" =~ (^|[[:space:]])NodeAddr=([^[:space:]]+) ]] || echo "${BASH_REMATCH[2]}"
}

pick_master_addr() {  # pick_master_addr NODE: MASTER_ADDR: REPRO_MASTER_ADDR (given at submit time), else the
  # first node's Slurm name when it resolves here, else its NodeAddr. Slurm does not need NodeName to be
  # a host name (cloud nodes: NodeName=cloud1 NodeAddr=10.0.0.5); the ranks would retry it until timeout.
  local node="$1" addr
  if [[ -n "${REPRO_MASTER_ADDR:-}" ]]; then
    export MASTER_ADDR="$REPRO_MASTER_ADDR"
    return 0
  fi
  export MASTER_ADDR="$node"
  resolves "$node" && return 0
  addr="$(node_addr "$node")"
  [[ "$addr" != "$node" ]] || addr=""  # (Slurm's default NodeAddr is the NodeName)
  if [[ -n "$addr" ]] && resolves "$addr"; then
    note "the first node's Slurm name $node does not resolve on $(hostname -s): MASTER_ADDR is its NodeAddr $addr"
    export MASTER_ADDR="$addr"
    return 0
  fi
  die "MASTER_ADDR=$node (the first node's Slurm name) does not resolve on $(hostname -s)${addr:+, nor does its NodeAddr $addr}: give an address of that node with REPRO_MASTER_ADDR=ADDR sbatch ..., or fix DNS"
}

port_in_use() {  # port_in_use PORT: something on this host listens on TCP PORT
  if command -v ss >/dev/null; then
    [[ "$(ss -ltn "sport = :$1" 2>/dev/null | wc -l)" -gt 1 ]]  # (a header line, then the sockets)
  elif command -v python3 >/dev/null; then
    if python3 -c 'import socket, sys; socket.socket().bind(("", int(sys.argv[1])))' "$1" 2>/dev/null; then
      return 1
    fi
  else
    (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
  fi
}

pick_master_port() {  # MASTER_PORT: REPRO_MASTER_PORT (given at submit time), else the first free port from one the job id gives
  # The batch shell runs on the allocation's first node, which is MASTER_ADDR and rank 0's host,
  # so the probe looks where rank 0 will listen. The range 15000-29999 is below Linux's ephemeral
  # ports (32768-60999).
  if [[ -n "${REPRO_MASTER_PORT:-}" ]]; then
    export MASTER_PORT="$REPRO_MASTER_PORT"
    if port_in_use "$MASTER_PORT"; then
      note "WARNING: REPRO_MASTER_PORT=$MASTER_PORT is in use on $(hostname -s): rank 0 will fail to listen on it"
    fi
    return 0
  fi
  local base=$((15000 + SLURM_JOB_ID % 15000)) port tries
  port="$base"
  for ((tries = 0; tries < 100; tries++)); do
    port_in_use "$port" || break
    port=$((15000 + (port - 15000 + 1) % 15000))
  done
  (( tries < 100 )) || die "ports $base.. (100 of them) are all in use on $(hostname -s): give one with REPRO_MASTER_PORT=PORT sbatch ..."
  [[ "$port" == "$base" ]] || note "port $base is in use on $(hostname -s): rank 0 listens on $port"
  export MASTER_PORT="$port"
}

set_cpus_per_task() {  # SRUN_CPUS_PER_TASK: srun (Slurm >= 22.05) no longer inherits sbatch's --cpus-per-task
  if [[ -n "${SLURM_CPUS_PER_GPU:-}" ]]; then  # srun reads it too, and refuses it beside --cpus-per-task
    note "CPUs per GPU: $SLURM_CPUS_PER_GPU (sbatch --cpus-per-gpu)"
    return 0
  fi
  if [[ -n "${SLURM_CPUS_PER_TASK:-}" ]]; then
    export SRUN_CPUS_PER_TASK="$SLURM_CPUS_PER_TASK"
    return 0
  fi
  # None asked for: this node's CPUs shared out among its tasks (the whole node's with --exclusive),
  # so that a rank and its data-loader workers do not share the one CPU a task gets by default.
  local tasks
  tasks="$(tasks_on_node "${SLURM_TASKS_PER_NODE:-}" 0)" || tasks="${SLURM_NTASKS_PER_NODE:-${SLURM_NTASKS:-1}}"
  if [[ -n "${SLURM_CPUS_ON_NODE:-}" ]] && (( tasks > 0 && SLURM_CPUS_ON_NODE / tasks >= 1 )); then
    export SRUN_CPUS_PER_TASK=$((SLURM_CPUS_ON_NODE / tasks))
    note "CPUs per task: $SRUN_CPUS_PER_TASK ($SLURM_CPUS_ON_NODE on the node, $tasks tasks)"
  fi
}

take_lock() {  # take_lock FD FILE WHAT: flock FD (open on FILE), waiting at most REPRO_LOCK_WAIT_S [600] s
  local wait_s="${REPRO_LOCK_WAIT_S:-600}" status=0
  flock -w "$wait_s" -E 75 "$1" || status=$?
  case "$status" in
    0) ;;
    75) die "waited $wait_s s for the lock $2 ($3): another job of this user holds it and may hang there (see \`squeue --me\` and that job's log); nothing launched" ;;
    *) note "no file lock on $2 (a filesystem without flock?): $3 unlocked" ;;
  esac
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

smoke_corpus() {  # smoke_corpus gpt2|bert: sets SMOKE_DATA, the prefix of a small WikiText-2 corpus in
  # that model's tokenizer, preparing it once (under a lock).
  # Call it as is, never in $(...): there a failed prepare (or die) would end only the command
  # substitution (which also drops set -e), and the job would train on a corpus that is not there.
  local tokenizer="$1"
  if [[ "$tokenizer" == bert ]]; then
    SMOKE_DATA="${REPRO_SMOKE_BERT_DATA:-$REPRO_RUNS_DIR/smoke-data/wiki_bert}"
  else
    SMOKE_DATA="${REPRO_SMOKE_DATA:-$REPRO_RUNS_DIR/smoke-data/wiki}"
  fi
  local text="$REPRO_DATA_DIR/wikitext/wikitext-2.valid.tokens"
  local lock
  lock="$(dirname "$SMOKE_DATA")/.lock"
  mkdir -p "$(dirname "$SMOKE_DATA")"
  # shellcheck disable=SC2094  # take_lock only names the lock file in its messages
  (
    take_lock 9 "$lock" "the smoke corpus"
    [[ -f "${SMOKE_DATA}_train.idx" ]] && exit 0
    [[ -f "$text" ]] || die "smoke mode needs $text: run \`repro data fetch --data-dir $REPRO_DATA_DIR\`"
    note "preparing the smoke corpus $SMOKE_DATA from $text"
    repro data prepare --input "$text" --output-prefix "$SMOKE_DATA" --data-dir "$REPRO_DATA_DIR" --workers 1 \
      --tokenizer "$tokenizer" --layout wikitext --split 90,10,0 --min-tokens 0 --no-dedup --no-eval-filter --no-progress
  ) 9>"$lock" || die "no smoke corpus at $SMOKE_DATA (the error is above): nothing launched"
}

smoke_tp() {  # smoke mode's TP degree: one node's task count when every node runs as many (TP inside
  # a node, DP across nodes: the paper's layout), else every task of the job
  if [[ "${SLURM_TASKS_PER_NODE:-}" =~ ^([0-9]+)(\(x[0-9]+\))?$ ]]; then
    echo "${BASH_REMATCH[1]}"
  else
    echo "$SLURM_NTASKS"
  fi
}

smoke_args() {  # the train arguments of smoke mode for the script's CONFIG: a tiny model of its family
  local config="$1" tokenizer=gpt2 tiny="$REPRO_ROOT/experiments/tiny/gpt_tiny.yaml"
  if [[ "$config" == */bert/* ]]; then
    tokenizer=bert tiny="$REPRO_ROOT/experiments/bert/tiny_cpu.yaml"
  fi
  smoke_corpus "$tokenizer"
  export CUDA_VISIBLE_DEVICES=""  # CPU and gloo even on a GPU node
  TRAIN_ARGS=("$tiny" --set "name=smoke-${SLURM_JOB_NAME:-job}"
    --set "parallel.tp=$(smoke_tp)" --set train.device=cpu --set "data.train_prefix=${SMOKE_DATA}_train"
    --set "data.valid_prefix=${SMOKE_DATA}_valid" --set "data.cache_dir=$REPRO_RUN_DIR/cache"
    --set tracking.experiment=slurm-smoke --set "tracking.paper_ref=smoke test of $config")
}

launch_train() {  # launch_train CONFIG [--smoke] [--dry-run] [--set K=V ...]
  local config="$1"
  shift
  requeue_checks "$@"
  restart_checks
  parse_flags "$@"
  TRAIN_ARGS=("$config")
  if [[ "$SMOKE" == 1 ]]; then
    smoke_args "$config"
  fi
  TRAIN_ARGS+=(--set "run_dir=$REPRO_RUN_DIR" ${EXTRA[@]+"${EXTRA[@]}"})  # (bash < 4.4: empty arrays)
  local lock
  lock="$REPRO_RUNS_DIR/.check.$(id -u).lock"
  # shellcheck disable=SC2094  # take_lock only names the lock file in its messages
  (  # one job at a time: the check creates a fresh sqlite store (the jobs of a sweep start together)
    take_lock 9 "$lock" "the config check"
    repro slurm check --ntasks "$SLURM_NTASKS" "${TRAIN_ARGS[@]}" --require-data
  ) 9>"$lock"
  run_step train "${TRAIN_ARGS[@]}"
}

requeue_checks() {  # requeue_checks SCRIPT-ARGS...: for a job that requeues itself after a stop (USR1).
  # Keeps the job's arguments and script path for the command that continues it (requeue_failed) and
  # warns when the job is not requeueable.
  local record args
  JOB_ARGS=("$@") JOB_COMMAND=""
  if record="$(scontrol show job -o "$SLURM_JOB_ID" 2>&1)"; then
    if [[ "$record" == *" Command="* ]]; then  # "Command=SCRIPT ARGS... WorkDir=...": paths may hold spaces
      JOB_COMMAND="${record#* Command=}"
      JOB_COMMAND="${JOB_COMMAND%% WorkDir=*}"
      args="${JOB_ARGS[*]-}"
      [[ -z "$args" ]] || JOB_COMMAND="${JOB_COMMAND% "$args"}"
      [[ -f "$JOB_COMMAND" ]] || JOB_COMMAND=""
    fi
    if ! [[ "$record" =~ (^|[[:space:]])Requeue=1([[:space:]]|$) ]]; then
      note "WARNING: job $SLURM_JOB_ID is not requeueable (no Requeue=1 in \`scontrol show job\`; the scripts ask for --requeue, a site may refuse it): a stop for USR1 saves the run's state, then the job ends with exit $REQUEUE_FAILED and prints the sbatch command that continues the run"
    fi
  else
    note "WARNING: \`scontrol show job $SLURM_JOB_ID\` failed ($record): cannot tell whether the job may requeue itself"
  fi
}

restart_checks() {  # a restarted training job that finds no checkpoint says so loudly
  if [[ "${SLURM_RESTART_COUNT:-0}" -gt 0 && ! -f "$REPRO_RUN_DIR/checkpoints/latest" ]]; then
    note "WARNING: ************************************************************************"
    note "WARNING: restart ${SLURM_RESTART_COUNT} of job $SLURM_JOB_ID, but its run dir $REPRO_RUN_DIR holds no checkpoint"
    note "WARNING: (no checkpoints/latest): training starts again from iteration 0. Likely cause: slurm/cluster.env"
    note "WARNING: (REPRO_RUNS_DIR) changed between the pieces of this job, so this piece looks in another run dir"
    note "WARNING: (the job's Slurm output file names each piece's run dir); else the job was requeued"
    note "WARNING: (preemption, node failure) before its first checkpoint. To go on from the earlier dir: scancel"
    note "WARNING: $SLURM_JOB_ID, then REPRO_RUNS_DIR=<its parent> REPRO_RUN_NAME=<its name> sbatch the script again."
    note "WARNING: ************************************************************************"
  fi
}

requeue_failed() {  # the checkpoint is saved but the job cannot requeue itself: how to go on, then exit
  local script="${JOB_COMMAND:-$REPRO_ROOT/slurm/${SLURM_JOB_NAME:-SCRIPT}.sh}" cmd="" arg
  for arg in ${SUBMIT_ENV[@]+"${SUBMIT_ENV[@]}"}; do  # e.g. REPRO_BERT_CHECKPOINT: the new job needs them too
    [[ "$arg" == REPRO_RUNS_DIR=* || "$arg" == REPRO_RUN_NAME=* ]] || cmd+="${arg%%=*}=$(printf %q "${arg#*=}") "
  done
  cmd+="REPRO_RUNS_DIR=$(printf %q "$REPRO_RUNS_DIR") REPRO_RUN_NAME=$(printf %q "${REPRO_RUN_DIR##*/}") sbatch $(printf %q "$script")"
  for arg in ${JOB_ARGS[@]+"${JOB_ARGS[@]}"}; do
    cmd+=" $(printf %q "$arg")"
  done
  note "ERROR: \`scontrol requeue $SLURM_JOB_ID\` failed (above): the checkpoint is saved, but this job will not"
  note "restart itself. Unless Slurm requeues it anyway (preemption with PreemptMode=REQUEUE: see \`squeue -j $SLURM_JOB_ID\`),"
  note "continue the run with a new job, from the repository root and with this job's other sbatch options:"
  note "    $cmd"
  exit "$REQUEUE_FAILED"
}

launch_step() {  # launch_step REPRO-ARGS... [--dry-run]: any other `repro` command, one task per GPU
  parse_flags "$@"
  [[ "$SMOKE" == 0 ]] || die "--smoke is for training scripts only"
  repro slurm check-network  # NCCL_/GLOO_SOCKET_IFNAME, as `repro slurm check` does for training
  run_step ${EXTRA[@]+"${EXTRA[@]}"}
}

forward() {  # forward SIGNAL to the running step (srun passes it to every task)
  # TERM goes on as USR1: srun answers a TERM by SIGKILLing every task of the step ("forcing job
  # termination"), so the trainer could not checkpoint; USR1 passes through srun unchanged, and the
  # trainer (and `repro data prepare`) stop on it as on TERM. This helps only where the TERM reaches
  # this shell alone (`scancel --batch --signal=TERM`): a TERM Slurm sends to the job's steps (time
  # limit, plain scancel, preemption) reaches srun itself too.
  local sig="$1"
  [[ "$sig" != TERM ]] || sig=USR1
  note "received SIG$1 at $(date -Is): forwarding SIG$sig to the step"
  if [[ -n "${STEP_PID:-}" ]]; then
    kill -s "$sig" "$STEP_PID" 2>/dev/null || true
  fi
}

run_step() {  # srun one task per GPU running `repro ARGS...`; requeue the job if it stopped for a signal
  # --export=ALL: the tasks get this shell's environment (venv, MASTER_*, NCCL_*, REPRO_*) even when
  # the job was submitted with --export=NONE (srun would inherit that from sbatch)
  local cmd=(srun --export=ALL --kill-on-bad-exit=1 --label bash "$REPRO_ROOT/slurm/task.sh" repro "$@") status=0
  note "step: ${cmd[*]}"
  [[ "$DRY_RUN" == 0 ]] || return 0
  if [[ -n "$EARLY_SIGNAL" ]]; then  # (a preemption's warning during setup, or the lock wait)
    note "SIG$EARLY_SIGNAL came before the step started: requeueing job $SLURM_JOB_ID without starting it"
    scontrol requeue "$SLURM_JOB_ID" || requeue_failed
    return 0
  fi
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
  trap 'early_signal USR1' USR1
  trap - TERM
  STEP_PID=""
  note "step exited with $status at $(date -Is)"
  if [[ "$status" == 0 && -f "$REPRO_RUN_DIR/stopped_by_signal" ]]; then
    local saved
    saved="$(cat "$REPRO_RUN_DIR/stopped_by_signal")"  # the trainer's iteration, or where else it stopped ("race seed N")
    [[ ! "$saved" =~ ^[0-9]+$ ]] || saved="iteration $saved (checkpointed)"
    note "the step stopped for the signal at $saved: requeueing job $SLURM_JOB_ID"
    scontrol requeue "$SLURM_JOB_ID" || requeue_failed
  fi
  return "$status"
}

early_signal() {  # a USR1 while no step runs (setup, a lock wait): remembered, as its default action
  # would end the job with no requeue; run_step then requeues the job without starting the step.
  # (Not TERM: a plain scancel TERMs the batch shell too, and a requeue would undo the cancel.)
  EARLY_SIGNAL="$1"
  note "received SIG$1 at $(date -Is), while no step runs"
}

EARLY_SIGNAL=""
trap 'early_signal USR1' USR1
load_cluster_env
activate_env
setup_job
