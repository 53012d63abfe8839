#!/usr/bin/env bash
# Table 3: zero-shot WikiText-103 perplexity and LAMBADA accuracy of a trained GPT-2 (a run of
# experiments/gpt2/gpt2_8.3b.yaml, say) on one 8-GPU node, at the checkpoint's own TP (the rest of the 8
# ranks are DP) unless REPRO_EVAL_TP says otherwise (a TP that does not divide 8: the largest that divides
# both 8 and the model's heads).
# REPRO_EVAL_CHECKPOINT: the training run directory (or its checkpoints/iter_XXXXXXX folder).
# REPRO_EVAL_WIKITEXT_FILE: the paper's WikiText-103 wiki.test.tokens (default: the data dir's
#   WikiText-2 tokens file, same words, more <unk>; see repro/eval/README.md).
#   REPRO_EVAL_CHECKPOINT=RUNS/gpt2_8.3b-1234 sbatch slurm/zeroshot_eval.sh
#   REPRO_EVAL_CHECKPOINT=RUNS/scale_8b-99 sbatch -p debug -N1 -n2 --gres=none slurm/zeroshot_eval.sh --smoke
# --smoke: CPU, TP = one node's task count (the rest DP), window 64 / stride 32 on the first 40 WikiText lines, the first 64
# LAMBADA passages (for the 64-position model of a training script's --smoke run).
# Other arguments are `repro eval` options, one list for both tasks, given after the script's (and after
# the settings above, so they win): `repro eval TASK ... --print-args` keeps for each task the common
# options and its own (`repro eval --help` groups them: wikitext only, lambada only) and leaves out the
# other's, which `repro eval` would refuse. Both lists are made before either step runs, so a misspelt
# option stops the job at once.
#   REPRO_EVAL_CHECKPOINT=RUNS/gpt2_8.3b-1234 sbatch slurm/zeroshot_eval.sh --max-examples 500 --max-lines 100
#SBATCH --job-name=zeroshot_eval
#SBATCH --nodes=1
#SBATCH --ntasks=8
#SBATCH --gres=gpu:8
#SBATCH --exclusive
#SBATCH --mem=0
#SBATCH --time=04:00:00
# shellcheck source=slurm/launch.sh
source "${REPRO_ROOT:-${SLURM_SUBMIT_DIR:-.}}/slurm/launch.sh"
need REPRO_EVAL_CHECKPOINT "the GPT-2 checkpoint to evaluate (its training run directory)"
[[ -d "$REPRO_EVAL_CHECKPOINT" ]] \
  || die "REPRO_EVAL_CHECKPOINT=$REPRO_EVAL_CHECKPOINT is not a directory: give the training run directory"
repro slurm check-checkpoint --family gpt "$REPRO_EVAL_CHECKPOINT"  # a BERT run: stopped before srun
parse_flags "$@"
ARGS=(--checkpoint "$REPRO_EVAL_CHECKPOINT" --data-dir "$REPRO_DATA_DIR" ${REPRO_EVAL_TP:+--tp "$REPRO_EVAL_TP"}
  --file "${REPRO_EVAL_WIKITEXT_FILE:-tokens}")
if [[ "$SMOKE" == 1 ]]; then
  export CUDA_VISIBLE_DEVICES=""  # CPU and gloo even on a GPU node
  ARGS=(--checkpoint "$REPRO_EVAL_CHECKPOINT" --data-dir "$REPRO_DATA_DIR" --tp "$(smoke_tp)"
    --file "${REPRO_EVAL_WIKITEXT_FILE:-tokens}" --window 64 --stride 32 --max-lines 40 --max-examples 64)
fi
ARGS+=(${EXTRA[@]+"${EXTRA[@]}"})  # the script's own arguments last (launch_step resets EXTRA)
STEP_FLAGS=()
[[ "$DRY_RUN" == 0 ]] || STEP_FLAGS=(--dry-run)
declare -A TASK_ARGS  # each task's arguments, shell-quoted by `repro eval TASK ... --print-args`
for task in wikitext lambada; do
  TASK_ARGS[$task]="$(repro eval "$task" "${ARGS[@]}" --print-args)"  # (its error stops the job here)
done
for task in wikitext lambada; do
  # records go to the training run's zero_shot.jsonl (repro eval's default), beside its mlflow_run_id,
  # where `repro tracking sync TRAINING_RUN_DIR` finds them; this job's run dir keeps its log
  eval "args=(${TASK_ARGS[$task]})"
  launch_step eval "$task" "${args[@]}" ${STEP_FLAGS[@]+"${STEP_FLAGS[@]}"}
done
