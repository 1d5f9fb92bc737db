#!/usr/bin/env bash
# Trains on one device: python train.py [--data_path DATA_PATH] [--config_path CONFIG_PATH] [--key value ...]
set -uo pipefail
# shellcheck source=scripts/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

usage() {
    cat <<USAGE
usage: bash scripts/run_standalone_train.sh [DATA_PATH] [CONFIG_PATH] [--key value ...]

  DATA_PATH    extracted cifar-10-batches-bin folder (default: data_path of the config)
  CONFIG_PATH  yaml overlaying default_config.yaml (default: none)
  --key value  any config key, passed to train.py (see: python train.py --help)

Runs train.py in the foreground on the configured device_target (Auto: Ascend, GPU, then CPU) and
exits with its exit code. Checkpoints, metrics.csv and train.log go to the config's output_path.
Set PYTHON=/path/to/python to choose the interpreter.
USAGE
}

if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then usage; exit 0; fi
split_arguments "$@"
[[ ${#POSITIONAL[@]} -le 2 ]] || die "too many arguments before the --options: ${POSITIONAL[*]} (see -h)"
PYTHON_BIN="$(find_python)" || exit 2
ARGS=()
if [[ -n "${POSITIONAL[0]:-}" ]]; then require_dir "DATA_PATH" "${POSITIONAL[0]}"; ARGS+=(--data_path "${POSITIONAL[0]}"); fi
if [[ -n "${POSITIONAL[1]:-}" ]]; then require_file "CONFIG_PATH" "${POSITIONAL[1]}"; ARGS+=(--config_path "${POSITIONAL[1]}"); fi
ARGS+=("${OPTIONS[@]}")
OUTPUT_PATH="$(config_value output_path "${ARGS[@]}")" || exit 2

echo "training with $PYTHON_BIN; checkpoints, metrics.csv and train.log go to $OUTPUT_PATH"
"$PYTHON_BIN" "$REPO_DIR/train.py" "${ARGS[@]}"
code=$?
echo "train.py exited with $code; outputs in $OUTPUT_PATH"
exit "$code"
