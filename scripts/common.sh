#!/usr/bin/env bash
# Shared by the launchers: finding the interpreter with MindSpore, checking arguments, splitting
# [PATH ...] [--key value ...], and asking the project's config loader for a checked value.
# Sourced, not run.

REPO_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# MindSpore's C++ log at errors only (its notices about its own APIs stay out of the logs), unless the
# user chose a level; exported, so msrun and its workers get it before they import MindSpore.
export GLOG_v="${GLOG_v:-3}"

die() {
    echo "error: $*" >&2
    exit 2
}

# The interpreter that has MindSpore: $PYTHON if set, else the first of python, python3 on PATH. Found, not imported:
# the import takes about 3 s, which the job pays again, and an install that is there but broken then fails in the
# job with MindSpore's own message instead of being reported missing.
find_python() {
    local candidate
    for candidate in ${PYTHON:-python python3}; do
        if command -v "$candidate" >/dev/null 2>&1 &&
           "$candidate" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('mindspore') is None)" >/dev/null 2>&1; then
            command -v "$candidate"
            return 0
        fi
    done
    die "no Python with MindSpore found (tried: ${PYTHON:-python python3}); pip install -r $REPO_DIR/requirements.txt or set PYTHON=/path/to/python"
}

require_dir() {  # require_dir WHAT PATH
    [[ -d "$2" ]] || die "$1 $2 does not exist or is not a folder"
}

require_file() {  # require_file WHAT PATH
    [[ -f "$2" ]] || die "$1 $2 does not exist or is not a file"
}

require_positive_int() {  # require_positive_int WHAT VALUE
    [[ "$2" =~ ^[1-9][0-9]*$ ]] || die "$1 must be a positive integer, got '$2'"
}

# split_arguments ARG...: leading arguments that are not --options go to POSITIONAL, the rest
# (the --key value pairs for the Python script) to OPTIONS.
# shellcheck disable=SC2034  # POSITIONAL and OPTIONS are read by the launcher that sources this file
split_arguments() {
    POSITIONAL=()
    OPTIONS=()
    while [[ $# -gt 0 && "$1" != --* ]]; do
        POSITIONAL+=("$1")
        shift
    done
    OPTIONS=("$@")
}

# config_value KEY ARG...: the value train.py/eval.py will use for KEY with these arguments (exits 2,
# with the loader's one-line message, on a bad key or value).
config_value() {
    local key="$1"
    shift
    PYTHONPATH="$REPO_DIR${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON_BIN" -m src.model_utils.config "$key" "$@" || exit 2
}

# msrun starts workers with the bare word `python`: put one that runs PYTHON_BIN first on PATH. When PYTHON_BIN
# is itself named python (a virtualenv's bin/python), that is its own folder. Otherwise it is a new folder
# (SHIM_DIR, removed by the launcher's exit trap) holding a script that execs PYTHON_BIN, not a symlink: Python
# finds its virtualenv from the pyvenv.cfg beside the path it was started by, so a symlink to venv/bin/python3
# elsewhere starts the base interpreter.
# shellcheck disable=SC2034  # SHIM_DIR is removed by the launcher's exit trap
put_python_first_on_path() {
    SHIM_DIR=""
    if [[ "$(basename "$PYTHON_BIN")" == python ]]; then
        PATH="$(cd "$(dirname "$PYTHON_BIN")" && pwd):$PATH"
        export PATH
        return 0
    fi
    SHIM_DIR="$(mktemp -d)"
    printf '#!%s\nexec %q "$@"\n' "$BASH" "$PYTHON_BIN" > "$SHIM_DIR/python"
    chmod +x "$SHIM_DIR/python"
    export PATH="$SHIM_DIR:$PATH"
}

free_port() {
    "$PYTHON_BIN" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}
