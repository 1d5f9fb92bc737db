#!/usr/bin/env bash
# Data-parallel training with MindSpore's msrun: DEVICE_NUM workers on this node (of NODE_NUM nodes).
set -uo pipefail
# shellcheck source=scripts/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

usage() {
    cat <<USAGE
usage: bash scripts/run_distribute_train.sh DEVICE_NUM [DATA_PATH] [CONFIG_PATH] [--key value ...]

  DEVICE_NUM   workers on this node (one per device; on CPU, processes)
  DATA_PATH    extracted cifar-10-batches-bin folder (default: data_path of the config)
  CONFIG_PATH  yaml overlaying default_config.yaml (default: none)
  --key value  any config key, passed to train.py on every rank

Environment (optional):
  NODE_NUM, NODE_RANK, MASTER_ADDR, MASTER_PORT  several nodes: run this on each node with the same
               NODE_NUM, MASTER_ADDR and MASTER_PORT and its own NODE_RANK; NODE_RANK 0 runs on the
               machine at MASTER_ADDR and starts the job's scheduler on MASTER_PORT
  MS_TOPO_TIMEOUT  seconds for all nodes to join (default 600)
  MS_NODE_TIMEOUT  seconds of silence from a node before the job fails (default 30)
  MS_CPU_COMM_OP_TIMEOUT  seconds a CPU collective waits for the other ranks (default 30)
  RANK_TABLE_FILE  Ascend: start the workers from an HCCL rank table (msrun --rank_table_file)
  PYTHON       the interpreter with MindSpore (default: python, then python3)

Starts msrun --worker_num=DEVICE_NUM*NODE_NUM --local_worker_num=DEVICE_NUM (on a free master port
when single node), waits for the job and exits with its exit code. Per-rank logs go to
OUTPUT_PATH/msrun_log/worker_N.log (N: the global rank); rank 0 writes checkpoints, metrics.csv and
train.log to OUTPUT_PATH. A worker that fails ends the job at once (on one node) with its exit code and
its error line. If a node is lost, the others exit non-zero within about 35 s.
Ctrl-C or SIGTERM: the workers save <model>-interrupted.ckpt and stop; the exit code is 128 + signal.
USAGE
}

if [[ $# -eq 0 ]]; then usage >&2; exit 2; fi
if [[ "$1" == "-h" || "$1" == "--help" ]]; then usage; exit 0; fi
split_arguments "$@"
[[ ${#POSITIONAL[@]} -ge 1 ]] || die "DEVICE_NUM is missing (see -h)"
[[ ${#POSITIONAL[@]} -le 3 ]] || die "too many arguments before the --options: ${POSITIONAL[*]} (see -h)"
DEVICE_NUM="${POSITIONAL[0]}"
require_positive_int "DEVICE_NUM" "$DEVICE_NUM"
NODE_NUM="${NODE_NUM:-1}"
NODE_RANK="${NODE_RANK:-0}"
require_positive_int "NODE_NUM" "$NODE_NUM"
[[ "$NODE_RANK" =~ ^[0-9]+$ && "$NODE_RANK" -lt "$NODE_NUM" ]] || die "NODE_RANK must be 0..$((NODE_NUM - 1)), got '$NODE_RANK'"
[[ "$NODE_NUM" -eq 1 || -n "${MASTER_ADDR:-}" ]] || die "NODE_NUM=$NODE_NUM needs MASTER_ADDR (the address of node 0)"
[[ "$NODE_NUM" -eq 1 || -n "${MASTER_PORT:-}" ]] || die "NODE_NUM=$NODE_NUM needs MASTER_PORT (the same on every node)"
if [[ -n "${MASTER_PORT:-}" ]] && ! [[ "$MASTER_PORT" =~ ^[1-9][0-9]{3,4}$ && "$MASTER_PORT" -ge 1024 && "$MASTER_PORT" -le 65535 ]]; then
    die "MASTER_PORT must be a port number from 1024 to 65535, got '$MASTER_PORT'"
fi
# How long MindSpore waits before it fails the job (seconds; see docs/launch.md). msrun overwrites MS_TOPO_TIMEOUT
# with its --cluster_time_out, so that option carries it. The other two are MindSpore 2.10's defaults, set here so
# that the time a lost node takes to end the job (tested: under 60 s) does not move with MindSpore's defaults.
MS_TOPO_TIMEOUT="${MS_TOPO_TIMEOUT:-600}"           # all nodes must have joined within this
export MS_NODE_TIMEOUT="${MS_NODE_TIMEOUT:-30}"     # the scheduler fails the job when a node is silent this long
export MS_CPU_COMM_OP_TIMEOUT="${MS_CPU_COMM_OP_TIMEOUT:-30}"  # a CPU collective waits this long for the others
for knob in MS_TOPO_TIMEOUT MS_NODE_TIMEOUT MS_CPU_COMM_OP_TIMEOUT; do
    require_positive_int "$knob" "${!knob}"
done
if [[ -n "${RANK_TABLE_FILE:-}" ]]; then require_file "RANK_TABLE_FILE" "$RANK_TABLE_FILE"; fi
PYTHON_BIN="$(find_python)" || exit 2
if [[ -n "${MASTER_PORT:-}" ]]; then  # MASTER_ADDR resolves; on node 0 it is this machine's and the port is free
    "$PYTHON_BIN" "$REPO_DIR/scripts/msrun_node.py" --check-master "${MASTER_ADDR:-127.0.0.1}" "$MASTER_PORT" "$NODE_RANK" || exit 2
fi
ARGS=()
if [[ -n "${POSITIONAL[1]:-}" ]]; then require_dir "DATA_PATH" "${POSITIONAL[1]}"; ARGS+=(--data_path "${POSITIONAL[1]}"); fi
if [[ -n "${POSITIONAL[2]:-}" ]]; then require_file "CONFIG_PATH" "${POSITIONAL[2]}"; ARGS+=(--config_path "${POSITIONAL[2]}"); fi
ARGS+=("${OPTIONS[@]}")
OUTPUT_PATH="$(config_value output_path "${ARGS[@]}")" || exit 2
MODEL_NAME="$(config_value model_name "${ARGS[@]}")" || exit 2
LOG_DIR="$OUTPUT_PATH/msrun_log"
# A train.py running on OUTPUT_PATH holds its lock (src/output_lock.py): refused before msrun truncates that
# run's logs in LOG_DIR. Only node 0: rank 0, which takes the lock, runs there.
if [[ "$NODE_RANK" -eq 0 ]]; then
    PYTHONPATH="$REPO_DIR${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON_BIN" -m src.output_lock "$OUTPUT_PATH" || exit 2
fi
mkdir -p "$LOG_DIR" || die "cannot create $LOG_DIR"

MSRUN_ARGS=(--worker_num="$((DEVICE_NUM * NODE_NUM))" --local_worker_num="$DEVICE_NUM"
            --master_addr="${MASTER_ADDR:-127.0.0.1}" --master_port="${MASTER_PORT:-$(free_port)}"
            --node_rank="$NODE_RANK" --log_dir="$LOG_DIR" --join=True --cluster_time_out="$MS_TOPO_TIMEOUT")
if [[ -n "${RANK_TABLE_FILE:-}" ]]; then MSRUN_ARGS+=(--rank_table_file="$RANK_TABLE_FILE"); fi
put_python_first_on_path
trap 'rm -rf "$SHIM_DIR"' EXIT
export RESNET_SHIM_DIR="$SHIM_DIR"  # scripts/msrun_node.py removes it if this launcher is killed (no EXIT trap then)
# This node's workers share its CPUs (src/onednn_conv.py native_thread_count); msrun tells them only the job's total.
export RESNET_LOCAL_WORKERS="$DEVICE_NUM"

# Ctrl-C/SIGTERM: msrun's own handler SIGKILLs the workers and exits 0, losing the interrupted checkpoint.
# So msrun runs in its own session (a terminal's Ctrl-C reaches only this script), and this script asks
# the workers of this launch (tagged by RESNET_LAUNCH_ID) to save and stop, as train.py does on SIGTERM.
command -v setsid >/dev/null 2>&1 || die "setsid (util-linux) is needed to start msrun"
export RESNET_LAUNCH_ID="$$-$RANDOM"
STOPPED_BY=""
# shellcheck disable=SC2329  # invoked by the traps below
stop_workers() {
    STOPPED_BY="$1"
    echo "signal received: asking the workers to save a checkpoint and stop" >&2
    local pid
    for pid in $(pgrep -f "$REPO_DIR/train.py"); do
        if tr '\0' '\n' < "/proc/$pid/environ" 2>/dev/null | grep -qx "RESNET_LAUNCH_ID=$RESNET_LAUNCH_ID" &&
           tr '\0' '\n' < "/proc/$pid/environ" 2>/dev/null | grep -qx "MS_ROLE=MS_WORKER"; then
            kill -TERM "$pid" 2>/dev/null
        fi
    done
}
trap 'stop_workers 2' INT
trap 'stop_workers 15' TERM

echo "msrun: $DEVICE_NUM worker(s) on node $NODE_RANK of $NODE_NUM with $PYTHON_BIN"
echo "per-rank logs: $LOG_DIR/worker_*.log; checkpoints, metrics.csv and train.log (rank 0): $OUTPUT_PATH"
setsid "$PYTHON_BIN" "$REPO_DIR/scripts/msrun_node.py" "${MSRUN_ARGS[@]}" "$REPO_DIR/train.py" "${ARGS[@]}" &
MSRUN_PID=$!
wait "$MSRUN_PID"
code=$?
while kill -0 "$MSRUN_PID" 2>/dev/null; do  # a trapped signal interrupts wait: wait for msrun to finish
    wait "$MSRUN_PID"
    code=$?
done
if [[ -n "$STOPPED_BY" ]]; then
    code=$((128 + STOPPED_BY))
    echo "stopped by signal $STOPPED_BY; resume with --resume $OUTPUT_PATH/$MODEL_NAME-interrupted.ckpt"
fi
echo "distributed training exited with $code; logs in $LOG_DIR"
exit "$code"
