#!/usr/bin/env bash
# Table 1 config 3, TP only: GPT 4.2B, 4-way TP on 4 GPU(s), batch 8.
#   sbatch slurm/scale_4b.sh    (from the repository root; or: repro slurm submit slurm/scale_4b.sh)
#SBATCH --job-name=scale_4b
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
launch_train experiments/scaling/scale_4b.yaml "$@"
