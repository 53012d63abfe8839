#!/usr/bin/env bash
# Table 1 config 4, TP only: GPT 8.3B, 8-way TP on one 8-GPU node, batch 8.
#   sbatch -p debug -N1 -n2 --gres=none slurm/scale_8b.sh --smoke   (tiny CPU model, TP = task count)
#   sbatch slurm/scale_8b.sh    (from the repository root; or: repro slurm submit slurm/scale_8b.sh)
#SBATCH --job-name=scale_8b
#SBATCH --nodes=1
#SBATCH --ntasks=8
#SBATCH --gres=gpu:8
#SBATCH --exclusive
#SBATCH --mem=0
#SBATCH --time=04:00:00
#SBATCH --signal=B:USR1@300
#SBATCH --requeue
# shellcheck source=slurm/launch.sh
source "${REPRO_ROOT:-${SLURM_SUBMIT_DIR:-.}}/slurm/launch.sh"
launch_train experiments/scaling/scale_8b.yaml "$@"
