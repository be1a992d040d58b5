#!/usr/bin/env bash
# Launch `h3train train` on this node under torchrun, one process per GPU.
#
# Usage: scripts/launch.sh CONFIG [key=value ...]
#
# Run it once on every node of the job with the same MASTER_ADDR, MASTER_PORT and NNODES; the c10d
# rendezvous assigns ranks, so nodes may start in any order. Environment [default]:
#   NNODES         number of nodes [1]
#   NODE_RANK      this node's index, 0..NNODES-1 [$SLURM_NODEID, else 0]; c10d assigns the
#                  ranks itself, so this only names the node in torchrun's logs
#   MASTER_ADDR    host of the rendezvous store, reachable from every node [127.0.0.1]
#   MASTER_PORT    its TCP port [29500]
#   GPUS_PER_NODE  processes on this node [the GPUs torch sees, i.e. after CUDA_VISIBLE_DEVICES]
#   RDZV_ID        rendezvous id shared by all nodes [h3train-$MASTER_PORT]
#   MAX_RESTARTS   torchrun restarts of the whole worker group after a failure [0]
#
# Ranks are numbered node by node, so the innermost mesh axis (sp) stays inside a node whenever sp
# divides GPUS_PER_NODE: the Ulysses all-to-alls then run over NVLink, never over InfiniBand.
set -euo pipefail

usage() {
  awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"
}

if [[ $# -lt 1 || "$1" == -h || "$1" == --help ]]; then
  usage >&2
  exit 2
fi
config="$1"
shift
if [[ ! -f "$config" ]]; then
  echo "launch.sh: config '$config' does not exist" >&2
  exit 2
fi

: "${NNODES:=1}"
: "${NODE_RANK:=${SLURM_NODEID:-0}}"
: "${MASTER_ADDR:=127.0.0.1}"
: "${MASTER_PORT:=29500}"
: "${RDZV_ID:=h3train-${MASTER_PORT}}"
: "${MAX_RESTARTS:=0}"
# What the ranks run on, for the start line: a GPU each when torch counted them here; a
# GPUS_PER_NODE given by hand may as well be CPU ranks (the config's device decides), so only
# the count is said then.
ranks_on="ranks"
if [[ -z "${GPUS_PER_NODE:-}" ]]; then
  GPUS_PER_NODE="$(python -c 'import torch; print(torch.cuda.device_count())')"
  if [[ "$GPUS_PER_NODE" -eq 0 ]]; then
    echo "launch.sh: torch sees no GPU on $(hostname); set GPUS_PER_NODE to launch CPU ranks" >&2
    exit 2
  fi
  ranks_on="ranks, one per GPU"
fi

# --- NCCL and CUDA settings that matter on A100 clusters ----------------------------------------
# Each export below is a default: a value already in the environment (site modules, the sbatch
# file, `docker run -e`) wins.
#
# A failed or timed-out collective tears the process down (1) instead of leaving ranks blocked in
# a broken communicator, so torchrun and Slurm see the failure and the job can be requeued. The
# pre-2.2 name NCCL_ASYNC_ERROR_HANDLING is deprecated; h3train needs torch >= 2.6.
export TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}"
# To debug a hang, turn on the NCCL flight recorder: TORCH_FR_BUFFER_SIZE=2000 (named
# TORCH_NCCL_TRACE_BUFFER_SIZE in older torch) with TORCH_NCCL_DUMP_ON_TIMEOUT=1 makes every rank
# dump its last collectives on a timeout, showing which rank stopped first and where.
# WARN prints only problems. For a first run on a new cluster use NCCL_DEBUG=INFO with
# NCCL_DEBUG_SUBSYS=INIT,NET: the log names the transport per channel ("NET/IB" vs "NET/Socket"),
# which is how a job silently falling back to TCP is caught.
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
# Site-specific, so left unset here (set them in the sbatch file or the environment):
#   NCCL_SOCKET_IFNAME  interface for bootstrap and socket traffic, e.g. ib0, bond0 or
#                       ^docker0,lo; needed when the default route is not the cluster network.
#   GLOO_SOCKET_IFNAME  the same for the gloo group of the background checkpoint save (and the
#                       CPU ranks); copied from NCCL_SOCKET_IFNAME below when that names interfaces.
#   NCCL_IB_HCA         HCAs to use, e.g. mlx5_0,mlx5_1,... (`ibv_devinfo` lists them); unset = all.
#   NCCL_IB_GID_INDEX   3 on most RoCE fabrics; plain InfiniBand needs nothing.
#   NCCL_IB_TIMEOUT     22 rides out short link flaps on large fabrics (the NCCL default is lower).
#   NCCL_IB_DISABLE     1 forces TCP: a diagnostic, an order of magnitude slower for FSDP.
# CUDA_DEVICE_MAX_CONNECTIONS stays unset (CUDA's default of 8 queues). Megatron sets it to 1 to
# order tensor-parallel communication before compute; here one queue would serialise FSDP2's
# all-gather and reduce-scatter streams with the compute stream and lose their overlap.
#
# gloo resolves its interface on its own and takes only exact names (NCCL also takes prefixes such
# as `ib` and exclusions such as `^docker0`): a gloo group on the wrong interface connects, or hangs,
# where NCCL works. So NCCL's setting is reused when it lists interfaces of this node.
if [[ -z "${GLOO_SOCKET_IFNAME:-}" && -n "${NCCL_SOCKET_IFNAME:-}" ]]; then
  gloo_ifnames=1
  IFS=, read -r -a nccl_ifnames <<< "${NCCL_SOCKET_IFNAME#=}"
  for ifname in "${nccl_ifnames[@]}"; do
    [[ -n "$ifname" && -e "/sys/class/net/$ifname" ]] || gloo_ifnames=0
  done
  if [[ "$gloo_ifnames" == 1 ]]; then
    export GLOO_SOCKET_IFNAME="${NCCL_SOCKET_IFNAME#=}"
  else
    echo "launch.sh: NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME} is not a list of $(hostname)'s interfaces;" \
      "set GLOO_SOCKET_IFNAME (exact names) for the gloo group of the background save" >&2
  fi
fi
#
# Expandable segments curb the fragmentation that packed samples of a different length every step
# cause in the caching allocator; the memory plan's 4 GiB reserve assumes them.
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
# One OpenMP thread per rank: the data path is light, and 8 ranks x all cores oversubscribe.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"

# A bad config or input is one line and exit 2 here, before torchrun starts a rank: the same
# checks `train` runs first (config, mesh against NNODES x GPUS_PER_NODE ranks, model folder,
# dataset, device), without the launcher's per-rank failure report.
# Its report is kept back unless the check fails: then all of it, in the order printed, ends with the
# reason.
status=0
check_output="$(PYTHONUNBUFFERED=1 python -m h3train check --strict \
  --world-size "$((NNODES * GPUS_PER_NODE))" "$config" "$@" 2>&1)" || status=$?
if [[ "$status" -ne 0 ]]; then
  printf '%s\n' "$check_output" >&2
  exit "$status"
fi

echo "launch.sh: $(hostname) node ${NODE_RANK}/${NNODES}, ${GPUS_PER_NODE} ${ranks_on}," \
  "rendezvous ${MASTER_ADDR}:${MASTER_PORT} id ${RDZV_ID}" >&2

# --- signals ---------------------------------------------------------------------------------------
# USR1 (Slurm's warning before the time limit) asks the trainer to finish its step, checkpoint and
# exit 0. torchrun does not handle USR1, and its default action would kill it and with it the
# ranks, so torchrun runs with USR1 ignored and this script hands the signal to the ranks, its
# direct children. (The ranks start with USR1 ignored too, until the trainer installs its handler.)
# TERM (scancel, a preemption) and INT (Ctrl-C) take the same road: handed to torchrun, they would
# make it print a SignalException traceback and exit 1 although the ranks checkpoint and exit
# cleanly. So torchrun ignores them too (TORCHELASTIC_SIGNALS_TO_HANDLE keeps its handlers for HUP
# and QUIT), the ranks get TERM, save and exit 0, torchrun exits 0, and this script exits 0 for a
# TERM and 130 for a Ctrl-C. A second Ctrl-C reaches the ranks as INT: they stop at once.
# A first Ctrl-C reaches the ranks as TERM, not INT, because a rank stopped by INT exits 130, which
# torchrun reports as a failed worker (its error report and a ChildFailedError traceback, exit 1).
# The ranks therefore say "preempted by SIGTERM"; this script's last line says it was a Ctrl-C.
# torch 2.8's torchrun installs its TERM and INT handlers whatever their disposition (2.13 reads
# TORCHELASTIC_SIGNALS_TO_HANDLE), so torchrun also runs in a process group of its own (`set -m`):
# a terminal's Ctrl-C, sent to the foreground process group, then reaches this script alone. HUP
# and QUIT from the terminal are handed on to torchrun, which stops the ranks as before.
set -m
( trap '' USR1 TERM INT; TORCHELASTIC_SIGNALS_TO_HANDLE=SIGHUP,SIGQUIT exec torchrun \
  --nnodes="${NNODES}" \
  --nproc-per-node="${GPUS_PER_NODE}" \
  --node-rank="${NODE_RANK}" \
  --rdzv-backend=c10d \
  --rdzv-endpoint="${MASTER_ADDR}:${MASTER_PORT}" \
  --rdzv-id="${RDZV_ID}" \
  --max-restarts="${MAX_RESTARTS}" \
  -m h3train train "$config" "$@" ) &
torchrun_pid=$!
set +m

# The ranks run in sessions of their own, so a process-group signal would miss them: find them by
# parent pid in /proc (no procps needed in the image).
# shellcheck disable=SC2329  # called from the USR1 trap
signal_ranks() {
  local stat line ppid
  for stat in /proc/[0-9]*/stat; do
    { read -r line < "$stat"; } 2>/dev/null || continue
    # Fields after "(comm)", which may itself hold spaces: state, ppid, ...
    read -r _ ppid _ <<< "${line##*) }"
    if [[ "$ppid" == "$torchrun_pid" ]]; then
      kill -s "$1" "${stat//[!0-9]/}" 2>/dev/null || true
    fi
  done
}
# shellcheck disable=SC2329  # invoked by the traps below
on_usr1() {
  echo "launch.sh: USR1 on $(hostname): asking the ranks to checkpoint and exit" >&2
  signal_ranks USR1
}
# shellcheck disable=SC2329
on_term() {
  echo "launch.sh: TERM on $(hostname): asking the ranks to checkpoint and exit (preempted)" >&2
  signal_ranks TERM
}
interrupted=0
# shellcheck disable=SC2329
on_int() {
  if [[ "$interrupted" == 1 ]]; then
    signal_ranks INT
    return
  fi
  interrupted=1
  echo "launch.sh: Ctrl-C on $(hostname): asking the ranks to checkpoint and exit (Ctrl-C again to stop at once)" >&2
  signal_ranks TERM
}
# shellcheck disable=SC2329
forward() {
  kill -s "$1" "$torchrun_pid" 2>/dev/null || true
}
trap 'forward HUP' HUP
trap 'forward QUIT' QUIT
trap on_usr1 USR1
trap on_term TERM
trap on_int INT

# `wait` returns early (status > 128) whenever a trapped signal arrives, so wait until torchrun is
# gone; bash keeps the exit status of a reaped background job, which the last `wait` returns.
while kill -0 "$torchrun_pid" 2>/dev/null; do
  wait "$torchrun_pid" || true
done
status=0
wait "$torchrun_pid" || status=$?
if [[ "$status" == 0 && "$interrupted" == 1 ]]; then
  echo "launch.sh: interrupted by Ctrl-C on $(hostname): the ranks saved a checkpoint and stopped" \
    "(they were handed TERM, hence their 'preempted by SIGTERM' line); resume with checkpoint.resume=auto" >&2
  status=130
fi
exit "$status"
