#!/usr/bin/env bash
# The training corpus (paper §3: Wikipedia, CC-Stories, RealNews, OpenWebText; BooksCorpus for BERT) on
# one CPU node: `repro data prepare` with a tokenizing worker per CPU of the allocation, the paper's
# filters (under 128 tokens, WikiText/LAMBADA 8-gram overlap, MinHash-LSH near-duplicates across all
# inputs), its log in the job's run dir. The arguments are prepare's own (paths relative to the
# repository root, or absolute); --data-dir defaults to REPRO_DATA_DIR (vocabularies and eval sets).
#   sbatch slurm/prepare_data.sh --input wiki.jsonl realnews.jsonl.gz owt_pages/ --layout file \
#     --split-order random --output-prefix "$REPRO_DATA_DIR/gpt2/corpus"
#   sbatch slurm/prepare_data.sh --tokenizer bert --input ... --output-prefix "$REPRO_DATA_DIR/bert/corpus"
#   sbatch -p debug -N1 -n1 -c2 --gres=none slurm/prepare_data.sh --smoke    # WikiText-2 valid, into the run dir
# Memory: the near-duplicate index holds ~2 KB per kept document (~80 GB for the paper's ~40M), so the
# script asks for the node's memory (--mem=0). Not resumable: a job stopped by a time limit or
# preemption starts again from the beginning (the outputs appear only when complete).
#SBATCH --job-name=prepare_data
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --cpus-per-task=32
#SBATCH --mem=0
#SBATCH --time=24:00:00
# shellcheck source=slurm/launch.sh
source "${REPRO_ROOT:-${SLURM_SUBMIT_DIR:-.}}/slurm/launch.sh"
parse_flags "$@"
export TQDM_MININTERVAL="${TQDM_MININTERVAL:-60}"  # a progress line a minute in the log, not a stream
ARGS=(${EXTRA[@]+"${EXTRA[@]}"})
if [[ "$SMOKE" == 1 ]]; then
  ARGS=(--input "$REPRO_DATA_DIR/wikitext/wikitext-2.valid.tokens" --layout wikitext --split "90,10,0"
        --output-prefix "$REPRO_RUN_DIR/data/wiki" ${EXTRA[@]+"${EXTRA[@]}"})
fi
[[ " ${ARGS[*]} " == *" --input "* && " ${ARGS[*]} " == *" --output-prefix "* ]] \
  || die "give prepare's --input FILE... and --output-prefix PREFIX (or --smoke), e.g. sbatch slurm/prepare_data.sh --input corpus.jsonl --output-prefix \$REPRO_DATA_DIR/gpt2/corpus"
[[ " ${ARGS[*]} " == *" --data-dir "* ]] || ARGS+=(--data-dir "$REPRO_DATA_DIR")
[[ "$DRY_RUN" == 0 ]] || ARGS+=(--dry-run)
launch_step data prepare "${ARGS[@]}"
