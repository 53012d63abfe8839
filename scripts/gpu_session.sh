#!/usr/bin/env bash
# Every GPU measurement of issue 9 in one command, for one lent GPU (8-11 minutes on an H200, estimated; the
# benchmark budgets are 120 + 180 + 120 + 80 + 150 s; the last step may not fit one 10-minute device call):
#
#   OUT=results/bench/gpu_h200_new bash scripts/gpu_session.sh        # `python` has torch
#   PYTHON=.venv/bin/python OUT=... bash scripts/gpu_session.sh        # after `make setup`
#
# Writes under $OUT: nvidia_smi.txt; headline/ (first, so that a device call cut short still has it:
# the configuration expected to be fastest, compiled bf16 with half-precision parameters, no
# activation checkpointing); selftest_nccl.txt (repro selftest on NCCL); eager/ (gpu_bench JSON +
# Markdown of the 1.2B config, batch 8: bf16/fp16 x activation checkpointing x autocast-over-fp32 vs
# half-precision parameters), compile/ (compiled, fp32 parameters) and
# compile_ckpt_half/ (compiled, half parameters, checkpointing on);
# profile_fp32.txt and profile_half.txt (kernel-level profiles of two eager bf16 steps of each recipe);
# compile_blocks/ (the half recipe with each layer compiled, the trainer's train.compile at DP > 1).
# Works from a copy of the tree without .git or an installed package: set REPRO_GIT_SHA to record the
# commit. TINY=1 runs the same steps with a tiny model and COMPILE=0 leaves out the compiled runs after
# the headline (the CPU dry run in tests/test_perf_gpu_bench.py uses both).
set -euo pipefail
PY="${PYTHON:-python}"  # the interpreter with torch (PYTHON=.venv/bin/python from a checkout)
out="${OUT:?set OUT to the output folder, e.g. OUT=results/bench/gpu_h200_new}"
mkdir -p "$out"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export REPRO_GIT_SHA="${REPRO_GIT_SHA:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"
tiny=()
[[ "${TINY:-0}" == 1 ]] && tiny=(--tiny --batch 2)
bench=("${tiny[@]}")
[[ "${TINY:-0}" == 1 ]] && bench+=(--steps 2 --warmup 1)
step() { printf '\n== %s (%s)\n' "$1" "$(date -u +%H:%M:%S)"; }

step "device"
nvidia-smi > "$out/nvidia_smi.txt" 2>&1 || echo "nvidia-smi failed" >> "$out/nvidia_smi.txt"
"$PY" -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.is_available())'

step "headline: compiled bf16, half params, checkpointing off"
"$PY" -m repro.perf.gpu_bench "${bench[@]}" --out "$out/headline" --dtypes bf16 --checkpointing off \
  --params half --compile-only --budget-s 120

step "selftest on NCCL"
"$PY" -m torch.distributed.run --standalone --nproc-per-node 1 -m repro.parallel.selftest \
  > "$out/selftest_nccl.txt" 2>&1 || echo "selftest FAILED (see selftest_nccl.txt)"
tail -n 3 "$out/selftest_nccl.txt"

step "eager: bf16/fp16 x checkpointing x params"
"$PY" -m repro.perf.gpu_bench "${bench[@]}" --out "$out/eager" --dtypes bf16,fp16 --checkpointing off,on \
  --params fp32,half --budget-s 180

if [[ "${COMPILE:-1}" == 1 ]]; then
  step "compiled: bf16 x checkpointing x params, the headline's configuration left out"
  "$PY" -m repro.perf.gpu_bench "${bench[@]}" --out "$out/compile" --dtypes bf16 --checkpointing off,on \
    --params fp32 --compile-only --budget-s 120
  "$PY" -m repro.perf.gpu_bench "${bench[@]}" --out "$out/compile_ckpt_half" --dtypes bf16 --checkpointing on \
    --params half --compile-only --budget-s 80
fi

step "profiles"
"$PY" -m repro.perf.gpu_profile "${tiny[@]}" --out "$out" --params fp32 > /dev/null
head -n 2 "$out/profile_fp32.txt"
"$PY" -m repro.perf.gpu_profile "${tiny[@]}" --out "$out" --params half > /dev/null
head -n 2 "$out/profile_half.txt"

if [[ "${COMPILE:-1}" == 1 ]]; then  # last: what the trainer compiles at DP > 1, against headline/ above
  step "compiled per layer: bf16, half params, checkpointing off"
  "$PY" -m repro.perf.gpu_bench "${bench[@]}" --out "$out/compile_blocks" --dtypes bf16 --checkpointing off \
    --params half --compile-only --compile-scope blocks --budget-s 150
fi
step "done"
