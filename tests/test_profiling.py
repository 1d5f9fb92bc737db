"""--enable_profiling: real short training runs with MindSpore's CPU profiler, and its refusals."""
import csv
import json
import logging
from pathlib import Path

import pytest

from conftest import FAST_ARGS, REPO, assert_one_line_error, run_script
from src.errors import UserError
from src.model_utils.config import load_config
from src.profiling import StepProfiler
from src.utils import RunEnv

# ResNet-18 has 20 convolutions; 40 images in batches of 8 give 5 steps: compile, warm-up, 3 recorded.
RUN = ["--model_name", "resnet18", "--batch_size", "8", "--train_num_samples", "40", "--eval_num_samples", "8",
       "--epoch_size", "1", *FAST_ARGS]
CONVS_PER_STEP, BLOCKS_PER_STEP = 20, 8


def metrics(folder: Path):
    with open(folder / "metrics.csv", newline="") as handle:
        return list(csv.DictReader(handle))


@pytest.fixture(scope="module")
def profiled(cifar_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("profiled")
    process = run_script("train.py", ["--data_path", str(cifar_dir), "--output_path", str(out), *RUN,
                                      "--enable_profiling", "true"])
    assert process.returncode == 0, process.stderr[-3000:]
    return out, process


@pytest.mark.slow
def test_profiler_writes_analysed_op_table_and_timeline(profiled):
    out, process = profiled
    runs = list((out / "profiler").glob("rank0_*_ascend_ms"))
    assert len(runs) == 1, list((out / "profiler").iterdir())
    with open(runs[0] / "FRAMEWORK" / "cpu_op_type_info_0.csv", newline="") as handle:
        table = {row["op_type"]: row for row in csv.DictReader(handle)}
    log = (out / "train.log").read_text()
    # Exactly the 3 recorded steps, not the compiling nor the warm-up step. MindSpore's convolutions run one
    # BatchNorm op per convolution; onednn_blocked runs each convolution and its BatchNorm as one Custom op
    # forward and one backward, plus the stem's ReLU and max pool and the reorder out of channel blocks (one op
    # forward and one in the gradient each), each block's residual addition and ReLU (inside its last convolution's
    # forward op; in the gradient, each block's input gets the sum of its two users' gradients and the ReLU's in one
    # op, and the last block's output the ReLU's in one more), and Adam as one Custom op (the native update) instead
    # of MindSpore's. No ReLU is left to MindSpore, nor the sums of the blocks' inputs' gradients (AddN).
    if "convolutions: onednn_blocked" in log:
        assert "BatchNorm" not in table and "BatchNormGrad" not in table and "Adam" not in table
        assert "ReLU" not in table and "ReluGrad" not in table
        assert int(table["Custom"]["type_occurrences"]) == 3 * (2 * CONVS_PER_STEP + 4 + BLOCKS_PER_STEP + 1 + 1)
        assert int(table.get("AddN", {"type_occurrences": 0})["type_occurrences"]) < 3 * BLOCKS_PER_STEP, table
    else:
        assert float(table["Adam"]["total_compute_time"]) > 0
        assert float(table["BatchNormGrad"]["total_compute_time"]) > 0
        assert int(table["BatchNorm"]["type_occurrences"]) == 3 * CONVS_PER_STEP
    assert sum(float(row["percent"]) for row in table.values()) == pytest.approx(1.0, abs=0.01)
    # The convolutions: MindSpore's Conv2D ops, or Custom ops with conv_implementation onednn_blocked.
    conv_types = {"Conv2D", "Conv2DBackpropFilter", "Conv2DBackpropInput", "Custom"} & set(table)
    assert conv_types and sum(float(table[op]["total_compute_time"]) for op in conv_types) > 0
    with open(runs[0] / "FRAMEWORK" / "cpu_op_detail_info_0.csv", newline="") as handle:
        details = list(csv.DictReader(handle))
    assert any("/conv1-" in row["full_op_name"] and row["op_type"] in conv_types for row in details)
    trace = json.loads((runs[0] / "ASCEND_PROFILER_OUTPUT" / "trace_view.json").read_text())
    assert any(event.get("ph") == "X" and "/conv1-" in event.get("name", "") for event in trace)
    assert f"profiler: 3 step(s) of epoch 1 written to {runs[0]}; open FRAMEWORK/cpu_op_type_info_0.csv first" in log
    assert "time per op type: " in log  # the top op types are named
    assert "[ERROR]" not in process.stdout + process.stderr  # MindSpore's profiler logs its failures so
    assert not list((REPO / "data").glob("*_ascend_ms"))  # ... and then falls back to ./data


@pytest.mark.slow
def test_training_goes_on_unchanged_and_without_the_key_nothing_is_profiled(profiled, cifar_dir, tmp_path):
    out, _ = profiled
    assert (out / "resnet18-last.ckpt").is_file() and (out / "resnet18-best.ckpt").is_file()
    plain = run_script("train.py", ["--data_path", str(cifar_dir), "--output_path", str(tmp_path), *RUN])
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert not (tmp_path / "profiler").exists()
    assert "profiler" not in (tmp_path / "train.log").read_text()
    assert (tmp_path / "resnet18-last.ckpt").is_file()
    profiled_rows, plain_rows = metrics(out), metrics(tmp_path)
    assert [row["epoch"] for row in profiled_rows] == ["1"]
    assert float(profiled_rows[0]["train_loss"]) == pytest.approx(float(plain_rows[0]["train_loss"]), rel=1e-4)
    assert profiled_rows[0]["top1"] == plain_rows[0]["top1"]


# ---------------------------------------------------------------- refusals (one error: line, before training)

def check(output_path: Path, steps_per_epoch: int = 5, rank_id: int = 0, enabled: bool = True) -> StepProfiler:
    config = load_config(["--output_path", str(output_path), "--enable_profiling", str(enabled).lower()])
    env = RunEnv(device_target="CPU", rank_id=rank_id, group_size=2 if rank_id else 1)
    return StepProfiler.from_config(config, env, logging.getLogger("test"), steps_per_epoch)


def test_refuses_an_epoch_too_short_to_skip_compilation(tmp_path):
    with pytest.raises(UserError, match="at least 3 training steps per epoch.*this run has 2"):
        check(tmp_path, steps_per_epoch=2)


def test_refuses_characters_mindspore_would_silently_replace_with_its_default_folder(tmp_path):
    with pytest.raises(UserError, match=r"refuses the output folder .*a\+b.*'\+'.*--output_path"):
        check(tmp_path / "a+b")
    assert not (tmp_path / "a+b").exists()


def test_refuses_an_unwritable_profiler_folder(tmp_path):
    (tmp_path / "profiler").write_text("a file where the folder should be")
    with pytest.raises(UserError, match="cannot write the profiler output folder .*profiler"):
        check(tmp_path)


def test_only_rank_0_profiles_and_off_means_nothing_is_created(tmp_path):
    assert check(tmp_path / "rank1", rank_id=1).folder is None
    assert check(tmp_path / "off", steps_per_epoch=1, enabled=False).folder is None
    assert not (tmp_path / "rank1").exists() and not (tmp_path / "off").exists()
    assert check(tmp_path / "rank0").folder == (tmp_path / "rank0" / "profiler").resolve()


@pytest.mark.slow
def test_train_py_refusal_is_one_line_and_trains_nothing(cifar_dir, tmp_path):
    out = tmp_path / "a+b"
    process = run_script("train.py", ["--data_path", str(cifar_dir), "--output_path", str(out), *RUN,
                                      "--enable_profiling"])
    assert_one_line_error(process, "enable_profiling", "'+'", "--output_path")
    assert not list(out.glob("*.ckpt")) and not (out / "profiler").exists()
