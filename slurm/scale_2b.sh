#!/usr/bin/env bash
# Table 1 config 2, TP only: GPT 2.5B, 2-way TP on 2 GPU(s), batch 8.
#   sbatch slurm/scale_2b.sh    (from the repository root; or: repro slurm submit slurm/scale_2b.sh)
#SBATCH --job-name=scale_2b
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
launch_train experiments/scaling/scale_2b.yaml "$@"
