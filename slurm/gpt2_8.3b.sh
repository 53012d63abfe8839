#!/usr/bin/env bash
# Table 2/3: GPT-2 8.3B, 8-way TP x 64-way DP on 512 GPUs, 300k iterations.
# Runs in 24 h pieces: 5 min before the limit the trainer checkpoints and the job requeues itself.
#   sbatch slurm/gpt2_8.3b.sh    (from the repository root; or: repro slurm submit slurm/gpt2_8.3b.sh)
#SBATCH --job-name=gpt2_8.3b
#SBATCH --nodes=64
#SBATCH --ntasks-per-node=8
#SBATCH --gres=gpu:8
#SBATCH --exclusive
#SBATCH --mem=0
#SBATCH --time=24:00:00
#SBATCH --signal=B:USR1@300
#SBATCH --requeue
# shellcheck source=slurm/launch.sh
source "${REPRO_ROOT:-${SLURM_SUBMIT_DIR:-.}}/slurm/launch.sh"
launch_train experiments/gpt2/gpt2_8.3b.yaml "$@"
