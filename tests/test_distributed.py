"""train.py under msrun with 2 real CPU workers: data-parallel set-up, rank-0-only outputs, and an
evaluation that equals a single-process eval.py of the checkpoint."""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import FAST_ARGS, REPO, run_script

MSRUN = Path(sys.executable).with_name("msrun")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def eval_lines(log: Path):
    return [line.split("eval: ", 1)[1] for line in log.read_text().splitlines() if " eval: " in line]


@pytest.mark.skipif(not MSRUN.exists(), reason="msrun is installed with MindSpore")
def test_two_worker_training_matches_single_process_eval(cifar_dir, tmp_path):
    out, logs = tmp_path / "out", tmp_path / "msrun"
    args = ["--data_path", str(cifar_dir), "--output_path", str(out), "--model_name", "resnet18", "--batch_size", "8",
            "--train_num_samples", "64", "--eval_num_samples", "30", "--epoch_size", "2", *FAST_ARGS]
    # msrun starts workers with the bare word `python`: put this interpreter first on PATH.
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    process = subprocess.run([str(MSRUN), "--worker_num=2", "--local_worker_num=2", f"--master_port={free_port()}",
                              f"--log_dir={logs}", "--join=True", str(REPO / "train.py"), *args],
                             cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert process.returncode == 0, process.stdout[-3000:] + process.stderr[-3000:]
    worker0, worker1 = logs / "worker_0.log", logs / "worker_1.log"
    assert "data-parallel training: rank 0 of 2" in worker0.read_text()
    assert "rank 1 of 2" in worker1.read_text()
    assert "4 steps, batch 8 x 2 device(s)" in worker0.read_text()  # 64 images shared by 2 ranks
    # Evaluation sums over ranks: both report the same numbers over all 30 images.
    assert eval_lines(worker0) and [line.rsplit(" (", 1)[0] for line in eval_lines(worker0)] == [
        line.rsplit(" (", 1)[0] for line in eval_lines(worker1)]
    assert "on 30 images" in eval_lines(worker0)[-1]
    # Only rank 0 writes; the scheduler process writes nothing either.
    assert sorted(p.name for p in out.glob("*.ckpt")) == ["resnet18-best.ckpt", "resnet18-epoch001.ckpt",
                                                          "resnet18-epoch002.ckpt", "resnet18-last.ckpt"]
    assert "[rank 1]" not in (out / "train.log").read_text()
    assert "[scheduler]" not in (out / "train.log").read_text()
    # BatchNorm statistics are averaged over ranks, so the checkpoint evaluates as the job did.
    single = run_script("eval.py", ["--data_path", str(cifar_dir), "--output_path", str(tmp_path / "eval"),
                                    "--checkpoint_path", str(out / "resnet18-last.ckpt"), "--model_name", "resnet18",
                                    "--eval_num_samples", "30", *FAST_ARGS])
    assert single.returncode == 0, single.stderr[-3000:]
    result = json.loads(single.stdout.strip().splitlines()[-1])
    last_row = (out / "metrics.csv").read_text().strip().splitlines()[-1].split(",")
    assert result["top1"] == pytest.approx(float(last_row[4]), abs=1e-6)
    assert result["loss"] == pytest.approx(float(last_row[3]), rel=1e-4)
