#!/usr/bin/env bash
# Table 4/5: BERT 1.3B pretraining, 2-way TP x 128-way DP on 256 GPUs, 2M iterations.
#   sbatch slurm/bert_1.3b.sh    (from the repository root; or: repro slurm submit slurm/bert_1.3b.sh)
#SBATCH --job-name=bert_1.3b
#SBATCH --nodes=32
#SBATCH --ntasks-per-node=8
#SBATCH --gres=gpu:8
#SBATCH --exclusive
#SBATCH --mem=0
#SBATCH --time=24:00:00
#SBATCH --signal=B:USR1@300
#SBATCH --requeue
# shellcheck source=slurm/launch.sh
source "${REPRO_ROOT:-${SLURM_SUBMIT_DIR:-.}}/slurm/launch.sh"
launch_train experiments/bert/bert_1.3b.yaml "$@"
