#!/usr/bin/env bash
# Every GPU measurement of issue 9 for one lent GPU, in two parts that each fit one 10-minute device call
# (part 1 about 9 minutes on an H200: the first compile of the 1.2B step took 113 s on 2026-12-04, later ones reuse
# inductor's on-disk cache; part 2 is the optional extras):
#
#   OUT=results/bench/gpu_h200_new bash scripts/gpu_session.sh              # both parts; `python` has torch
#   R=$OUT; PART=1 OUT=/tmp/gs PACK=$R/part1.tar.gz TRAIN_PREFIX=data/wt2_gpt_train bash scripts/gpu_session.sh
#     (on a lent GPU: results/bench/gpu_h200/README.md gives the whole device call)
#
# Part 1, most valuable first (the 2026-12-04 session measured the rest: results/bench/gpu_h200_2026-12-04):
# nvidia_smi.txt; headline/ (compiled bf16, half-precision parameters, no activation checkpointing,
# the trainer's clip: 42.9% MFU on 2026-12-04); then A/B runs against it, each a candidate for the
# 7 ms a step still between it and 45% MFU: headline_flat/ (`--optimizer flat`: repro.train.flat_adamw's
# one kernel per bucket for the fused AdamW and the copy of the masters into the model, about 5 GB
# less traffic; the trainer's optim.flat_step), headline_cudagraphs/ (torch.compile's reduce-overhead
# mode, CUDA graphs: is the idle GPU waiting on kernel launches?), headline_flat_cudagraphs/ (both),
# headline_half_grads/ (no main-grad hooks: a compiled backward hands all 485 gradients over at its
# end, each to a Python hook, which since 2026-12-05 widens a whole bucket with one foreach call); optimizer/ (optimizer_bench: the optimizer phase by part,
# the flat AdamW's included); profile_half_compiled.txt (kernel profile of two compiled bf16
# half-parameter steps with kernel time by kind and gpu_gaps' account of where the GPU sits idle, by
# the host op that launched late: roughly 11-17 ms of the 160 ms eager step on 2026-12-04).
# Part 2: trainer_compiled/ (`repro train experiments/scaling/scale_1b.yaml --set train.compile=true`,
# Table 1 config 1 in the paper's fp16 recipe on one GPU over NCCL, 40 iterations: its metrics.jsonl,
# params and final metrics, which `repro tracking sync` turns into an MLflow run; its checkpoint is
# deleted); buffers/ (repro.perf.compiled_buffers: every buffer the compiled step's Triton wrappers
# allocate, two layers of the 1.2B shapes, to check what the CPU's generated code showed); eager_hooks/ and eager_half_grads/ (eager bf16 half with the trainer's per-parameter
# main-grad hooks and without them, gradients cast once after backward); eager/ (bf16/fp16 x
# activation checkpointing x autocast-over-fp32 vs half-precision parameters) and eager_fold_clip/
# (bf16 half with the clip folded into the fused AdamW, the CPU's way, against eager/'s foreach clip);
# compile/ (compiled, fp32 parameters), compile_ckpt_half/ (compiled, half parameters, checkpointing
# on), compile_blocks/ (each layer compiled, the trainer's choice at DP > 1), profile_fp32.txt and
# profile_half.txt (eager, with their gaps), trainer_eager/ (the trainer without compile) and
# selftest_nccl.txt (repro selftest on NCCL). Each benchmark folder holds gpu_bench's JSON + Markdown
# (1.2B config, batch 8).
#
# PACK=FILE.tar.gz packs all of $OUT into that one file before each step and at the end, so a device
# call cut short still returns every finished step (the device tool returns at most 8 files).
# TRAIN_PREFIX: a GPT-2 BPE indexed dataset (e.g. data/wt2_gpt_train from `make demo`, carried to the
# device); without it the trainer steps are left out. `.device_pylib/` (pure-Python packages the
# device image lacks: `pip install --target .device_pylib --no-deps omegaconf`) is put on PYTHONPATH
# when present. Works from a copy of the tree without .git or an installed package: set REPRO_GIT_SHA
# to record the commit. TINY=1 runs the same steps with a tiny model on the CPU and COMPILE=0 leaves
# out the compiled steps but the headline (the CPU dry run in tests/test_perf_gpu_bench.py uses both).
set -euo pipefail
PY="${PYTHON:-python}"  # the interpreter with torch (PYTHON=.venv/bin/python from a checkout)
out="${OUT:?set OUT to the output folder, e.g. OUT=results/bench/gpu_h200_new}"
part="${PART:-all}"
[[ "$part" =~ ^(all|1|2)$ ]] || { echo "PART=$part: choose 1, 2 or all" >&2; exit 2; }
mkdir -p "$out"
out="$(cd "$out" && pwd)"  # OUT, PACK and TRAIN_PREFIX are relative to where the script is called from
[[ -n "${PACK:-}" && "$PACK" != /* ]] && PACK="$PWD/$PACK"
if [[ -n "${PACK:-}" && "$PACK" == "$out"/* ]]; then
  echo "PACK=$PACK lies inside OUT=$out, which it packs. Fix: put it elsewhere (on a device: R=\$OUT; OUT=/tmp/gs PACK=\$R/part1.tar.gz ...)" >&2
  exit 2
fi
[[ -n "${TRAIN_PREFIX:-}" && "$TRAIN_PREFIX" != /* ]] && TRAIN_PREFIX="$PWD/$TRAIN_PREFIX"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
work="${WORK:-$(mktemp -d)}"  # trainer run dirs (their checkpoints are removed once a run ends): not packed
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
[[ -d .device_pylib ]] && export PYTHONPATH="$PWD/.device_pylib:$PYTHONPATH"
export REPRO_GIT_SHA="${REPRO_GIT_SHA:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"
tiny=()
[[ "${TINY:-0}" == 1 ]] && tiny=(--tiny --batch 2)
bench=("${tiny[@]}")
compile=(--compile)
[[ "${COMPILE:-1}" == 1 ]] || compile=()  # the dry run profiles eagerly (its headline still compiles)
[[ "${TINY:-0}" == 1 ]] && bench+=(--steps 2 --warmup 1)
pack() {
  if [[ -n "${PACK:-}" ]]; then tar -czf "$PACK.part" -C "$out" . && mv "$PACK.part" "$PACK"; fi
}
step() { pack; printf '\n== %s (%s)\n' "$1" "$(date -u +%H:%M:%S)"; }

# trainer NAME [--set K=V ...]: Table 1 config 1 through `repro train` under torchrun (as on a cluster:
# NCCL on a GPU), one rank; the run's small files go to $out/NAME. A failure is recorded in
# $out/NAME/FAILED and the session goes on.
trainer() {
  local name="$1" config=experiments/scaling/scale_1b.yaml
  shift
  local set=(--set "data.train_prefix=$TRAIN_PREFIX" --set "data.cache_dir=$work/cache" --set "run_dir=$work/$name"
             --set tracking.enabled=false --set train.train_iters=40 --set train.log_interval=10)
  if [[ "${TINY:-0}" == 1 ]]; then
    config=experiments/tiny/gpt_tiny.yaml
    set+=(--set train.train_iters=4 --set train.log_interval=2)
  fi
  mkdir -p "$out/$name"
  if ! "$PY" -m torch.distributed.run --standalone --nproc-per-node 1 -m repro.cli train "$config" "${set[@]}" "$@" 2>&1 \
      | tee "$out/$name/log.txt" | tail -n 4; then
    echo "trainer $name FAILED (see $name/log.txt)" | tee "$out/$name/FAILED"
  fi
  for f in metrics.jsonl final_metrics.json params.json tags.json config.yaml; do
    [[ -f "$work/$name/$f" ]] && cp "$work/$name/$f" "$out/$name/"
  done
  rm -rf "$work/$name/checkpoints"  # 14 GB at 1.2B: not needed, and the next trainer run writes its own
  return 0
}

if [[ "$part" != 2 ]]; then
  step "device"
  nvidia-smi > "$out/nvidia_smi.txt" 2>&1 || echo "nvidia-smi failed" >> "$out/nvidia_smi.txt"
  "$PY" -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.is_available())'

  step "headline: compiled bf16, half params, checkpointing off"
  "$PY" -m repro.perf.gpu_bench "${bench[@]}" --out "$out/headline" --dtypes bf16 --checkpointing off \
    --params half --compile-only --budget-s 110

  if [[ "${COMPILE:-1}" == 1 ]]; then
    step "A/B against the headline: the flat AdamW, CUDA graphs, both, and no main-grad hooks"
    "$PY" -m repro.perf.gpu_bench "${bench[@]}" --out "$out/headline_flat" --dtypes bf16 --checkpointing off \
      --params half --compile-only --optimizer flat --budget-s 110
    "$PY" -m repro.perf.gpu_bench "${bench[@]}" --out "$out/headline_cudagraphs" --dtypes bf16 --checkpointing off \
      --params half --compile-only --compile-mode reduce-overhead --budget-s 110
    "$PY" -m repro.perf.gpu_bench "${bench[@]}" --out "$out/headline_flat_cudagraphs" --dtypes bf16 \
      --checkpointing off --params half --compile-only --optimizer flat --compile-mode reduce-overhead --budget-s 110
    "$PY" -m repro.perf.gpu_bench "${bench[@]}" --out "$out/headline_half_grads" --dtypes bf16 --checkpointing off \
      --params half --compile-only --main-grads param --budget-s 90
  fi

  step "optimizer phase by part"
  "$PY" -m repro.perf.optimizer_bench "${tiny[@]:0:1}" --out "$out/optimizer" | tail -n 14

  step "kernel profile and idle gaps: bf16 half params, compiled"
  "$PY" -m repro.perf.gpu_profile "${tiny[@]}" --out "$out" --params half "${compile[@]}" > /dev/null
  sed -n '2p;/GPU timeline/,$p' "$out"/profile_half*.txt | head -n 14
fi

if [[ "$part" != 1 ]]; then
  if [[ -n "${TRAIN_PREFIX:-}" && "${COMPILE:-1}" == 1 ]]; then
    step "trainer: repro train experiments/scaling/scale_1b.yaml (fp16, half params, checkpointing), compiled"
    trainer trainer_compiled --set train.compile=true
  fi

  if [[ "${COMPILE:-1}" == 1 ]]; then
    step "the compiled step's buffers on this device (Triton): two layers of the 1.2B shapes"
    "$PY" -m repro.perf.compiled_buffers "${tiny[@]:0:1}" --out "$out/buffers" --layers 2 | sed -n '5,8p;12,24p'
  fi

  step "eager: the main-grad hooks, with and without"
  "$PY" -m repro.perf.gpu_bench "${bench[@]}" --out "$out/eager_hooks" --dtypes bf16 --checkpointing off \
    --params half --budget-s 30
  "$PY" -m repro.perf.gpu_bench "${bench[@]}" --out "$out/eager_half_grads" --dtypes bf16 --checkpointing off \
    --params half --main-grads param --budget-s 30

  step "eager: bf16/fp16 x checkpointing x params, and bf16 half with the clip folded into the fused AdamW"
  "$PY" -m repro.perf.gpu_bench "${bench[@]}" --out "$out/eager" --dtypes bf16,fp16 --checkpointing off,on \
    --params fp32,half --budget-s 150
  "$PY" -m repro.perf.gpu_bench "${bench[@]}" --out "$out/eager_fold_clip" --dtypes bf16 --checkpointing off \
    --params half --fold-clip --budget-s 30

  if [[ "${COMPILE:-1}" == 1 ]]; then
    step "compiled: fp32 params x checkpointing, half params with checkpointing, half per layer"
    "$PY" -m repro.perf.gpu_bench "${bench[@]}" --out "$out/compile" --dtypes bf16 --checkpointing off,on \
      --params fp32 --compile-only --budget-s 120
    "$PY" -m repro.perf.gpu_bench "${bench[@]}" --out "$out/compile_ckpt_half" --dtypes bf16 --checkpointing on \
      --params half --compile-only --budget-s 80
    "$PY" -m repro.perf.gpu_bench "${bench[@]}" --out "$out/compile_blocks" --dtypes bf16 --checkpointing off \
      --params half --compile-only --compile-scope blocks --budget-s 120
  fi

  step "profiles, eager"
  "$PY" -m repro.perf.gpu_profile "${tiny[@]}" --out "$out" --params fp32 > /dev/null
  "$PY" -m repro.perf.gpu_profile "${tiny[@]}" --out "$out" --params half > /dev/null

  if [[ -n "${TRAIN_PREFIX:-}" ]]; then
    step "trainer: repro train experiments/scaling/scale_1b.yaml (fp16, half params, checkpointing), eager"
    trainer trainer_eager
  fi

  step "selftest on NCCL"
  "$PY" -m torch.distributed.run --standalone --nproc-per-node 1 -m repro.parallel.selftest \
    > "$out/selftest_nccl.txt" 2>&1 || echo "selftest FAILED (see selftest_nccl.txt)"
  tail -n 3 "$out/selftest_nccl.txt"
fi
step "done"
pack
