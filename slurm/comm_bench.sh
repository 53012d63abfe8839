#!/usr/bin/env bash
# All-reduce bandwidth and latency inside a node (8 GPUs, NVLink/NVSwitch) and across the 2 nodes
# (InfiniBand, every local rank's group at once), as nccl-tests reports them (bus bandwidth), at
# 8 B - 64 MiB: `repro comm-bench`. Writes comm_bench.{md,json} into the run dir, ending with the
# network fields of a cluster file for `repro plan --cluster FILE` (slurm/clusters/h200.yaml). A minute.
#   sbatch slurm/comm_bench.sh
#   sbatch -p debug -N2 --ntasks-per-node=2 --gres=none slurm/comm_bench.sh --smoke   # CPU and gloo
#SBATCH --job-name=comm_bench
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=8
#SBATCH --gres=gpu:8
#SBATCH --exclusive
#SBATCH --mem=0
#SBATCH --time=00:15:00
# shellcheck source=slurm/launch.sh
source "${REPRO_ROOT:-${SLURM_SUBMIT_DIR:-.}}/slurm/launch.sh"
parse_flags "$@"
ARGS=(--out "$REPRO_RUN_DIR")
if [[ "$SMOKE" == 1 ]]; then
  export CUDA_VISIBLE_DEVICES=""  # CPU and gloo even on a GPU node
  ARGS+=(--sizes "8,64K,1M" --iters 5)
fi
ARGS+=(${EXTRA[@]+"${EXTRA[@]}"})
[[ "$DRY_RUN" == 0 ]] || ARGS+=(--dry-run)
launch_step comm-bench "${ARGS[@]}"
