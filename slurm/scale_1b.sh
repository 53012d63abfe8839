#!/usr/bin/env bash
# Table 1 config 1, TP only: GPT 1.2B, 1-way TP on 1 GPU(s), batch 8.
#   sbatch slurm/scale_1b.sh    (from the repository root; or: repro slurm submit slurm/scale_1b.sh)
#SBATCH --job-name=scale_1b
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --gres=gpu:1
#SBATCH --exclusive
#SBATCH --mem=0
#SBATCH --time=04:00:00
#SBATCH --signal=B:USR1@300
#SBATCH --requeue
# shellcheck source=slurm/launch.sh
source "${REPRO_ROOT:-${SLURM_SUBMIT_DIR:-.}}/slurm/launch.sh"
launch_train experiments/scaling/scale_1b.yaml "$@"
