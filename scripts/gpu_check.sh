#!/usr/bin/env bash
# One command, one GPU (H200 or A100), under 8 minutes: is this machine ready to train H3?
#
#   scripts/gpu_check.sh [--out PATH] [other `h3train bench` options]
#
# Runs `h3train bench` (h3train/bench.py): the full-width model (hidden 5376, 56 heads, 4 blocks) in
# bfloat16 at the released 768x1344 x 124-frame layout (41,774 packed rows) with the flash, cuDNN and
# native attention backends: one Trainer per backend, each backend's gradients against native's, and
# the trainer's own step halves (`forward_backward`; `update`: FSDP2 norm, clip, AdamW, the step's
# one all-reduce) under torch.cuda.set_sync_debug_mode, with step time, MFU and peak memory.
# Writes one JSON (default gpu_check_<host>_<time>.json) and prints its path. Exit status: 0 when
# every backend ran, held parity and made no sync beyond the step's one read-back; 1 otherwise.
# Without CUDA it runs the reduced CPU model instead (seconds; what the test suite checks).
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
"$python" -m h3train bench "${args[@]}" --out "$out" || status=$?
echo "gpu_check: $((SECONDS - start)) s, exit $status"
if [[ -f $out ]]; then
  echo "gpu_check: JSON $out"
fi
exit "$status"
