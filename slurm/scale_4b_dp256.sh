#!/usr/bin/env bash
# Table 1 config 3, TP+DP: GPT 4.2B, 4-way TP x 64-way DP on 256 GPUs, global batch 512.
#   sbatch slurm/scale_4b_dp256.sh    (from the repository root; or: repro slurm submit slurm/scale_4b_dp256.sh)
#SBATCH --job-name=scale_4b_dp256
#SBATCH --nodes=32
#SBATCH --ntasks-per-node=8
#SBATCH --gres=gpu:8
#SBATCH --exclusive
#SBATCH --mem=0
#SBATCH --time=04:00:00
#SBATCH --signal=B:USR1@300
#SBATCH --requeue
# shellcheck source=slurm/launch.sh
source "${REPRO_ROOT:-${SLURM_SUBMIT_DIR:-.}}/slurm/launch.sh"
launch_train experiments/scaling/scale_4b_dp256.yaml "$@"
