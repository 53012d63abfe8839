#!/usr/bin/env bash
# The training corpus (paper §3: Wikipedia, CC-Stories, RealNews, OpenWebText; BooksCorpus for BERT) on
# one CPU node: `repro data prepare` with a tokenizing worker per CPU of the allocation
# (--cpus-per-task), the paper's filters (under 128 tokens, WikiText/LAMBADA 8-gram overlap,
# MinHash-LSH near-duplicates across all inputs), its log in the job's run dir. The arguments are
# prepare's own (paths relative to the repository root, or absolute); the vocabularies and eval sets
# come from REPRO_DATA_DIR. The prefixes below are the ones the experiment configs read:
#   sbatch slurm/prepare_data.sh --input wiki.jsonl realnews.jsonl.gz owt_pages/ --layout file \
#     --split-order random --output-prefix "$REPRO_DATA_DIR/gpt2_corpus"
#   sbatch slurm/prepare_data.sh --tokenizer bert --input ... --split 969,30,1 \
#     --output-prefix "$REPRO_DATA_DIR/bert_corpus"     # the paper's 3% held-out set for BERT
#   sbatch -p debug -N1 -n1 -c1 --gres=none slurm/prepare_data.sh --smoke    # WikiText-2 valid, into the run dir
# Memory: the near-duplicate index holds ~2 KB per kept document (~80 GB for the paper's ~40M), so the
# script asks for the node's memory (--mem=0; `sbatch --mem=120G` or `-p PARTITION` to change). Not
# resumable: submit it again to start over. Stopping: 5 min before the time limit Slurm sends USR1
# to this shell (--signal=B:USR1@300), launch.sh forwards it through srun to `repro data prepare`,
# which removes its temporary files and exits, leaving any earlier dataset at the prefix as it
# was (so does `scancel --batch --signal=USR1 JOB`, or --signal=TERM, which launch.sh forwards as
# USR1). A TERM that Slurm sends to the job's steps (the time limit itself, plain scancel,
# preemption) makes srun SIGKILL the task ("forcing job termination"): its PREFIX*.tmp<pid> files
# stay behind; delete them.
#SBATCH --job-name=prepare_data
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --cpus-per-task=32
#SBATCH --mem=0
#SBATCH --time=24:00:00
#SBATCH --signal=B:USR1@300
# shellcheck source=slurm/launch.sh
source "${REPRO_ROOT:-${SLURM_SUBMIT_DIR:-.}}/slurm/launch.sh"
parse_flags "$@"
export TQDM_MININTERVAL="${TQDM_MININTERVAL:-60}" TQDM_MAXINTERVAL="${TQDM_MAXINTERVAL:-60}"  # a log, not a stream
ARGS=(${EXTRA[@]+"${EXTRA[@]}"})
if [[ "$SMOKE" == 1 ]]; then
  ARGS=(--input "$REPRO_DATA_DIR/wikitext/wikitext-2.valid.tokens" --layout wikitext --split "90,10,0"
        --output-prefix "$REPRO_RUN_DIR/data/wiki" ${EXTRA[@]+"${EXTRA[@]}"})
fi
given() {  # given --flag: true when ARGS has it, as `--flag VALUE` or `--flag=VALUE`
  local arg
  for arg in ${ARGS[@]+"${ARGS[@]}"}; do
    [[ "$arg" == "$1" || "$arg" == "$1="* ]] && return 0
  done
  return 1
}
if ! given --input || ! given --output-prefix; then
  die "give prepare's --input FILE... and --output-prefix PREFIX (or --smoke), e.g. sbatch slurm/prepare_data.sh --input corpus.jsonl --output-prefix \$REPRO_DATA_DIR/gpt2_corpus"
fi
# the allocation's CPUs, also where a site does not bind tasks to them (every CPU of the node would show)
given --workers || ARGS+=(--workers "${SLURM_CPUS_PER_TASK:-1}")
[[ "$DRY_RUN" == 0 ]] || ARGS+=(--dry-run)  # for launch_step, which prints the step instead of running it
launch_step data prepare "${ARGS[@]}"
