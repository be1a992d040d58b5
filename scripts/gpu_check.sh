#!/usr/bin/env bash
# One command, one GPU (H200 or A100), under 8 minutes: is this machine ready to train H3?
#
#   scripts/gpu_check.sh [--out PATH] [other `h3train bench` options]
#
# Runs `h3train bench --checks` (h3train/tools/bench/, then h3train/tools/gpu_checks.py), in one process:
#  - the bench: the full-width model (hidden 5376, 56 heads, 4 blocks) in bfloat16 at the released
#    768x1344 x 124-frame layout (41,774 packed rows) with the flash, cuDNN and native attention
#    backends: one Trainer per backend, each backend's gradients against native's, and the trainer's
#    own step halves (`forward_backward`; `update`: FSDP2 norm, clip, AdamW, the step's one
#    all-reduce) under torch.cuda.set_sync_debug_mode, with step time, MFU and peak memory;
#  - the checks, each through the real trainer on a smaller model (hidden 1024, 2 blocks) but the last:
#    averaging         ReduceOp.AVG on the run's own NCCL group: the start-up probe
#                      (parallel/averaging.py), its collectives, a direct reduce-scatter and
#                      all-reduce. One GPU is a world of 1; the multi-rank probe runs at every
#                      training start;
#    optim_adamw8bit   one step with optim.name=adamw8bit (torchao, compiled), optim_adamw_bf16 with
#                      adamw_bf16: finite loss, weights changed, the promised state, timed;
#    lora_int8         LoRA steps on the lora.base_quant=int8 frozen base, lora_float8 on float8
#                      (weight-only: cast to bfloat16 before the matmul, so it runs on an A100 too);
#    async_save        checkpoint.async_save: save, the next step at once, wait; the checkpoint
#                      equals a blocking save of the same state; staged into pinned host buffers
#                      (torch 2.8, without DCP's DefaultStager, copies on the training thread: said);
#    block_memory_vs_rehearsal   one full-width block on the 41,774-row layout: the step's
#                      torch.cuda.max_memory_allocated within 10 % of the fake-tensor rehearsal's
#                      tracked peak (h3train/run/rehearse/) for the same config;
#  - the memory sweep (h3train/tools/memory_sweep.py; not with --reduced): blocks, clip length, each
#    block's policy and compile, each case's measured peak beside the plan in the calibration table's
#    format (<out>_sweep.jsonl; append its points to h3train/plan/calibration.jsonl), and the kernel
#    SDPA runs for each attention backend.
# Writes one JSON (default gpu_check_<host>_<time>.json; the checks under "checks") and prints its
# path. Exit status: 0 when every backend ran, held parity and made no sync beyond the step's one
# read-back, and no check that ran failed (a skipped one, with its reason, does not count); 1
# otherwise. Without CUDA it runs the reduced CPU model, gloo and CPU checks instead (seconds; what
# the test suite checks).
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python=${PYTHON:-}
if [[ -z $python ]]; then
  if [[ -x $root/.venv/bin/python ]]; then python=$root/.venv/bin/python; else python=python3; fi
fi

out=""
args=()
while (($#)); do
  case $1 in
    --out) out=${2:?--out needs a path}; shift 2 ;;
    --out=*) out=${1#--out=}; shift ;;
    *) args+=("$1"); shift ;;
  esac
done
if [[ -z $out ]]; then
  out=gpu_check_$(hostname -s)_$(date -u +%Y%m%dT%H%M%SZ).json
fi

if ! "$python" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "gpu_check: no CUDA device here: running the reduced CPU check" >&2
  args=(--reduced "${args[@]}")
fi

start=$SECONDS
status=0
"$python" -m h3train bench --checks "${args[@]}" --out "$out" || status=$?
echo "gpu_check: bench and checks $((SECONDS - start)) s, exit $status"
if [[ " ${args[*]} " != *" --reduced "* ]]; then
  # The memory sweep: each case's measured peak beside the plan, in plan/calibration.jsonl's format.
  sweep=${out%.json}_sweep.jsonl
  "$python" -m h3train.tools.memory_sweep --out "$sweep" || status=$?
  echo "gpu_check: sweep $sweep"
fi
echo "gpu_check: $((SECONDS - start)) s, exit $status"
if [[ -f $out ]]; then
  echo "gpu_check: JSON $out"
fi
exit "$status"
