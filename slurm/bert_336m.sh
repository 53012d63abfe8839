#!/usr/bin/env bash
# Table 4/5: BERT 336M pretraining, 1-way TP x 128-way DP on 128 GPUs, 2M iterations.
#   sbatch slurm/bert_336m.sh    (from the repository root; or: repro slurm submit slurm/bert_336m.sh)
#SBATCH --job-name=bert_336m
#SBATCH --nodes=16
#SBATCH --ntasks-per-node=8
#SBATCH --gres=gpu:8
#SBATCH --exclusive
#SBATCH --mem=0
#SBATCH --time=24:00:00
#SBATCH --signal=B:USR1@300
#SBATCH --requeue
# shellcheck source=slurm/launch.sh
source "${REPRO_ROOT:-${SLURM_SUBMIT_DIR:-.}}/slurm/launch.sh"
launch_train experiments/bert/bert_336m.yaml "$@"
