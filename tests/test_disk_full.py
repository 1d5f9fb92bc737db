"""A full disk and the file-size limit while outputs are written: the previous file stays intact, nothing partial
keeps a final name or stays behind, and the failure is one line naming the folder and what to do.

Two real limits: RLIMIT_FSIZE (ulimit -f; Python ignores SIGXFSZ, so a write past it fails with EFBIG), which
any user can set, and a small tmpfs (ENOSPC), mounted in a private mount namespace (unshare), where the machine
allows one; those tests are skipped elsewhere.
"""
import contextlib
import errno
import hashlib
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator, List, Optional

import numpy as np
import pytest

from conftest import FAST_ARGS, REPO, assert_one_line_error, read_ckpt_entries, run_script, script_env, temp_files
from src.atomic_file import DiskFullError, atomic_write, disk_full_cause, write_text_atomic
from src.errors import UserError

MB = 2 ** 20


@contextlib.contextmanager
def file_size_limit(limit: int) -> Iterator[None]:
    """This process's RLIMIT_FSIZE soft limit set to limit bytes for the block (the hard limit is kept, so the
    old value can be restored)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def one_line(excinfo, *fragments: str) -> str:
    message = str(excinfo.value)
    assert isinstance(excinfo.value, UserError) and "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    return message


# ------------------------------------------------------------------------------ atomic_write under ulimit -f

def test_a_write_past_the_file_size_limit_keeps_the_previous_file(tmp_path):
    final = tmp_path / "metrics.csv"
    write_text_atomic(final, "epoch\n1\n")
    with file_size_limit(64 * 1024), pytest.raises(DiskFullError) as excinfo:
        write_text_atomic(final, "x" * MB)
    one_line(excinfo, "file too large writing metrics.csv in", str(tmp_path), "ulimit -f", "0.1 MB", "run again")
    assert excinfo.value.cause.errno == errno.EFBIG
    assert final.read_text() == "epoch\n1\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.csv"]


@pytest.mark.slow
def test_a_checkpoint_past_the_file_size_limit_keeps_the_previous_one_and_mindspores_own_log_is_quiet(
        tmp_path, capfd):
    """ms.save_checkpoint raises a plain OSError(EFBIG) here (and logs a CRITICAL line, which is dropped)."""
    import mindspore as ms
    from src.weights.files import save_checkpoint_atomic
    final = tmp_path / "resnet18-epoch001.ckpt"
    save_checkpoint_atomic([{"name": "w", "data": ms.Tensor(np.ones(1000, np.float32))}], str(final))
    before = final.read_bytes()
    with file_size_limit(MB), pytest.raises(DiskFullError) as excinfo:
        save_checkpoint_atomic([{"name": "w", "data": ms.Tensor(np.ones(MB, np.float32))}], str(final))
    one_line(excinfo, "file too large writing resnet18-epoch001.ckpt in", str(tmp_path))
    assert type(excinfo.value.__cause__) is OSError  # what MindSpore raised, unwrapped
    assert final.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["resnet18-epoch001.ckpt"]  # no .partial-*, no .tmp
    assert "Failed to save the checkpoint file" not in capfd.readouterr().err


@pytest.mark.slow
def test_a_wrapped_disk_full_error_is_recognised(tmp_path):
    """torch.save reports the failed write as a RuntimeError whose context is the OSError."""
    from src.weights.files import save_torch_state_dict_atomic
    final = tmp_path / "weights.pth"
    with file_size_limit(64 * 1024), pytest.raises(DiskFullError) as excinfo:
        save_torch_state_dict_atomic({"w": np.ones(MB, np.float32)}, str(final))
    assert isinstance(excinfo.value.__cause__, RuntimeError)
    one_line(excinfo, "file too large writing weights.pth in", str(tmp_path))
    assert list(tmp_path.iterdir()) == []


def test_the_training_curves_past_the_file_size_limit_keep_the_previous_figure(tmp_path):
    from src.plotting import plot_training_curves
    rows = [{"epoch": "1", "lr": "0.1", "train_loss": "2.3", "eval_loss": "2.2", "top1": "0.1", "top5": "0.5"}]
    final = Path(plot_training_curves(rows, str(tmp_path / "training_curves.png")))
    before = final.read_bytes()
    with file_size_limit(4096), pytest.raises(DiskFullError) as excinfo:
        plot_training_curves(rows * 2, str(final))
    one_line(excinfo, "writing training_curves.png in", str(tmp_path))
    assert final.read_bytes() == before and temp_files(tmp_path) == []


def test_other_failures_are_not_called_a_full_disk(tmp_path):
    final = tmp_path / "model.ckpt"
    with pytest.raises(PermissionError):
        with atomic_write(final):
            raise PermissionError(errno.EACCES, "denied")
    with pytest.raises(UserError) as excinfo:
        with atomic_write(final):
            raise UserError("the caller's own message")
    assert excinfo.type is UserError and str(excinfo.value) == "the caller's own message"
    assert disk_full_cause(RuntimeError("write failed")) is None
    assert list(tmp_path.iterdir()) == []


def test_a_full_log_file_is_one_warning_and_the_run_goes_on(tmp_path, capfd):
    """train.log past the limit: one warning line, not logging's traceback per record; the terminal keeps every
    line."""
    from src.utils import get_logger
    log_file = tmp_path / "train.log"
    log_file.write_text("earlier run\n" * (MB // 12))
    logger = get_logger(str(tmp_path), "train.log")
    try:
        with file_size_limit(log_file.stat().st_size + 100):
            for step in range(20):
                logger.info("epoch 1 step %d", step)
    finally:
        for handler in list(logger.handlers):
            logger.removeHandler(handler)
            handler.close()
    captured = capfd.readouterr()
    assert "Logging error" not in captured.err and "Traceback" not in captured.err
    assert captured.err.splitlines() == [
        f"warning: file too large writing train.log in {tmp_path} (the file-size limit (ulimit -f) is 1.0 MB): "
        "raise the limit (ulimit -f unlimited) or write to another file system; training goes on, but train.log "
        "misses its lines until then"]
    assert captured.out.count("epoch 1 step") == 20


# ------------------------------------------------------------------------------ a full tmpfs (ENOSPC)

def private_tmpfs_command(mountpoint: Path, size: str, script: str) -> Optional[List[str]]:
    """A command running the shell script with a tmpfs of size mounted at mountpoint in a mount namespace of its
    own (nothing outside sees it; it goes when the script ends); None where this machine allows none."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return None
    # root needs only a mount namespace; other users map themselves to root in a user namespace of their own
    prefix = [unshare, "--mount"] if os.geteuid() == 0 else [unshare, "--mount", "--map-root-user"]
    mountpoint.mkdir(parents=True, exist_ok=True)
    mount = f"mount -t tmpfs -o size={size} tmpfs '{mountpoint}'"
    probe = subprocess.run([*prefix, "sh", "-c", mount], capture_output=True, timeout=60)
    if probe.returncode != 0:
        return None
    return [*prefix, "sh", "-c", f"{mount} && {script}"]


def test_a_write_on_a_full_file_system_keeps_the_previous_file(tmp_path):
    mountpoint = tmp_path / "small"
    writer = ("import os, sys\n"
              "from src.atomic_file import write_text_atomic\n"
              "final = sys.argv[1]\n"
              "write_text_atomic(final, 'epoch\\n1\\n')\n"
              "try:\n"
              "    write_text_atomic(final, 'x' * 2 * 2 ** 20)\n"
              "except Exception as exc:\n"
              "    print(type(exc).__name__, exc)\n"
              "print(sorted(os.listdir(os.path.dirname(final))), repr(open(final).read()))\n")
    command = private_tmpfs_command(mountpoint, "1m", f'exec "{sys.executable}" -c "$0" "$1"')
    if command is None:
        pytest.skip("no private tmpfs here (unshare and mount not permitted)")
    process = subprocess.run([*command, writer, str(mountpoint / "metrics.csv")], cwd=REPO, capture_output=True,
                             text=True, timeout=120, env=script_env())
    assert process.returncode == 0, process.stderr
    error, listing = process.stdout.splitlines()
    assert error.startswith(f"DiskFullError no space left on device writing metrics.csv in {mountpoint} (")
    assert "free there now): free space there and run again" in error
    assert listing == "['metrics.csv'] 'epoch\\n1\\n'"


# ------------------------------------------------------------------------------ train.py

SMALL = ["--model_name", "resnet18", "--batch_size", "8", "--train_num_samples", "32", "--eval_num_samples", "8",
         *FAST_ARGS]
CHECKPOINT_MB = 128  # a ResNet-18 training checkpoint (weights, momentum, state): 134,229,9xx bytes


def final_files(folder: Path) -> List[str]:
    return sorted(p.name for p in folder.iterdir())


@pytest.mark.slow
def test_train_stops_in_one_line_when_a_checkpoint_passes_the_file_size_limit(cifar_dir, tmp_path):
    """Epoch 1 is saved; the resumed run's epoch-2 checkpoint passes ulimit -f (a real limit on the process)."""
    out = tmp_path / "out"
    args = ["--data_path", str(cifar_dir), "--output_path", str(out), *SMALL]
    first = run_script("train.py", args + ["--epoch_size", "1"])
    assert first.returncode == 0, first.stderr[-3000:]
    epoch1 = out / "resnet18-epoch001.ckpt"
    saved = {name: sha256(out / name) for name in final_files(out) if name != "train.log"}
    last = out / "resnet18-last.ckpt"

    limit = (CHECKPOINT_MB - 28) * MB  # well above every other output, below a checkpoint
    process = subprocess.run(
        [sys.executable, str(REPO / "train.py"), *args, "--epoch_size", "2", "--resume", str(last)], cwd=REPO,
        env=script_env(), capture_output=True, text=True, timeout=600,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY)))
    assert_one_line_error(process, f"file too large writing resnet18-epoch002.ckpt in {out} (",
                          "ulimit -f", f"and resume with --resume {last}")
    assert "epoch 2/2 step" in process.stdout  # it trained, then failed on the save
    assert {name: sha256(out / name) for name in saved} == saved  # epoch 1, last, best, metrics, curves untouched
    assert final_files(out) == sorted([*saved, "train.log"]) and temp_files(out) == []
    assert int(read_ckpt_entries(epoch1)["epoch_num"].asnumpy()) == 1  # whole (CRC checked) and resumable


@pytest.mark.slow
def test_train_stops_in_one_line_when_the_disk_fills_during_a_later_checkpoint(cifar_dir, tmp_path):
    """A real full disk: output_path on a tmpfs with room for one checkpoint and a half. Epoch 1 is saved and
    read (through /proc/PID/root, as the mount is private to the run); epoch 2's save fills the disk."""
    mountpoint, state = tmp_path / "small", tmp_path / "state"
    state.mkdir()
    out = mountpoint / "out"
    # The shell stays (keeping the tmpfs) until the test has looked at the folder and says so with state/go.
    script = (f'"{sys.executable}" "{REPO / "train.py"}" "$@" > "{state}/stdout" 2> "{state}/stderr"; '
              f'echo $? > "{state}/rc.tmp" && mv "{state}/rc.tmp" "{state}/rc"; '
              f'while [ ! -e "{state}/go" ]; do sleep 0.1; done')
    command = private_tmpfs_command(mountpoint, f"{CHECKPOINT_MB * 3 // 2}m", script)
    if command is None:
        pytest.skip("no private tmpfs here (unshare and mount not permitted)")
    shell = subprocess.Popen([*command, "sh", "--data_path", str(cifar_dir), "--output_path", str(out), *SMALL,
                              "--epoch_size", "3"], cwd=REPO, env=script_env())
    inside = Path(f"/proc/{shell.pid}/root") / out.relative_to("/")  # the folder as the run sees it
    try:
        deadline = time.monotonic() + 300
        while "epoch 1 done" not in ((state / "stdout").read_text() if (state / "stdout").exists() else ""):
            assert not (state / "rc").exists() and time.monotonic() < deadline, (state / "stdout").read_text()
            time.sleep(0.1)
        epoch1 = sha256(inside / "resnet18-epoch001.ckpt")
        while not (state / "rc").exists():
            assert time.monotonic() < deadline
            time.sleep(0.1)
        process = subprocess.CompletedProcess([], int((state / "rc").read_text()), (state / "stdout").read_text(),
                                              (state / "stderr").read_text())
        last = out / "resnet18-last.ckpt"
        assert_one_line_error(process, f"no space left on device writing resnet18-epoch002.ckpt in {out} (",
                              "free there now): free space there", f"and resume with --resume {last}")
        assert "epoch 2/3 step" in process.stdout
        assert final_files(inside) == ["metrics.csv", "resnet18-best.ckpt", "resnet18-epoch001.ckpt",
                                       "resnet18-last.ckpt", "train.log", "training_curves.png"]
        assert sha256(inside / "resnet18-epoch001.ckpt") == epoch1 == sha256(inside / "resnet18-last.ckpt")
        assert int(read_ckpt_entries(inside / "resnet18-last.ckpt")["epoch_num"].asnumpy()) == 1
        assert (inside / "metrics.csv").read_text().count("\n") == 2  # the header and epoch 1
    finally:
        (state / "go").touch()
        shell.wait(timeout=60)
