#!/usr/bin/env bash
# Table 1 config 4, TP+DP: GPT 8.3B, 8-way TP x 64-way DP on 512 GPUs, global batch 512.
#   sbatch slurm/scale_8b_dp512.sh    (from the repository root; or: repro slurm submit slurm/scale_8b_dp512.sh)
#SBATCH --job-name=scale_8b_dp512
#SBATCH --nodes=64
#SBATCH --ntasks-per-node=8
#SBATCH --gres=gpu:8
#SBATCH --exclusive
#SBATCH --mem=0
#SBATCH --time=04:00:00
#SBATCH --signal=B:USR1@300
#SBATCH --requeue
# shellcheck source=slurm/launch.sh
source "${REPRO_ROOT:-${SLURM_SUBMIT_DIR:-.}}/slurm/launch.sh"
launch_train experiments/scaling/scale_8b_dp512.yaml "$@"
