"""Run environment: device choice, the oneDNN speed setting, launcher detection."""
import logging
import os
import subprocess
import sys

import pytest

from conftest import REPO, assert_one_line_error, run_script
from src.errors import UserError
from src.utils import (ONEDNN_ISA_VARIABLE, SCHEDULER_RANK, apply_cpu_speed_setting, launched_distributed,
                       launcher_rank, select_device)


def test_auto_picks_cpu_here_and_logs_it(caplog):
    logger = logging.getLogger("test-utils")
    with caplog.at_level(logging.INFO, logger="test-utils"):
        assert select_device("Auto", logger) == "CPU"
    assert "device_target Auto: using CPU" in caplog.text


@pytest.mark.parametrize("target", ["GPU", "Ascend"])
def test_unusable_explicit_target_is_refused(target):
    with pytest.raises(UserError) as caught:
        select_device(target, logging.getLogger("test-utils"))
    assert f"device_target {target} is not usable" in str(caught.value)
    assert "usable here: CPU" in str(caught.value) and "\n" not in str(caught.value)


def test_cpu_speed_setting_default_and_user_value_wins(monkeypatch):
    monkeypatch.delenv(ONEDNN_ISA_VARIABLE, raising=False)
    assert apply_cpu_speed_setting() == "AVX2" and os.environ[ONEDNN_ISA_VARIABLE] == "AVX2"
    monkeypatch.setenv(ONEDNN_ISA_VARIABLE, "AVX512_CORE")
    assert apply_cpu_speed_setting() == "AVX512_CORE"


def test_launcher_detection(monkeypatch):
    for name in ("MS_ROLE", "RANK_TABLE_FILE", "RANK_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert not launched_distributed()
    assert launcher_rank() == 0
    monkeypatch.setenv("MS_ROLE", "MS_WORKER")
    monkeypatch.setenv("RANK_ID", "1")
    assert launched_distributed() and launcher_rank() == 1
    # msrun runs the script as its scheduler too: distributed, but never rank 0 (it must write nothing).
    monkeypatch.setenv("MS_ROLE", "MS_SCHED")
    monkeypatch.setenv("RANK_ID", "0")
    assert launched_distributed() and launcher_rank() == SCHEDULER_RANK


@pytest.mark.slow
def test_scripts_apply_the_speed_setting_unless_the_user_set_it(cifar_dir, tmp_path):
    env = {key: value for key, value in os.environ.items() if key != ONEDNN_ISA_VARIABLE}
    args = ["--data_path", str(cifar_dir), "--output_path", str(tmp_path),
            "--checkpoint_path", str(tmp_path / "x.ckpt")]
    # MindSpore's own convolutions need the AVX2 cap; the blocked-layout ones run uncapped.
    plain = subprocess.run([sys.executable, "eval.py", *args, "--conv_implementation", "mindspore"], cwd=REPO,
                           env=env, capture_output=True, text=True, timeout=300)
    assert "ONEDNN_MAX_CPU_ISA=AVX2 (project default), convolutions: mindspore" in plain.stdout, plain.stdout[-2000:]
    blocked = subprocess.run([sys.executable, "eval.py", *args, "--conv_implementation", "onednn_blocked"],
                             cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert "ONEDNN_MAX_CPU_ISA=all (project default), convolutions: onednn_blocked" in blocked.stdout, \
        blocked.stdout[-2000:]
    env[ONEDNN_ISA_VARIABLE] = "AVX512_CORE"
    user = subprocess.run([sys.executable, "eval.py", *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert "ONEDNN_MAX_CPU_ISA=AVX512_CORE (set by the user)" in user.stdout, user.stdout[-2000:]


@pytest.mark.slow
def test_cli_refuses_an_unusable_device(cifar_dir, tmp_path):
    process = run_script("train.py", ["--device_target", "GPU", "--data_path", str(cifar_dir),
                                      "--output_path", str(tmp_path)])
    assert_one_line_error(process, "device_target GPU is not usable")
    assert not list(tmp_path.glob("*.ckpt"))


def test_training_graphs_on_the_cpu_get_static_memory_planning():
    """set_execution_mode: a training process's graphs on the CPU compile with memory_optimize_level O1 (ResNet-50's
    step at 224x224 kept its lower peak), an evaluating process's and other devices' with the default, and PyNative
    mode is left as MindSpore runs it. In a fresh process: the context is process-wide."""
    code = ("import mindspore as ms; from src.utils import set_execution_mode\n"
            "for args in ((True, 'CPU', True), (True, 'CPU', False), (True, 'GPU', True), (False, 'CPU', True)):\n"
            "    set_execution_mode(*args)\n"
            "    print(ms.get_context('mode'), ms.get_context('memory_optimize_level'))")
    process = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    # (mode, level): graph is 0, PyNative 1; the levels read back as 1 (O1) and 0 (O0)
    assert process.stdout.split("\n")[:4] == ["0 1", "0 0", "0 0", "1 0"], process.stderr[-3000:]


EXIT_PROGRAM = """
import atexit, gc, sys
from src.errors import UserError, run_cli
atexit.register(lambda: print("frozen at exit:", gc.get_freeze_count(), flush=True))
def main():
    global kept
    kept = [[[]] for _ in range(5000)]  # alive when main() ends, as a script's networks are: 10000 lists
    if sys.argv[1] == "refused":
        raise UserError("--key bad: use a good one")
    return int(sys.argv[1])
run_cli(main)
"""


@pytest.mark.parametrize("outcome, code", [("0", 0), ("3", 3), ("refused", 2)])
def test_run_cli_leaves_mains_objects_out_of_the_last_collection_and_keeps_its_exit(outcome, code):
    """run_cli freezes what main() left alive (the interpreter's last garbage collection would walk it all: about
    1.9 s of a small train.py's exit); the exit code, the error line and atexit handlers are as before."""
    process = subprocess.run([sys.executable, "-c", EXIT_PROGRAM, outcome], cwd=REPO, capture_output=True, text=True,
                             timeout=60)
    assert process.returncode == code, process.stderr
    frozen = int(process.stdout.split("frozen at exit:")[1])
    assert frozen >= 10000, process.stdout  # main()'s 10000 lists at least
    assert ("error: --key bad: use a good one" in process.stderr) == (outcome == "refused")
