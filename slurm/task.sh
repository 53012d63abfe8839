#!/usr/bin/env bash
# One Slurm task of a step: torchrun's rank variables from Slurm's, then the command (exec, so
# signals reach it). Used by launch.sh: srun bash slurm/task.sh repro train ...
# Sourced (launch.sh does), it only defines tasks_on_node.

tasks_on_node() {  # tasks_on_node SPEC INDEX: the task count of node INDEX in Slurm's "8(x64)" / "2(x3),1" / "2,1"
  local spec="$1" index="$2" item count reps items=()
  IFS=, read -ra items <<<"$spec"
  for item in ${items[@]+"${items[@]}"}; do
    if [[ "$item" =~ ^([0-9]+)\(x([0-9]+)\)$ ]]; then
      count="${BASH_REMATCH[1]}" reps="${BASH_REMATCH[2]}"
    elif [[ "$item" =~ ^[0-9]+$ ]]; then
      count="$item" reps=1
    else
      return 1
    fi
    if (( index < reps )); then
      echo "$count"
      return 0
    fi
    index=$((index - reps))
  done
  return 1
}

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
  set -euo pipefail
  export RANK="$SLURM_PROCID" WORLD_SIZE="$SLURM_NTASKS" LOCAL_RANK="$SLURM_LOCALID"
  # this node's task count in this step (SLURM_NTASKS_PER_NODE exists only with --ntasks-per-node,
  # and is the job's request, not the step's layout: `-N2 -n3` puts 2 tasks on one node, 1 on the other)
  LOCAL_WORLD_SIZE="$(tasks_on_node "${SLURM_STEP_TASKS_PER_NODE:-}" "${SLURM_NODEID:-0}")" \
    || LOCAL_WORLD_SIZE="${SLURM_NTASKS_PER_NODE:-$SLURM_NTASKS}"
  export LOCAL_WORLD_SIZE
  exec "$@"
fi
