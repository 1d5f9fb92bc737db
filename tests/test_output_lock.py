"""One training run per output folder (src/output_lock.py): a second holder is refused in one line naming the
folder and the running process's PID, and leaves the folder untouched; a lock whose holder was killed (kill -9)
does not block; only rank 0 locks. With real processes: a holder script, and train.py itself."""
import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, Tuple

import pytest

from conftest import FAST_ARGS, REPO, assert_one_line_error, one_line_user_error, run_script, script_env, temp_files
from src.errors import UserError
from src.output_lock import LOCK_NAME, lock_holder, output_folder_lock
from src.utils import SCHEDULER_RANK

# Holds the lock of argv[1] as rank argv[2] until its stdin closes (or it is killed).
HOLDER = """
import sys
from src.output_lock import output_folder_lock
with output_folder_lock(sys.argv[1], int(sys.argv[2])):
    print("held", flush=True)
    sys.stdin.read()
"""


def start_holder(folder: Path, rank: int = 0) -> subprocess.Popen:
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(folder), str(rank)], cwd=REPO, env=script_env(),
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "held\n"
    return holder


def test_a_second_run_is_refused_with_the_holders_pid_until_it_ends(tmp_path):
    folder = tmp_path / "out"
    holder = start_holder(folder)
    with pytest.raises(UserError) as excinfo:
        with output_folder_lock(folder):
            pass
    one_line_user_error(excinfo, f"output folder {folder} is in use by another train.py (PID {holder.pid})",
                        "wait for it to finish, or pass another --output_path")
    holder.stdin.close()
    assert holder.wait(timeout=60) == 0
    assert not (folder / LOCK_NAME).exists()  # removed as it was released
    with output_folder_lock(folder):
        assert lock_holder(folder / LOCK_NAME) == os.getpid()
    assert list(folder.iterdir()) == []


def test_a_lock_whose_holder_was_killed_does_not_block(tmp_path):
    folder = tmp_path / "out"
    holder = start_holder(folder)
    holder.send_signal(signal.SIGKILL)
    assert holder.wait(timeout=60) == -signal.SIGKILL
    assert lock_holder(folder / LOCK_NAME) == holder.pid  # the file outlives it; the kernel dropped the lock
    with output_folder_lock(folder):
        pass
    assert list(folder.iterdir()) == []


@pytest.mark.parametrize("rank", [1, SCHEDULER_RANK])
def test_only_rank_0_locks(tmp_path, rank):
    """msrun's workers of rank > 0 and its scheduler share rank 0's output_path: they neither lock nor wait."""
    folder = tmp_path / "out"
    holder = start_holder(folder)
    try:
        with output_folder_lock(folder, rank):
            pass
        with output_folder_lock(tmp_path / "fresh", rank):
            pass
        assert not (tmp_path / "fresh").exists()
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)


def test_a_folder_that_cannot_be_written_is_one_line(tmp_path):
    (tmp_path / "a-file").write_text("")
    with pytest.raises(UserError) as excinfo:
        with output_folder_lock(tmp_path / "a-file" / "out"):
            pass
    one_line_user_error(excinfo, f"cannot write in output folder {tmp_path / 'a-file' / 'out'} (",
                        "pass another --output_path")


@pytest.mark.slow
def test_the_distributed_launcher_is_refused_before_msrun_writes_its_logs(tmp_path):
    """msrun truncates OUTPUT_PATH/msrun_log/*.log as it starts: a running job's folder is refused before that."""
    folder = tmp_path / "out"
    holder = start_holder(folder)
    try:
        launcher = subprocess.run(["bash", str(REPO / "scripts" / "run_distribute_train.sh"), "2", "--output_path",
                                   str(folder)], cwd=REPO, env=script_env({"PYTHON": sys.executable}),
                                  capture_output=True, text=True, timeout=120)
        assert_one_line_error(launcher, f"output folder {folder} is in use by another train.py (PID {holder.pid})")
        assert sorted(p.name for p in folder.iterdir()) == [LOCK_NAME]  # no msrun_log
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)


# ------------------------------------------------------------------------------------------------ train.py

SMALL = ["--model_name", "resnet18", "--batch_size", "8", "--train_num_samples", "32", "--eval_num_samples", "8",
         "--epoch_size", "2", *FAST_ARGS]


def start_training(args, console: Path) -> subprocess.Popen:
    with open(console, "w") as handle:
        return subprocess.Popen([sys.executable, str(REPO / "train.py"), *args], cwd=REPO, stdout=handle,
                                stderr=subprocess.STDOUT, env=script_env())


def wait_until_training(train_log: Path, console: Path, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + 300
    while "epoch 1/2 step 1/" not in (train_log.read_text() if train_log.exists() else ""):
        assert process.poll() is None, console.read_text()[-3000:]
        assert time.monotonic() < deadline, console.read_text()[-3000:]
        time.sleep(0.1)


def snapshot(folder: Path) -> Dict[str, Tuple[str, int]]:
    """Every file under folder: its SHA-256 and modification time."""
    return {str(p.relative_to(folder)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_a_second_train_py_on_a_running_ones_folder_is_refused_and_touches_nothing(cifar_dir, tmp_path):
    out, console = tmp_path / "out", tmp_path / "first.console"
    first = start_training(["--data_path", str(cifar_dir), "--output_path", str(out), *SMALL], console)
    try:
        wait_until_training(out / "train.log", console, first)
        # Paused while the second runs, so that its folder stays still (kill -STOP keeps its lock) and it
        # cannot finish before the second has tried.
        first.send_signal(signal.SIGSTOP)
        before = snapshot(out)
        second = run_script("train.py", ["--data_path", str(cifar_dir), "--output_path", str(out), *SMALL,
                                          "--epoch_size", "1"])
        assert_one_line_error(second, f"output folder {out} is in use by another train.py (PID {first.pid})",
                              "pass another --output_path")
        assert second.stdout == ""  # not one log line: the refusal comes before the logger opens train.log
        assert snapshot(out) == before
    finally:
        first.send_signal(signal.SIGCONT)
    assert first.wait(timeout=600) == 0, console.read_text()[-3000:]
    log = (out / "train.log").read_text()
    assert log.count("training resnet18") == 1 and "epoch 2 done" in log
    assert (out / "resnet18-epoch002.ckpt").is_file() and temp_files(out) == []
    assert not (out / LOCK_NAME).exists()


@pytest.mark.slow
def test_a_train_py_killed_with_sigkill_does_not_block_the_next_run(cifar_dir, tmp_path):
    out, console = tmp_path / "out", tmp_path / "first.console"
    args = ["--data_path", str(cifar_dir), "--output_path", str(out), *SMALL]
    first = start_training(args, console)
    wait_until_training(out / "train.log", console, first)
    first.send_signal(signal.SIGKILL)
    assert first.wait(timeout=60) == -signal.SIGKILL
    assert lock_holder(out / LOCK_NAME) == first.pid  # left behind, naming a dead process
    second = run_script("train.py", args + ["--epoch_size", "1"])
    assert second.returncode == 0, second.stderr[-3000:]
    assert (out / "resnet18-epoch001.ckpt").is_file() and not (out / LOCK_NAME).exists()
