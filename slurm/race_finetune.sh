#!/usr/bin/env bash
# Table 5: RACE fine-tuning of a pretrained BERT (a run of experiments/bert/bert_336m.yaml by default) on
# one 8-GPU node with the paper's batch/lr for the checkpoint's size (or REPRO_RACE_SIZE); 5 seeds, the
# median by dev accuracy reported. TP: REPRO_RACE_TP, else the smallest that fits the GPU (3.9B on
# 32 GB V100s: 4), the rest DP. Precision: REPRO_RACE_PRECISION [fp16] (autocast over fp32 weights,
# dynamic loss scaling; bf16 on A100/H100/H200, fp32 for the old behaviour).
# Resume by seed: each finished seed is saved in the run dir; Slurm's USR1 warning 5 min before the
# time limit stops the current seed, and the job requeues itself and goes on from the first unfinished
# seed (that seed starts again). One seed must therefore fit in the time limit.
# REPRO_BERT_CHECKPOINT: the BERT training run directory (or a file written by save_bert).
#   REPRO_BERT_CHECKPOINT=RUNS/bert_336m-1234 REPRO_RACE_DIR=... sbatch slurm/race_finetune.sh [--epochs 3]
#   REPRO_BERT_CHECKPOINT=... sbatch -p debug -N1 -n2 --gres=none slurm/race_finetune.sh --smoke
# --smoke: CPU, TP = one node's task count (the rest DP), REPRO_RACE_DIR defaults to the 17-question tests/fixtures/race,
# sequences of 64 tokens, 2 epochs of batch 5 at lr 1e-3, 2 seeds; MLflow size "smoke", not a paper size.
#SBATCH --job-name=race_finetune
#SBATCH --nodes=1
#SBATCH --ntasks=8
#SBATCH --gres=gpu:8
#SBATCH --exclusive
#SBATCH --mem=0
#SBATCH --time=24:00:00
#SBATCH --signal=B:USR1@300
#SBATCH --requeue
# shellcheck source=slurm/launch.sh
source "${REPRO_ROOT:-${SLURM_SUBMIT_DIR:-.}}/slurm/launch.sh"
need REPRO_BERT_CHECKPOINT "the pretrained BERT checkpoint to fine-tune (its training run directory)"
[[ -e "$REPRO_BERT_CHECKPOINT" && "${REPRO_BERT_CHECKPOINT##*/}" != latest ]] \
  || die "REPRO_BERT_CHECKPOINT=$REPRO_BERT_CHECKPOINT: give the BERT training run directory (or a save_bert file)"
repro slurm check-checkpoint --family bert "$REPRO_BERT_CHECKPOINT"  # a GPT run: stopped before srun
requeue_checks "$@"  # the job requeues itself on USR1: warn if it may not; keep its arguments for the fix
parse_flags "$@"
ARGS=(${REPRO_RACE_SIZE:+--size "$REPRO_RACE_SIZE"} ${REPRO_RACE_TP:+--tp "$REPRO_RACE_TP"}
  --precision "${REPRO_RACE_PRECISION:-fp16}" --seeds 1234 1235 1236 1237 1238)
if [[ "$SMOKE" == 1 ]]; then
  export CUDA_VISIBLE_DEVICES=""  # CPU and gloo even on a GPU node
  REPRO_RACE_DIR="${REPRO_RACE_DIR:-$REPRO_ROOT/tests/fixtures/race}"
  ARGS=(--size smoke --tp "$(smoke_tp)" --seq-length 64 --epochs 2 --batch-size 5 --lr 1e-3 --seeds 1234 1235)
fi
need REPRO_RACE_DIR "the RACE root with {train,dev,test}/{middle,high}"
ARGS+=(${EXTRA[@]+"${EXTRA[@]}"})  # the script's own arguments last: they override
[[ "$DRY_RUN" == 0 ]] || ARGS+=(--dry-run)
launch_step finetune race --checkpoint "$REPRO_BERT_CHECKPOINT" --race-dir "$REPRO_RACE_DIR" \
  --data-dir "$REPRO_DATA_DIR" --run-dir "$REPRO_RUN_DIR" "${ARGS[@]}"
