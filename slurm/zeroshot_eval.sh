#!/usr/bin/env bash
# Table 3: zero-shot WikiText-103 perplexity and LAMBADA accuracy of a trained GPT-2
# (experiments/gpt2/gpt2_8.3b.yaml by default: 8-way TP on one 8-GPU node; set REPRO_EVAL_TP).
#   REPRO_EVAL_CHECKPOINT=RUNS/gpt2_8.3b-1234/checkpoints/latest sbatch slurm/zeroshot_eval.sh
#SBATCH --job-name=zeroshot_eval
#SBATCH --nodes=1
#SBATCH --ntasks=8
#SBATCH --gres=gpu:8
#SBATCH --time=04:00:00
# shellcheck source=slurm/launch.sh
source "${REPRO_ROOT:-${SLURM_SUBMIT_DIR:-.}}/slurm/launch.sh"
need REPRO_EVAL_CHECKPOINT "the GPT-2 checkpoint to evaluate (RUN_DIR/checkpoints/latest)"
for task in wikitext lambada; do
  launch_step eval "$task" --checkpoint "$REPRO_EVAL_CHECKPOINT" --tp "${REPRO_EVAL_TP:-8}" \
    --data-dir "$REPRO_DATA_DIR" --out "$REPRO_RUN_DIR/zero_shot.jsonl" "$@"
done
