#!/usr/bin/env bash
# Appendix D Table 8, strong scaling: GPT 1.2B, batch 8, 4-way TP on 4 GPUs of one node.
#   sbatch slurm/strong_1b_tp4.sh    (from the repository root; or: repro slurm sweep table8)
#SBATCH --job-name=strong_1b_tp4
#SBATCH --nodes=1
#SBATCH --ntasks=4
#SBATCH --gres=gpu:4
#SBATCH --exclusive
#SBATCH --mem=0
#SBATCH --time=04:00:00
#SBATCH --signal=B:USR1@300
#SBATCH --requeue
# shellcheck source=slurm/launch.sh
source "${REPRO_ROOT:-${SLURM_SUBMIT_DIR:-.}}/slurm/launch.sh"
launch_train experiments/scaling/strong_1b_tp4.yaml "$@"
