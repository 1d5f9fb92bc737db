#!/usr/bin/env bash
# Evaluates a checkpoint on the CIFAR-10 test set with eval.py.
set -uo pipefail
# shellcheck source=scripts/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

usage() {
    cat <<USAGE
usage: bash scripts/run_eval.sh DATA_PATH CHECKPOINT_PATH [CONFIG_PATH] [--key value ...]

  DATA_PATH        folder holding test_batch.bin (cifar-10-batches-bin, or the zoo's cifar-10-verify-bin)
  CHECKPOINT_PATH  the checkpoint to evaluate
  CONFIG_PATH      yaml overlaying default_config.yaml (default: none)
  --key value      any config key, passed to eval.py

Runs eval.py in the foreground and exits with its exit code. eval_result.json and eval.log go to the
config's output_path; the last line printed is the result as JSON.
USAGE
}

if [[ $# -eq 0 ]]; then usage >&2; exit 2; fi
if [[ "$1" == "-h" || "$1" == "--help" ]]; then usage; exit 0; fi
split_arguments "$@"
[[ ${#POSITIONAL[@]} -ge 2 ]] || die "DATA_PATH and CHECKPOINT_PATH are required (see -h)"
[[ ${#POSITIONAL[@]} -le 3 ]] || die "too many arguments before the --options: ${POSITIONAL[*]} (see -h)"
require_dir "DATA_PATH" "${POSITIONAL[0]}"
require_file "CHECKPOINT_PATH" "${POSITIONAL[1]}"
PYTHON_BIN="$(find_python)" || exit 2
ARGS=(--eval_data_path "${POSITIONAL[0]}" --checkpoint_path "${POSITIONAL[1]}")
if [[ -n "${POSITIONAL[2]:-}" ]]; then require_file "CONFIG_PATH" "${POSITIONAL[2]}"; ARGS+=(--config_path "${POSITIONAL[2]}"); fi
ARGS+=("${OPTIONS[@]}")
OUTPUT_PATH="$(config_value output_path "${ARGS[@]}")" || exit 2

echo "evaluating ${POSITIONAL[1]} with $PYTHON_BIN; eval_result.json and eval.log go to $OUTPUT_PATH" >&2
"$PYTHON_BIN" "$REPO_DIR/eval.py" "${ARGS[@]}"
exit $?
