#!/usr/bin/env bash
# One Slurm task of a step: torchrun's rank variables from Slurm's, then the command (exec, so
# signals reach it). Used by launch.sh: srun bash slurm/task.sh repro train ...
set -euo pipefail
export RANK="$SLURM_PROCID" WORLD_SIZE="$SLURM_NTASKS" LOCAL_RANK="$SLURM_LOCALID"
export LOCAL_WORLD_SIZE="${SLURM_NTASKS_PER_NODE:-$SLURM_NTASKS}"
exec "$@"
