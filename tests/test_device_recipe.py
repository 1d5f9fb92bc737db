"""The device recipe, run on CPU through train.py: mixed precision (O2, O3), loss scaling (fixed, dynamic), the
data sink's windows, checkpoints every N steps and a kill -9 in mid-epoch."""
import json
import re
import signal
import sys
from pathlib import Path
from typing import Optional

import numpy as np
import pytest

from conftest import (FAST_ARGS, assert_one_line_error, final_digest, one_line_user_error, read_ckpt_entries,
                      read_metrics, run_script, sigterm_training, start_training, temp_files, wait_for_line)
from src.errors import UserError
from src.model_utils.config import load_config
from src.onednn_conv import resolve_conv_implementation
from src.training_checkpoints import CheckpointWriter

STEPS = 12  # per epoch: 96 images in batches of 8
RECIPE = ["--model_name", "resnet18", "--batch_size", "8", "--train_num_samples", "96", "--eval_num_samples", "32",
          "--epoch_size", "2", *FAST_ARGS]
STEP_LINE = re.compile(r"epoch (\d+)/\d+ step (\d+)/\d+ loss")



def logged_steps(log: str):
    """(epoch, step) of every loss line, in order."""
    return [(int(epoch), int(step)) for epoch, step in STEP_LINE.findall(log)]


def train(cifar_dir: Path, out: Path, *extra: str, cwd: Optional[Path] = None):
    process = run_script("train.py", ["--data_path", str(cifar_dir), "--output_path", str(out), *RECIPE, *extra],
                         cwd=cwd)
    assert process.returncode == 0, (process.stdout[-3000:], process.stderr[-3000:])
    return process


@pytest.fixture(scope="module")
def straight(cifar_dir, tmp_path_factory):
    """(output folder, final weights digest) of the float32 run, batches fed from Python, never interrupted."""
    out = tmp_path_factory.mktemp("straight")
    return out, final_digest(train(cifar_dir, out).stdout)


# ---------------------------------------------------------------- mixed precision and loss scaling

@pytest.mark.slow
@pytest.mark.parametrize("level", ["O2", "O3"])
def test_amp_level_trains_on_cpu_and_its_checkpoint_evaluates_in_float32(level, cifar_dir, tmp_path):
    process = train(cifar_dir, tmp_path, "--amp_level", level)
    assert f"amp_level {level} on CPU: runs as asked, but float16 brings no speed there" in process.stdout
    assert f"amp_level {level}, fixed loss scale 1024" in process.stdout
    assert "conv_implementation auto: using mindspore (amp_level" in process.stdout
    _, rows = read_metrics(tmp_path)
    assert [row["skipped_steps"] for row in rows] == ["0", "0"]
    assert float(rows[1]["train_loss"]) < float(rows[0]["train_loss"])  # it learns
    entries = read_ckpt_entries(tmp_path / "resnet18-last.ckpt")
    assert entries["conv1.weight"].asnumpy().dtype == np.float32  # master weights stay float32
    assert float(entries["scale_sense"].asnumpy()) == 1024.0
    evaluated = run_script("eval.py", ["--data_path", str(cifar_dir), "--output_path", str(tmp_path / "eval"),
                                       "--checkpoint_path", str(tmp_path / "resnet18-last.ckpt"),
                                       "--model_name", "resnet18", "--eval_num_samples", "32", *FAST_ARGS])
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    result = json.loads((tmp_path / "eval" / "eval_result.json").read_text())
    # eval.py runs float32; the in-training evaluation saw the same weights.
    assert result["top1"] == pytest.approx(float(rows[1]["top1"]), abs=1 / 32 + 1e-9)


@pytest.mark.slow
def test_a_fixed_loss_scale_that_overflows_stops_the_run_in_one_line(cifar_dir, tmp_path):
    process = run_script("train.py", ["--data_path", str(cifar_dir), "--output_path", str(tmp_path), *RECIPE,
                                      "--amp_level", "O2", "--loss_scale", "1e30"])
    assert_one_line_error(process, "loss scale 1e+30 overflowed", "epoch 1 step 1", "--loss_scale_type dynamic")
    assert not list(tmp_path.glob("*.ckpt")) and temp_files(tmp_path) == []


@pytest.mark.slow
def test_a_dynamic_loss_scale_skips_overflowing_steps_and_counts_them(cifar_dir, tmp_path):
    start = 2.0 ** 24  # far above float16's range for these gradients (MindSpore's DynamicLossScaleManager default)
    process = train(cifar_dir, tmp_path, "--amp_level", "O2", "--loss_scale_type", "dynamic",
                    "--loss_scale", str(start), "--epoch_size", "1", "--train_num_samples", "160")
    _, rows = read_metrics(tmp_path)
    skipped = int(rows[0]["skipped_steps"])
    assert 1 <= skipped < 20 and np.isfinite(float(rows[0]["train_loss"]))
    assert f"{skipped} step(s) skipped for loss-scale overflow" in process.stdout
    scales = [float(found) for found in re.findall(r"loss scale ([0-9.e+]+)", process.stdout.split("training ")[-1])]
    assert scales[-1] <= start / 2 ** skipped * 2  # halved per skipped step (doubling only after 2000 good ones)
    saved = float(read_ckpt_entries(tmp_path / "resnet18-last.ckpt")["scale_sense"].asnumpy())
    assert saved == scales[-1] and saved == start / 2 ** skipped  # the checkpoint resumes with the lowered scale


@pytest.mark.slow
def test_a_float32_checkpoint_resumes_with_loss_scaling_from_the_configured_scale(straight, cifar_dir, tmp_path):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    process = train(cifar_dir, tmp_path, "--amp_level", "O1", "--loss_scale_type", "dynamic", "--loss_scale", "512",
                    "--resume", str(straight[0] / "resnet18-epoch001.ckpt"), cwd=cwd)
    # MindSpore's O1 rewrite writes ./rewritten_network/ and imports it: that happens in a private folder.
    assert list(cwd.iterdir()) == []
    assert "has no loss-scale state: starting it from --loss_scale 512" in process.stdout
    assert "resumed from" in process.stdout and "amp_level O1, dynamic loss scale 512" in process.stdout
    assert [row["epoch"] for row in read_metrics(tmp_path)[1]] == ["2"]
    assert float(read_ckpt_entries(tmp_path / "resnet18-last.ckpt")["scale_sense"].asnumpy()) == 512.0


@pytest.mark.parametrize("level, folders", [("O0", 0), ("O1", 1)])
def test_only_mixed_precision_makes_a_folder_for_mindspores_rewrite(level, folders, monkeypatch):
    """The private folder for MindSpore's rewritten network is made where a level rewrites it, not for float32:
    a run killed before its exit handlers ran would leave it in the temporary folder. sys.path comes back as it
    was: the rewrite had put src/ first, where `import benchmark` found src/benchmark.py."""
    import mindspore as ms
    from src import train_step
    from src.resnet import build_resnet
    made = []
    monkeypatch.setattr(train_step, "_REWRITE_HOME", made)
    net = build_resnet("resnet18", 10, conv_implementation="mindspore")
    level_setting = train_step.AmpSetting(level, None if level == "O0" else 1024.0)
    path_before = list(sys.path)
    train_step.build_train_step(net, ms.nn.SGD(net.trainable_params(), 0.01), load_config([]), level_setting)
    assert len(made) == folders
    assert sys.path == path_before


def test_blocked_convolutions_refuse_float16_and_auto_falls_back():
    with pytest.raises(UserError) as excinfo:
        resolve_conv_implementation("onednn_blocked", "CPU", "O2")
    one_line_user_error(excinfo, "onednn_blocked", "amp_level O2", "--amp_level O0")
    assert resolve_conv_implementation("auto", "CPU", "O3")[0] == "mindspore"


# ---------------------------------------------------------------- the data sink

@pytest.mark.slow
def test_a_sunk_run_reads_the_loss_once_per_sink_and_ends_with_the_unsunk_weights(straight, cifar_dir, tmp_path):
    straight_out, straight_digest = straight
    process = train(cifar_dir, tmp_path, "--dataset_sink_mode", "--sink_size", "5")
    assert "dataset_sink_mode on CPU: sinks of 5 steps" in process.stdout
    # log_interval 1, yet one loss line per sink: the loss is read at the sinks' ends only.
    assert logged_steps(process.stdout) == [(epoch, step) for epoch in (1, 2) for step in (5, 10, STEPS)]
    assert final_digest(process.stdout) == straight_digest
    for sunk, fed in zip(read_metrics(tmp_path)[1], read_metrics(straight_out)[1]):
        assert float(sunk["train_loss"]) == pytest.approx(float(fed["train_loss"]), rel=1e-5)
        assert sunk["top1"] == fed["top1"]


@pytest.mark.slow
def test_a_sunk_run_stopped_by_a_signal_resumes_from_a_sink_boundary_to_the_same_weights(straight, cifar_dir,
                                                                                          tmp_path):
    args = ["--data_path", str(cifar_dir), "--output_path", str(tmp_path), *RECIPE, "--dataset_sink_mode",
            "--sink_size", "4"]
    log_path = tmp_path / "run.log"
    sigterm_training(args, log_path, "epoch 1/2 step 4/12")
    interrupted = tmp_path / "resnet18-interrupted.ckpt"
    entries = read_ckpt_entries(interrupted)
    assert int(entries["step_in_epoch"].asnumpy()) % 4 == 0  # stopped where a sink ended
    resumed = train(cifar_dir, tmp_path, "--dataset_sink_mode", "--sink_size", "4", "--resume", str(interrupted))
    assert final_digest(resumed.stdout) == straight[1]


# ---------------------------------------------------------------- checkpoints every N steps

def test_step_and_epoch_checkpoints_rotate_oldest_first(tmp_path):
    writer = CheckpointWriter(str(tmp_path), load_config(["--model_name", "resnet18", "--keep_checkpoint_max", "3"]),
                              12)
    names = ["resnet18-epoch001-step00005.ckpt", "resnet18-epoch001-step00010.ckpt", "resnet18-epoch001.ckpt",
             "resnet18-epoch002-step00003.ckpt", "resnet18-epoch010-step00001.ckpt", "resnet18-epoch010.ckpt"]
    for name in reversed(names):
        (tmp_path / name).touch()
    for other in ("resnet18-last.ckpt", "resnet18-best.ckpt", "resnet50-epoch001.ckpt", "resnet18-epoch1.ckpt"):
        (tmp_path / other).touch()
    assert [path.name for path in writer.rotated_files()] == names


@pytest.mark.slow
def test_kill_9_in_mid_epoch_loses_at_most_save_checkpoint_steps_and_resumes_to_the_same_weights(straight, cifar_dir,
                                                                                                 tmp_path):
    every = 5
    args = ["--data_path", str(cifar_dir), "--output_path", str(tmp_path), *RECIPE, "--save_checkpoint_steps",
            str(every), "--keep_checkpoint_max", "2"]
    log_path = tmp_path / "run.log"
    process = start_training(args, log_path)
    # Killed just after the step checkpoint at global step 15 (epoch 2 step 3), before the next at step 20.
    wait_for_line(log_path, "saved " + str(tmp_path / "resnet18-epoch002-step00003.ckpt"), process)
    process.kill()
    assert process.wait(timeout=60) == -signal.SIGKILL
    reached = max((epoch - 1) * STEPS + step for epoch, step in logged_steps(log_path.read_text()))
    assert temp_files(tmp_path) == []
    last = read_ckpt_entries(tmp_path / "resnet18-last.ckpt")
    saved = int(last["epoch_num"].asnumpy()) * STEPS + int(last["step_in_epoch"].asnumpy())
    assert saved == 15 and 0 <= reached - saved <= every, (saved, reached)
    # keep_checkpoint_max 2 counts epoch and step checkpoints together.
    assert sorted(path.name for path in tmp_path.glob("resnet18-epoch*.ckpt")) == [
        "resnet18-epoch001.ckpt", "resnet18-epoch002-step00003.ckpt"]
    resumed = train(cifar_dir, tmp_path, "--save_checkpoint_steps", str(every), "--resume",
                    str(tmp_path / "resnet18-last.ckpt"))
    assert "resumed from" in resumed.stdout and "at epoch 2 step 3" in resumed.stdout
    assert final_digest(resumed.stdout) == straight[1]
    keep = ("epoch", "train_loss", "top1")
    assert [{k: row[k] for k in keep} for row in read_metrics(tmp_path)[1]] == \
        [{k: row[k] for k in keep} for row in read_metrics(straight[0])[1]]
