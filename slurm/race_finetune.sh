#!/usr/bin/env bash
# Table 5: RACE fine-tuning of a pretrained BERT (experiments/bert/bert_336m.yaml by default) on one
# 8-GPU node, TP x DP from REPRO_RACE_TP; median over 5 seeds. No resume: a preempted run restarts.
#   REPRO_BERT_CHECKPOINT=... REPRO_RACE_DIR=... sbatch slurm/race_finetune.sh [--epochs 3]
#SBATCH --job-name=race_finetune
#SBATCH --nodes=1
#SBATCH --ntasks=8
#SBATCH --gres=gpu:8
#SBATCH --time=24:00:00
#SBATCH --signal=B:USR1@300
# shellcheck source=slurm/launch.sh
source "${REPRO_ROOT:-${SLURM_SUBMIT_DIR:-.}}/slurm/launch.sh"
need REPRO_BERT_CHECKPOINT "the pretrained BERT checkpoint to fine-tune (RUN_DIR/checkpoints/latest)"
need REPRO_RACE_DIR "the RACE root with {train,dev,test}/{middle,high}"
launch_step finetune race --size "${REPRO_RACE_SIZE:-bert-336m}" --tp "${REPRO_RACE_TP:-1}" \
  --checkpoint "$REPRO_BERT_CHECKPOINT" --race-dir "$REPRO_RACE_DIR" --data-dir "$REPRO_DATA_DIR" \
  --run-dir "$REPRO_RUN_DIR" --seeds 1234 1235 1236 1237 1238 "$@"
