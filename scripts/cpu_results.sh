#!/usr/bin/env bash
# Rebuild the committed results/ tables and figures from scratch on a CPU (`make results`):
# a fresh MLflow store filled with reduced-size runs of every experiment family, then `repro report`.
# Every number it writes is a CPU pipeline check at toy size, labelled so, never a paper number.
#
#   1. `repro demo`: the 4-layer GPT at TP=2 on 2 processes, 300 iterations, its zero-shot
#      LAMBADA (all 5,153 passages) and WikiText evaluations             -> experiment gpt2, zero-shot
#   2. the tiny GPT at TP=1, TP=2 and TP=1 x DP=2, 40 iterations each    -> experiment scaling
#   3. the tiny GPT, 60 iterations with held-out loss every 5, then WikiText (window 64, stride 32,
#      first 1,000 lines) and strict LAMBADA                              -> experiment gpt2, zero-shot
#   4. the tiny BERT pretrained 200 iterations on WikiText-2 (MLM+SOP, held-out MLM loss), then RACE
#      fine-tuning from its checkpoint on the 17-question fixture, seeds 1 2 3 -> experiment bert, race
#   5. the Fig. 7 ablation at CPU size (both layer-norm orders, 100 iterations)  -> experiment bert
#   6. `repro report --out $OUT`
#
# About 17 minutes on 2 cores. STORE_DIR (default runs/cpu_results) must not hold a store yet:
# the tables pick runs by recency, so runs of an older code in the same store would mix in.
# SMOKE=1 runs the same steps a few iterations each on subsets of the evaluation sets (a test does).
set -euo pipefail
cd "$(dirname "$0")/.."

REPRO=${REPRO:-.venv/bin/repro}
PY=${PY:-.venv/bin/python}
OUT=${OUT:-results}
STORE_DIR=${STORE_DIR:-runs/cpu_results}
DATA=${REPRO_DATA_DIR:-data}
export REPRO_DATA_DIR=$DATA OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} MLFLOW_DISABLE_TELEMETRY=true

if [ -e "$STORE_DIR/mlflow.db" ]; then
  echo "cpu_results: $STORE_DIR/mlflow.db already exists; remove $STORE_DIR or set STORE_DIR to a new directory" >&2
  exit 2
fi
mkdir -p "$STORE_DIR"
STORE_DIR=$(cd "$STORE_DIR" && pwd)
export MLFLOW_TRACKING_URI="sqlite:///$STORE_DIR/mlflow.db"
TINY=experiments/tiny/gpt_tiny.yaml
if [ "${SMOKE:-0}" = 1 ]; then
  DEMO=(--smoke) SCALE_ITERS=2 LOG=1 GPT_ITERS=4 GPT_EVAL=2 BERT_ITERS=4 BERT_LOG=1 BERT_EVAL=2 FIG7_ITERS=4
  WIKITEXT=(--max-lines 40) LAMBADA=(--max-examples 64)
else
  DEMO=() SCALE_ITERS=40 LOG=5 GPT_ITERS=60 GPT_EVAL=5 BERT_ITERS=200 BERT_LOG=10 BERT_EVAL=50 FIG7_ITERS=100
  WIKITEXT=(--max-lines 1000) LAMBADA=()
fi
GPT_DATA=(--set "data.train_prefix=$DATA/wt2_gpt_train" --set "data.valid_prefix=$DATA/wt2_gpt_valid")

step() { printf '\n##### cpu_results %s (at %d s)\n' "$*" "$SECONDS"; }

step "1/6 the demo (fetches and prepares the data)"
"$REPRO" demo "${DEMO[@]}" --run-dir "$STORE_DIR/gpt-demo"

step "2/6 scaling layouts of the tiny GPT"
scaling=(--set "train.train_iters=$SCALE_ITERS" --set "train.log_interval=$LOG" --set tracking.experiment=scaling
         --set "tracking.paper_ref=Table 1 layout check at CPU size")
"$REPRO" train "$TINY" --nproc 1 "${GPT_DATA[@]}" "${scaling[@]}" --set name=tiny-tp1 \
  --set "run_dir=$STORE_DIR/tiny-tp1"
"$REPRO" train "$TINY" --nproc 2 "${GPT_DATA[@]}" "${scaling[@]}" --set name=tiny-tp2 --set parallel.tp=2 \
  --set "run_dir=$STORE_DIR/tiny-tp2"
"$REPRO" train "$TINY" --nproc 2 "${GPT_DATA[@]}" "${scaling[@]}" --set name=tiny-dp2 \
  --set "run_dir=$STORE_DIR/tiny-dp2"

step "3/6 the tiny GPT with held-out loss, then zero-shot"
"$REPRO" train "$TINY" --nproc 1 "${GPT_DATA[@]}" --set name=tiny-gpt --set "train.train_iters=$GPT_ITERS" \
  --set "train.log_interval=$LOG" --set "train.eval_interval=$GPT_EVAL" --set train.eval_iters=4 \
  --set "train.save_interval=$GPT_ITERS" --set "run_dir=$STORE_DIR/tiny-gpt"
"$REPRO" eval wikitext --checkpoint "$STORE_DIR/tiny-gpt" --window 64 --stride 32 "${WIKITEXT[@]}"
"$REPRO" eval lambada --checkpoint "$STORE_DIR/tiny-gpt" --batch-size 32 "${LAMBADA[@]}"

step "4/6 the tiny BERT: pretraining, then RACE from its checkpoint"
if [ ! -e "$DATA/wt2_bert_train.idx" ]; then
  "$REPRO" data prepare --input "$DATA/wikitext/wikitext-2.valid.tokens" --tokenizer bert --layout wikitext \
    --output-prefix "$DATA/wt2_bert" --no-dedup --no-eval-filter --split 95,5,0
fi
"$REPRO" train experiments/bert/tiny_cpu.yaml --nproc 1 --set "train.train_iters=$BERT_ITERS" \
  --set "train.log_interval=$BERT_LOG" --set "train.eval_interval=$BERT_EVAL" --set train.eval_iters=4 \
  --set "train.save_interval=$BERT_ITERS" --set "data.train_prefix=$DATA/wt2_bert_train" \
  --set "data.valid_prefix=$DATA/wt2_bert_valid" --set "run_dir=$STORE_DIR/tiny-bert"
"$REPRO" finetune race --race-dir tests/fixtures/race --checkpoint "$STORE_DIR/tiny-bert" --seq-length 128 \
  --size bert-tiny-cpu --seeds 1 2 3 --run-dir "$STORE_DIR/race"

step "5/6 Fig. 7 at CPU size"
"$PY" -m repro.models.bert_ablation --data-prefix "$DATA/wt2_bert_train" --valid-prefix "$DATA/wt2_bert_valid" \
  --iters "$FIG7_ITERS" --batch 8 --lr 5e-4 --seq-length 64 --run-dir "$STORE_DIR/fig7" --out "$OUT/bert_fig7_layernorm_order_cpu"

step "6/6 repro report -> $OUT"
"$REPRO" report --tracking-uri "$MLFLOW_TRACKING_URI" --out "$OUT"
echo "cpu_results: store $MLFLOW_TRACKING_URI; tables and figures in $OUT/ ($SECONDS s)"
