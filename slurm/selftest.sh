#!/usr/bin/env bash
# Before the paper's runs: on 2 nodes x 8 GPUs, check that every TP x DP layout of the 16 ranks (TP up
# to 8, inside a node; DP across the nodes) reproduces the serial model over NCCL: logits, loss,
# every gradient, the grad norm, the vocab-parallel cross-entropy, dropout RNG and activation
# checkpointing, the paper's all-reduce count (`repro selftest`). Prints where the ranks ran and a
# table of checks in the job's log, and fails the job on any failed check. A few minutes.
#   sbatch slurm/selftest.sh                        (-N4 for 32 ranks: more DP layouts)
#   sbatch -p debug -N2 --ntasks-per-node=2 --gres=none slurm/selftest.sh --smoke   # CPU and gloo
#SBATCH --job-name=selftest
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=8
#SBATCH --gres=gpu:8
#SBATCH --exclusive
#SBATCH --mem=0
#SBATCH --time=00:30:00
# shellcheck source=slurm/launch.sh
source "${REPRO_ROOT:-${SLURM_SUBMIT_DIR:-.}}/slurm/launch.sh"
parse_flags "$@"
if [[ "$SMOKE" == 1 ]]; then
  export CUDA_VISIBLE_DEVICES=""  # CPU and gloo even on a GPU node
fi
ARGS=(${EXTRA[@]+"${EXTRA[@]}"})
[[ "$DRY_RUN" == 0 ]] || ARGS+=(--dry-run)
launch_step selftest ${ARGS[@]+"${ARGS[@]}"}
