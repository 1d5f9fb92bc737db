"""End to end through train.py and eval.py on generated data at 32x32: outputs, resume, signals, refusals."""
import importlib.metadata
import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import (FAST_ARGS, REPO, assert_one_line_error, max_difference, read_metrics, run_script, script_env,
                      start_training, temp_files, wait_for_line)
from src.metrics_file import COLUMNS

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def no_partial_files(folder: Path) -> bool:
    return temp_files(folder) == []


# ---------------------------------------------------------------- train -> checkpoint -> eval (ResNet-50)

@pytest.fixture(scope="module")
def resnet50_run(cifar_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("r50")
    process = run_script("train.py", ["--data_path", str(cifar_dir), "--output_path", str(out), "--epoch_size", "2",
                                      "--batch_size", "8", "--train_num_samples", "32", "--eval_num_samples", "24",
                                      "--keep_checkpoint_max", "1", *FAST_ARGS])
    assert process.returncode == 0, process.stderr[-3000:]
    return out, process


@pytest.mark.slow
def test_training_writes_checkpoints_metrics_curves_and_log(resnet50_run):
    out, process = resnet50_run
    assert (out / "resnet50-epoch002.ckpt").is_file()
    assert not (out / "resnet50-epoch001.ckpt").exists()  # keep_checkpoint_max 1
    assert (out / "resnet50-last.ckpt").is_file() and (out / "resnet50-best.ckpt").is_file()
    assert (out / "training_curves.png").read_bytes()[:8] == PNG_MAGIC
    fields, rows = read_metrics(out)
    assert tuple(fields) == COLUMNS
    assert [row["epoch"] for row in rows] == ["1", "2"]
    for row in rows:
        assert 0 <= float(row["top1"]) <= float(row["top5"]) <= 1
        assert float(row["train_loss"]) > 0 and float(row["images_per_second"]) > 0
        assert float(row["lr"]) == pytest.approx(0.001)
    log = (out / "train.log").read_text()
    assert "epoch 1/2 step 4/4 loss" in log and "images/s" in log
    assert "SYNTHETIC" in process.stdout  # generated data is labelled as such
    assert "amp_level auto: O0 on CPU" in process.stdout and "amp_level O0 (float32)" in process.stdout
    assert no_partial_files(out)


@pytest.mark.slow
def test_the_terminal_shows_the_projects_own_lines_only(resnet50_run):
    """MindSpore's C++ warnings stay out unless GLOG_v asks."""
    _, process = resnet50_run
    log_line = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d ")
    assert [line for line in process.stdout.splitlines() if not log_line.match(line)] == []
    assert process.stderr.strip() == ""


@pytest.mark.slow
def test_a_training_step_compiles_without_mindspores_side_effect_warnings(uninterrupted_run):
    """With MindSpore's warnings shown (GLOG_v=2, its own default), compiling the training step on the native
    convolutions prints none of the 'Some side effect nodes were eliminated by mistake' lines that a conv+BatchNorm
    call's unused outputs gave (80 for ResNet-18's step): a user who turns warnings on sees MindSpore's real ones."""
    _, process = uninterrupted_run
    assert "conv_implementation auto: using onednn_blocked" in process.stdout
    assert "[WARNING]" in process.stderr  # the level took: MindSpore's other warnings are there
    assert "eliminated by mistake" not in process.stderr, process.stderr[-3000:]


def test_a_glog_level_the_user_sets_is_kept():
    show = "import os, src; print(os.environ['GLOG_v'])"
    for env, expected in ((None, "3"), ({"GLOG_v": "1"}, "1")):
        process = subprocess.run([sys.executable, "-c", show], cwd=REPO, env=script_env(env), capture_output=True,
                                 text=True, timeout=60)
        assert process.stdout.strip() == expected, process.stderr


def test_src_keeps_triton_out_of_mindspore_and_torch_runs_without_it():
    """MindSpore imports triton wherever it is installed (torch installs it); importing src first keeps it out
    (src/__init__.py), and torch, imported after, still runs. A program that imported triton first keeps it."""
    try:
        importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("triton is not installed: nothing to keep out")
    checks = {"import sys, src, mindspore, torch; print(sys.modules['triton'] is None, int(torch.ones(3).sum()))":
              "True 3",
              "import sys, triton, src, mindspore; print(sys.modules['triton'] is None)": "False"}
    for code, expected in checks.items():
        process = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=script_env(), capture_output=True,
                                 text=True, timeout=120)
        assert process.stdout.strip() == expected, process.stderr[-3000:]


def test_the_training_modules_leave_matplotlib_unimported():
    """matplotlib holds about 25 MB of a process: the training loop and benchmark.py's step import it only when a
    figure is drawn (src.plotting)."""
    code = ("import sys, src.trainer, src.benchmark, src.evaluation; print('matplotlib' in sys.modules); "
            "import src.plotting; print('matplotlib' in sys.modules)")
    process = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=script_env(), capture_output=True, text=True,
                             timeout=120)
    assert process.stdout.split() == ["False", "True"], process.stderr[-3000:]


@pytest.mark.slow
def test_eval_reproduces_the_training_evaluation(resnet50_run, cifar_dir, tmp_path):
    out, _ = resnet50_run
    _, rows = read_metrics(out)
    best = max(rows, key=lambda row: float(row["top1"]))
    process = run_script("eval.py", ["--data_path", str(cifar_dir), "--output_path", str(tmp_path),
                                     "--checkpoint_path", str(out / "resnet50-best.ckpt"), "--eval_num_samples", "24",
                                     "--save_confusion_matrix", "true", *FAST_ARGS])
    assert process.returncode == 0, process.stderr[-3000:]
    printed = json.loads(process.stdout.strip().splitlines()[-1])
    assert printed == json.loads((tmp_path / "eval_result.json").read_text())
    for key in ("top1", "top5", "loss", "num_samples", "checkpoint", "per_class_accuracy"):
        assert key in printed
    assert printed["num_samples"] == 24 and printed["synthetic_data"] is True
    assert printed["top1"] == pytest.approx(float(best["top1"]), abs=1e-5)
    assert printed["loss"] == pytest.approx(float(best["eval_loss"]), rel=1e-4)
    assert len(printed["per_class_accuracy"]) == 10 and "airplane" in printed["per_class_accuracy"]
    assert sum(map(sum, printed["confusion_matrix"])) == 24
    assert (tmp_path / "confusion_matrix.png").read_bytes()[:8] == PNG_MAGIC


@pytest.mark.slow
def test_eval_refuses_a_head_mismatch(resnet50_run, cifar_dir, tmp_path):
    out, _ = resnet50_run
    process = run_script("eval.py", ["--data_path", str(cifar_dir), "--output_path", str(tmp_path), "--class_num",
                                     "5", "--checkpoint_path", str(out / "resnet50-last.ckpt"), *FAST_ARGS])
    assert_one_line_error(process, "resnet50-last.ckpt", "10-class head", "--class_num 10")
    assert not (tmp_path / "eval_result.json").exists()


def test_eval_refuses_another_architecture(cifar_dir, tmp_path):
    import mindspore as ms
    from src.resnet import build_resnet
    foreign = tmp_path / "r18.ckpt"
    ms.save_checkpoint(build_resnet("resnet18", 10), str(foreign))
    process = run_script("eval.py", ["--data_path", str(cifar_dir), "--output_path", str(tmp_path),
                                     "--checkpoint_path", str(foreign), *FAST_ARGS])
    assert_one_line_error(process, "r18.ckpt", "resnet18", "--model_name resnet18")
    assert not (tmp_path / "eval_result.json").exists()


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty", "missing"])
@pytest.mark.slow
def test_eval_refuses_a_damaged_checkpoint(resnet50_run, cifar_dir, tmp_path, damage):
    out, _ = resnet50_run
    target = tmp_path / "damaged.ckpt"
    data = bytearray((out / "resnet50-last.ckpt").read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0xFF
    elif damage == "truncate":
        data = data[: len(data) // 3]
    elif damage == "empty":
        data = bytearray()
    if damage != "missing":
        target.write_bytes(bytes(data))
    process = run_script("eval.py", ["--data_path", str(cifar_dir), "--output_path", str(tmp_path),
                                     "--checkpoint_path", str(target), *FAST_ARGS])
    assert_one_line_error(process, str(target))
    assert not (tmp_path / "eval_result.json").exists()


# ---------------------------------------------------------------- resume and signals (ResNet-18)

SMALL = ["--model_name", "resnet18", "--batch_size", "8", "--train_num_samples", "96", "--eval_num_samples", "16",
         "--epoch_size", "2", *FAST_ARGS]


@pytest.fixture(scope="module")
def uninterrupted_run(cifar_dir, tmp_path_factory):
    """(output folder, finished process) of the reference run, with MindSpore's warnings shown (GLOG_v=2): the
    side-effect warnings test reads its stderr (the level changes what is logged, not what is computed)."""
    out = tmp_path_factory.mktemp("straight")
    process = run_script("train.py", ["--data_path", str(cifar_dir), "--output_path", str(out), *SMALL],
                         env={"GLOG_v": "2"})
    assert process.returncode == 0, process.stderr[-3000:]
    return out, process


@pytest.fixture(scope="module")
def uninterrupted(uninterrupted_run):
    return uninterrupted_run[0]


@pytest.mark.slow
def test_resume_at_an_epoch_boundary_matches_an_uninterrupted_run(uninterrupted, cifar_dir, tmp_path):
    base = ["--data_path", str(cifar_dir), "--output_path", str(tmp_path), *SMALL]
    first = run_script("train.py", base + ["--epoch_size", "1"])
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = run_script("train.py", base + ["--resume", str(tmp_path / "resnet18-last.ckpt")])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout
    assert max_difference(uninterrupted / "resnet18-last.ckpt", tmp_path / "resnet18-last.ckpt") <= 1e-5
    assert read_metrics(tmp_path)[1] == read_metrics(uninterrupted)[1] or [
        {k: r[k] for k in ("epoch", "train_loss", "top1")} for r in read_metrics(tmp_path)[1]] == [
        {k: r[k] for k in ("epoch", "train_loss", "top1")} for r in read_metrics(uninterrupted)[1]]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
@pytest.mark.slow
def test_signal_saves_a_resumable_checkpoint_mid_epoch(uninterrupted, cifar_dir, tmp_path, signum):
    args = ["--data_path", str(cifar_dir), "--output_path", str(tmp_path), *SMALL]
    log_path = tmp_path / "run.log"
    process = start_training(args, log_path)
    wait_for_line(log_path, "epoch 1/2 step 5/12", process)
    process.send_signal(signum)
    code = process.wait(timeout=120)
    # MindSpore's graph runtime re-raises a SIGINT that lands inside a step as SIGTERM (README: Resuming).
    allowed = {128 + signal.SIGTERM} | ({128 + signal.SIGINT} if signum == signal.SIGINT else set())
    assert code in allowed, code
    interrupted = tmp_path / "resnet18-interrupted.ckpt"
    assert interrupted.is_file() and no_partial_files(tmp_path)
    assert f"stopped by {signal.Signals(code - 128).name}" in log_path.read_text()
    resumed = run_script("train.py", args + ["--resume", str(interrupted)])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert max_difference(uninterrupted / "resnet18-last.ckpt", tmp_path / "resnet18-last.ckpt") <= 1e-5
    rows = [{k: r[k] for k in ("epoch", "train_loss", "top1")} for r in read_metrics(tmp_path)[1]]
    assert rows == [{k: r[k] for k in ("epoch", "train_loss", "top1")} for r in read_metrics(uninterrupted)[1]]


@pytest.mark.slow
def test_resume_refuses_a_weights_only_checkpoint(cifar_dir, tmp_path):
    import mindspore as ms
    from src.resnet import build_resnet
    weights = tmp_path / "weights.ckpt"
    ms.save_checkpoint(build_resnet("resnet18", 10), str(weights))
    process = run_script("train.py", ["--data_path", str(cifar_dir), "--output_path", str(tmp_path / "out"),
                                      "--resume", str(weights), *SMALL])
    assert_one_line_error(process, "weights.ckpt", "no training state")
    assert not list((tmp_path / "out").glob("*.ckpt"))


@pytest.mark.slow
def test_resume_refuses_a_different_step_count(uninterrupted, cifar_dir, tmp_path):
    process = run_script("train.py", ["--data_path", str(cifar_dir), "--output_path", str(tmp_path),
                                      "--resume", str(uninterrupted / "resnet18-epoch001.ckpt"), *SMALL,
                                      "--batch_size", "16"])
    assert_one_line_error(process, "12 steps per epoch", "this run has 6")


# ---------------------------------------------------------------- data refusals and the quickstart

@pytest.mark.slow
def test_missing_data_without_download_is_one_line_and_writes_nothing(tmp_path):
    process = run_script("train.py", ["--data_path", str(tmp_path / "absent"), "--download", "false",
                                      "--output_path", str(tmp_path / "out"), *SMALL])
    assert_one_line_error(process, str(tmp_path / "absent"), "does not exist", "cifar-10-batches-bin")
    assert not list((tmp_path / "out").glob("*.ckpt")) and not (tmp_path / "out" / "metrics.csv").exists()


@pytest.mark.slow
def test_truncated_training_file_is_one_line(cifar_dir, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    for item in cifar_dir.iterdir():
        (broken / item.name).symlink_to(item)
    (broken / "data_batch_3.bin").unlink()
    (broken / "data_batch_3.bin").write_bytes((cifar_dir / "data_batch_3.bin").read_bytes()[:5000])
    process = run_script("train.py", ["--data_path", str(broken), "--output_path", str(tmp_path / "out"), *SMALL])
    assert_one_line_error(process, "data_batch_3.bin is truncated")


@pytest.mark.slow
def test_quickstart_config_trains_on_generated_data(tmp_path):
    data = tmp_path / "synthetic"
    process = run_script("train.py", ["--config_path", str(REPO / "configs" / "quickstart.yaml"), "--data_path",
                                      str(data), "--output_path", str(tmp_path / "out"), "--epoch_size", "1",
                                      "--train_num_samples", "64", "--eval_num_samples", "64",
                                      "--model_name", "resnet18"])
    assert process.returncode == 0, process.stderr[-3000:]
    assert (data / "SYNTHETIC_DATA.txt").is_file() and (data / "data_batch_5.bin").is_file()
    assert "SYNTHETIC data" in process.stdout
    assert (tmp_path / "out" / "resnet18-best.ckpt").is_file()
