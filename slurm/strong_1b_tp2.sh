#!/usr/bin/env bash
# Appendix D Table 8, strong scaling: GPT 1.2B, batch 8, 2-way TP on 2 GPUs of one node.
#   sbatch slurm/strong_1b_tp2.sh    (from the repository root; or: repro slurm sweep table8)
#SBATCH --job-name=strong_1b_tp2
#SBATCH --nodes=1
#SBATCH --ntasks=2
#SBATCH --gres=gpu:2
#SBATCH --exclusive
#SBATCH --mem=0
#SBATCH --time=04:00:00
#SBATCH --signal=B:USR1@300
#SBATCH --requeue
# shellcheck source=slurm/launch.sh
source "${REPRO_ROOT:-${SLURM_SUBMIT_DIR:-.}}/slurm/launch.sh"
launch_train experiments/scaling/strong_1b_tp2.yaml "$@"
