#!/usr/bin/env bash
# Table 1 config 2, TP+DP: GPT 2.5B, 2-way TP x 64-way DP on 128 GPUs, global batch 512.
#   sbatch slurm/scale_2b_dp128.sh    (from the repository root; or: repro slurm submit slurm/scale_2b_dp128.sh)
#SBATCH --job-name=scale_2b_dp128
#SBATCH --nodes=16
#SBATCH --ntasks-per-node=8
#SBATCH --gres=gpu:8
#SBATCH --exclusive
#SBATCH --mem=0
#SBATCH --time=04:00:00
#SBATCH --signal=B:USR1@300
#SBATCH --requeue
# shellcheck source=slurm/launch.sh
source "${REPRO_ROOT:-${SLURM_SUBMIT_DIR:-.}}/slurm/launch.sh"
launch_train experiments/scaling/scale_2b_dp128.yaml "$@"
