#!/usr/bin/env bash
# Appendix D Table 7: GPT 8.3B with 24 attention heads, 8-way TP on one 8-GPU node, batch 8.
#   sbatch -p debug -N1 -n2 --gres=none slurm/heads_8b_24.sh --smoke   (tiny CPU model, TP = task count)
#   sbatch slurm/heads_8b_24.sh    (from the repository root; or: repro slurm sweep table7)
#SBATCH --job-name=heads_8b_24
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
launch_train experiments/scaling/heads_8b_24.yaml "$@"
