"""benchmark.py: the FLOP count of the network, the GEMM rate, the FLOP-rate columns and the one-line errors.

Kept cheap (the suite is near its time budget): one end-to-end run with tiny settings, the rest in-process.
"""
import importlib.util
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from conftest import REPO, assert_one_line_error, run_script
from src.benchmark import (FLOP_CONVENTION, GemmMeasurement, Measurement, TrainPyRun, WorkerRun, flops_per_image,
                           forward_macs, gemm_rates, measure_gemm_here, measure_in_subprocess, measure_side_by_side,
                           table, to_json)

TORCH_USABLE = all(importlib.util.find_spec(name) for name in ("torch", "torchvision"))


def analytic_macs(model_name: str, size: int, num_classes: int) -> int:
    """Conv + fc multiply-adds of torchvision's ResNet worked out from the architecture on paper, without the
    network: stem 7x7/2 conv, 3x3/2 max pool, four stages (stride on the 3x3 conv), projection shortcuts."""
    bottleneck, layers = {"resnet18": (False, [2, 2, 2, 2]), "resnet50": (True, [3, 4, 6, 3])}[model_name]
    expansion = 4 if bottleneck else 1

    def out(h: int, kernel: int, stride: int, pad: int) -> int:
        return (h + 2 * pad - kernel) // stride + 1

    h = out(size, 7, 2, 3)
    macs = h * h * 64 * 3 * 7 * 7
    h = out(h, 3, 2, 1)
    inplanes = 64
    for stage, (planes, blocks) in enumerate(zip([64, 128, 256, 512], layers)):
        for block in range(blocks):
            stride = 2 if stage > 0 and block == 0 else 1
            h_out = out(h, 3, stride, 1)
            if bottleneck:
                macs += h * h * inplanes * planes + h_out ** 2 * planes * planes * 9 + h_out ** 2 * planes * planes * 4
            else:
                macs += h_out ** 2 * inplanes * planes * 9 + h_out ** 2 * planes * planes * 9
            if stride != 1 or inplanes != planes * expansion:
                macs += h_out ** 2 * inplanes * planes * expansion
            inplanes, h = planes * expansion, h_out
    return macs + inplanes * num_classes


@pytest.mark.slow
def test_resnet50_at_224_counts_torchvisions_4_09_gmacs():
    macs = forward_macs("resnet50", 224, 1000)
    assert macs == analytic_macs("resnet50", 224, 1000) == 4_089_184_256
    assert round(macs / 1e9, 2) == 4.09  # torchvision's documented "4.09 GFLOPS" (multiply-adds)


@pytest.mark.parametrize("model_name, size", [pytest.param("resnet50", 32, marks=pytest.mark.slow), ("resnet18", 64)])
def test_count_follows_the_input_size_and_block_type(model_name, size):
    macs = forward_macs(model_name, size, 10)
    assert macs == analytic_macs(model_name, size, 10)
    if model_name == "resnet50":  # about 1/49 of the 224 count; the 7x7 stem and the edges differ
        assert 45 < analytic_macs("resnet50", 224, 10) / macs < 49


def test_training_counts_three_forward_passes():
    assert flops_per_image(1000, "eval") == 2000
    assert flops_per_image(1000, "train") == 6000


@pytest.mark.parametrize("backend", ["numpy", "mindspore"])
def test_gemm_measurement_times_each_product(backend):
    gemm = measure_gemm_here(backend, 128, 2, warmup=1, repeats=3)
    assert (gemm.backend, gemm.n, len(gemm.seconds)) == (backend, 128, 3)
    assert all(s > 0 for s in gemm.seconds)
    assert 0 < gemm.gflops_per_second < 1e5 and math.isfinite(gemm.gflops_per_second)
    if backend == "mindspore":  # the same oneDNN setting as the MindSpore model workers
        assert gemm.onednn_max_cpu_isa == os.environ["ONEDNN_MAX_CPU_ISA"]  # conftest sets AVX2 unless set


def test_gemm_measurement_refuses_an_unknown_backend():
    with pytest.raises(ValueError, match="unknown GEMM backend"):
        measure_gemm_here("blas", 8, 1, warmup=0, repeats=1)


def test_rates_pool_phases_and_percentages_use_the_fastest_backend():
    n = 1000  # 2e9 flops a product
    gemms = [GemmMeasurement("numpy", n, 2, None, [1.0, 1.0], "before"),
             GemmMeasurement("mindspore", n, 2, "AVX2", [4.0, 4.0], "before"),
             GemmMeasurement("numpy", n, 2, None, [4.0], "after")]
    assert gemm_rates(gemms) == {"numpy": 2.0, "mindspore": 0.5}  # median of [1, 1, 4] s, of [4, 4] s
    # 10 images/s x 0.1 GFLOP = 1 GFLOP/s: 50 % of numpy's 2 GFLOP/s
    ours = Measurement("mindspore", "eval", 32, 10, 2, [1.0, 1.0, 9.0], flops_per_image=100_000_000)
    theirs = Measurement("torch", "eval", 32, 10, 2, [0.5], flops_per_image=100_000_000)
    text = table([ours, theirs], gemms, "resnet50")
    assert "| eval | 32x32 | 10 | 2 | 10.0 | 20.0 | 0.50x | 0.100 | 1.0 | 50.0 |" in text
    assert FLOP_CONVENTION in text
    # The ceiling: the run's peak is PyTorch's 2 GFLOP/s (equal to numpy's best product), so nothing in fp32 could be
    # more than 1.00x of it; against 4 GFLOP/s (a 0.5 s product) it would be 2.00x.
    assert "fastest fp32 rate seen in this run, 2.0 GFLOP/s" in text
    assert "| eval | 32x32 | 10 | 50.0 | 100.0 | 1.00x | - | - |\n\nGEMM: fp32" in text  # a blank line ends the table
    faster = table([ours, theirs], gemms + [GemmMeasurement("numpy", n, 2, None, [0.5, 4.0], "after")], "resnet50")
    assert "| eval | 32x32 | 10 | 25.0 | 50.0 | 2.00x | - | - |" in faster
    assert "numpy 2.0 (before 2.0, after 0.5), mindspore 0.5 (before 0.5, ONEDNN_MAX_CPU_ISA=AVX2)" in text
    result = to_json([ours, theirs], {}, gemms, {32: 50_000_000})
    assert result["gemm"]["reference_gflops_per_second"] == 2.0 and result["gemm"]["reference_backend"] == "numpy"
    assert [m["percent_of_gemm"] for m in result["measurements"]] == [50.0, 100.0]


@pytest.mark.slow
def test_end_to_end_run_writes_flop_rates_and_gemm_rates(tmp_path):
    output = tmp_path / "bench.json"
    process = run_script("benchmark.py", ["--sizes", "32", "--modes", "eval", "--model_name", "resnet18",
                                          "--batch_size", "4", "--repeats", "1", "--rounds", "2", "--warmup", "1",
                                          "--steps", "1",
                                          "--gemm_size", "256", "--output", str(output)], timeout=300)
    assert process.returncode == 0, process.stderr[-3000:]
    assert "| GFLOP/image | MindSpore GFLOP/s | MindSpore % of GEMM |" in process.stdout
    assert "GEMM: fp32 256x256" in process.stdout
    result = json.loads(output.read_text())
    macs = result["flops"]["forward_macs_per_image"]["32"]
    assert macs == analytic_macs("resnet18", 32, 10)
    backends = ["mindspore", "numpy"] + (["torch"] if TORCH_USABLE else [])
    gemm = result["gemm"]
    assert [(g["backend"], g["phase"]) for g in gemm["measurements"]] == (
        [(b, "before") for b in backends] + [(b, "after") for b in backends])
    assert all(g["gflops_per_second"] > 0 and g["n"] == 256 for g in gemm["measurements"])
    assert gemm["reference_gflops_per_second"] == max(gemm["gflops_per_second_by_backend"].values())
    frameworks = ["mindspore"] + (["torch"] if TORCH_USABLE else []) + ["onnxruntime"]
    assert [m["framework"] for m in result["measurements"]] == frameworks
    # onnxruntime ran this project's ONNX export (export.py's code), with the same threads: a third column.
    onnx = result["measurements"][-1]
    assert onnx["threads"] == ours_threads(result) and result["environment"]["onnxruntime"]
    # The kernel's huge-page mode, which moves PyTorch's training rate: the bracketed word of its sysfs file.
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    assert result["environment"]["transparent_hugepage"] == (
        mode.read_text().split("[")[1].split("]")[0] if mode.exists() else "unknown")
    ratio = result["measurements"][0]["images_per_second"] / onnx["images_per_second"]
    assert f"| {onnx['images_per_second']:.1f} | {ratio:.2f}x |" in process.stdout
    # Each worker's peak resident memory during its timed steps, in one table.
    assert all(m["peak_rss_bytes"] > 50_000_000 for m in result["measurements"])
    assert "| eval | 32x32 | " in process.stdout.split("MindSpore peak MB")[1]
    # The project's defaults, as train.py applies them: blocked-layout convolutions, oneDNN uncapped.
    ours = result["measurements"][0]
    assert (ours["conv_implementation"], ours["onednn_max_cpu_isa"]) == ("onednn_blocked", "all")
    assert ("mindspore_convolutions=onednn_blocked ONEDNN_MAX_CPU_ISA=all mindspore_inference=fused-blocked"
            in process.stdout)
    assert ours["inference_network"] == "fused-blocked"  # what evaluation runs at 32x32
    isa = {g["onednn_max_cpu_isa"] for g in gemm["measurements"] if g["backend"] == "mindspore"}
    assert isa == {"all"}  # the MindSpore model workers' setting
    for m in result["measurements"]:
        assert len(m["seconds_per_step"]) == 2  # one repeat in each of the 2 rounds
        assert m["round_images_per_second"] == pytest.approx([4 / t for t in m["seconds_per_step"]])
        assert m["flops_per_image"] == 2 * macs
        assert m["gflops_per_second"] == pytest.approx(2 * macs * m["images_per_second"] / 1e9)
        assert m["percent_of_gemm"] == pytest.approx(100 * m["gflops_per_second"] / gemm["reference_gflops_per_second"])
    assert "by round | lowest |" in process.stdout
    # The three workers took turns, in --frameworks' order, each round.
    starts = sorted((start, m["framework"]) for m in result["measurements"] for start in m["timing_start_times"])
    assert [framework for _, framework in starts] == frameworks * 2
    assert "took turns, one timed at a time" in process.stdout
    assert f"| {ours['gflops_per_second']:.1f} | {ours['percent_of_gemm']:.1f} |" in process.stdout


def ours_threads(result: dict) -> int:
    return result["measurements"][0]["threads"]


def test_memory_table_reports_each_frameworks_peak_of_the_timed_steps():
    ours = Measurement("mindspore", "train", 32, 10, 2, [1.0], peak_rss_bytes=900_000_000)
    theirs = Measurement("torch", "train", 32, 10, 2, [1.0], peak_rss_bytes=1_200_000_000)
    ort = Measurement("onnxruntime", "eval", 32, 10, 2, [1.0], peak_rss_bytes=300_000_000)
    text = table([ours, theirs, ort])
    assert ("| mode | input | batch | MindSpore peak MB | PyTorch peak MB | onnxruntime peak MB "
            "| MindSpore / PyTorch memory |") in text
    assert "| train | 32x32 | 10 | 900 | 1200 | - | 0.75x |" in text and "| eval | 32x32 | 10 | - | - | 300 | - |" in text


def test_round_table_gives_each_rounds_ratio_and_the_lowest():
    ours = Measurement("mindspore", "train", 32, 8, 2, [1.0] * 3, round_images_per_second=[20.0, 30.0, 16.0])
    theirs = Measurement("torch", "train", 32, 8, 2, [1.0] * 3, round_images_per_second=[10.0, 10.0, 10.0])
    ort = Measurement("onnxruntime", "eval", 32, 8, 2, [1.0] * 3, round_images_per_second=[5.0, 5.0, 5.0])
    ours_eval = Measurement("mindspore", "eval", 32, 8, 2, [1.0] * 3, round_images_per_second=[6.0, 4.0, 5.0])
    text = table([ours, theirs, ort, ours_eval])
    assert ("| mode | input | batch | MindSpore / PyTorch by round | lowest | MindSpore / onnxruntime by round "
            "| lowest |") in text
    assert "| train | 32x32 | 8 | 2.00x / 3.00x / 1.60x | 1.60x | - | - |" in text
    assert "| eval | 32x32 | 8 | - | - | 1.20x / 0.80x / 1.00x | 0.80x |" in text
    one_round = [replace(ours, round_images_per_second=[20.0]), replace(theirs, round_images_per_second=[10.0])]
    assert "by round" not in table(one_round) and "by round" not in table([ours])  # nothing to compare with


def test_several_batch_sizes_are_rows_of_their_own():
    measurements = [Measurement("mindspore", "train", 32, 32, 2, [1.0], recipe="O0"),
                    Measurement("torch", "train", 32, 32, 2, [2.0]),
                    Measurement("mindspore", "train", 32, 64, 2, [1.5], recipe="O0"),
                    Measurement("torch", "train", 32, 64, 2, [4.0]),
                    Measurement("train.py", "train", 32, 64, 2, [2.0])]
    text = table(measurements)
    assert "| train | 32x32 | 32 | 2 | 32.0 | 16.0 | 2.00x |" in text
    assert "| train | 32x32 | 64 | 2 | 42.7 | 16.0 | 2.67x |" in text
    assert "| 32x32 | 64 | 42.7 | 32.0 | 0.75x |" in text  # train.py against the benchmark step of its own batch


def test_peak_memory_is_that_of_the_timed_steps():
    """After a reset the peak is the current resident memory, and it rises with what the process then touches."""
    import mmap
    from src.process_memory import peak_memory_bytes, reset_peak_memory
    import numpy as np
    # The worker may have run bigger tests before this one: start from a reset, or its old peak hides the 400 MB.
    assert reset_peak_memory()
    before = peak_memory_bytes()
    # A mapping of its own, unmapped when closed: memory freed through malloc may stay resident in a worker whose
    # heap earlier tests have shaped, and this test is about the peak, not the allocator.
    region = mmap.mmap(-1, 400_000_000)
    pages = np.frombuffer(region, np.uint8)
    pages[:] = 1  # 400 MB, touched
    assert peak_memory_bytes() >= before + 350_000_000
    del pages
    region.close()
    assert reset_peak_memory()
    assert peak_memory_bytes() < before + 200_000_000  # the unmapped 400 MB no longer count


def test_onnxruntime_column_compares_inference_only():
    ours = Measurement("mindspore", "eval", 32, 10, 2, [1.0])
    ort = Measurement("onnxruntime", "eval", 32, 10, 2, [0.5])
    train = Measurement("mindspore", "train", 32, 10, 2, [2.0], recipe="O0")
    text = table([train, ours, ort])
    assert "| onnxruntime img/s | MindSpore / onnxruntime |" in text
    assert "| eval | 32x32 | 10 | 2 | 10.0 | - | - | - | - | - | 20.0 | 0.50x |" in text
    assert "| train | 32x32 | 10 | 2 | 5.0 | - | - | - | - | - | - | - |" in text


@pytest.mark.parametrize("args, option", [(["--sizes", "abc"], "--sizes"), (["--sizes", "32,16"], "--sizes"),
                                          (["--batch_size", "0"], "--batch_size"), (["--modes", "fit"], "--modes"),
                                          (["--batch_size", "32,x"], "--batch_size"),
                                          (["--gemm_size", "x"], "--gemm_size"), (["--warmup", "-1"], "--warmup"),
                                          (["--inference_network", "onnx"], "--inference_network"),
                                          (["--recipes", "O0,O4"], "--recipes"),
                                          (["--frameworks", "tensorflow"], "--frameworks"), (["--recipes", "sink"], "--recipes")])
def test_bad_input_is_one_error_line(args, option):
    assert_one_line_error(run_script("benchmark.py", args, timeout=60), option)


@pytest.mark.parametrize("requested, conv, ran", [("resnet", "onednn_blocked", "resnet"),
                                                  ("fused", "mindspore", "resnet"),
                                                  ("fused-nhwc", "onednn_blocked", "fused-nhwc")])
@pytest.mark.slow
def test_inference_network_records_the_cell_that_ran(requested, conv, ran):
    """--inference_network resnet times the ResNet cell itself; MindSpore's Conv2d can't be fused; fused-nhwc
    runs NHWC where the size alone would pick the blocked layout."""
    measurement = measure_in_subprocess("mindspore", "eval", "resnet18", 32, 2, 2, warmup=1, repeats=1, steps=1,
                                        conv_implementation=conv, inference_network=requested)
    assert measurement.inference_network == ran and measurement.conv_implementation == conv


def test_recipes_table_compares_each_training_recipe_with_the_first():
    measurements = [Measurement("mindspore", "train", 32, 8, 2, [1.0], recipe="O0"),
                    Measurement("mindspore", "train", 32, 8, 2, [4.0], recipe="O2"),
                    Measurement("mindspore", "train", 32, 8, 2, [0.5], recipe="O0-sink"),
                    Measurement("torch", "train", 32, 8, 2, [2.0])]
    text = table(measurements)
    assert "| train | 32x32 | 8 | 2 | 8.0 | 4.0 | 2.00x |" in text  # the first recipe against PyTorch
    assert "| input | batch | O0 img/s | O2 img/s | O0-sink img/s | O2 / O0 | O0-sink / O0 |" in text
    assert "| 32x32 | 8 | 8.0 | 2.0 | 16.0 | 0.25x | 2.00x |" in text


@pytest.mark.slow
@pytest.mark.parametrize("recipe, conv", [("O2", "mindspore"), ("O0-sink", "onednn_blocked"),
                                          ("O0-plain-nn_optimizer", "onednn_blocked")])
def test_a_training_recipe_runs_as_train_py_builds_it(recipe, conv):
    """O2 trains float16 with MindSpore's convolutions (the native ones are float32 only); -sink reads the loss
    once per timing."""
    measurement = measure_in_subprocess("mindspore", "train", "resnet18", 32, 2, 2, warmup=1, repeats=1, steps=2,
                                        recipe=recipe)
    assert measurement.recipe == recipe and measurement.conv_implementation == conv
    assert measurement.images_per_second > 0 and measurement.optimizer == "adam"


@pytest.mark.slow
@pytest.mark.parametrize("framework", ["mindspore", "torch"])
def test_the_nesterov_optimizer_trains_in_both_frameworks(framework):
    """--optimizer nesterov: the configs/ recipes' momentum SGD, in MindSpore (native update) and PyTorch alike."""
    measurement = measure_in_subprocess(framework, "train", "resnet18", 32, 2, 2, warmup=1, repeats=1, steps=2,
                                        optimizer="nesterov")
    assert measurement.optimizer == "nesterov" and measurement.images_per_second > 0


def test_train_py_table_puts_a_real_run_beside_the_benchmarks_step():
    measurements = [Measurement("mindspore", "train", 32, 8, 2, [1.0], recipe="O0"),
                    Measurement("mindspore", "train", 32, 8, 2, [4.0], recipe="O2"),
                    Measurement("train.py", "train", 32, 8, 2, [2.0, 2.0, 1.0])]
    text = table(measurements)
    assert "| input | batch | benchmark.py MindSpore img/s | train.py img/s | train.py / benchmark.py |" in text
    assert "| 32x32 | 8 | 8.0 | 4.0 | 0.50x |" in text  # against the O0 step, which train.py runs on a CPU
    assert "| train | 32x32 | 8 | 2 | 8.0 | - |" in text  # the main table still shows the benchmark's own step


def test_train_py_table_pairs_each_round_with_the_step_measured_next_to_it():
    """With several rounds each train.py run is compared with its own round's benchmark step, not only pooled."""
    measurements = [Measurement("mindspore", "train", 224, 32, 2, [4.0] * 3, recipe="O0",
                                round_images_per_second=[8.0, 4.0, 8.0]),
                    Measurement("train.py", "train", 224, 32, 2, [4.0] * 3, round_images_per_second=[8.8, 4.0, 7.2])]
    text = table(measurements)
    assert "| train.py / benchmark.py | by round |" in text
    assert "| 224x224 | 32 | 8.0 | 8.0 | 1.00x | 1.10x / 1.00x / 0.90x |" in text
    one_round = [replace(m, round_images_per_second=m.round_images_per_second[:1]) for m in measurements]
    assert "by round" not in table(one_round)


@pytest.mark.parametrize("frameworks", [["mindspore", "torch"], ["torch", "mindspore"]])
def test_train_py_takes_turns_with_its_sizes_training_workers(monkeypatch, tmp_path, frameworks):
    """In each round the workers of one size take turns (every recipe's MindSpore step and PyTorch's, in the order
    asked), and train.py takes turns with them, as many steps a turn as a worker's timing, so that its steps share
    the machine's phases with the step they are compared with. The measurements themselves are replaced by records
    of what each call was given: this tests the schedule alone."""
    import benchmark
    calls = []

    def measure_side_by_side(runs, threads, train_py=None):
        calls.append(([run.describe() for run in runs], train_py))
        measured = [Measurement(run.framework, "train", 32, 2, 2, [1.0],
                                recipe=run.recipe if run.framework == "mindspore" else "") for run in runs]
        return measured + ([Measurement("train.py", "train", 32, 2, 2, [1.0])] if train_py else [])
    monkeypatch.setattr(benchmark, "measure_side_by_side", measure_side_by_side)
    args = benchmark.parse_args(["--sizes", "32", "--modes", "train", "--rounds", "2", "--train_py",
                                 "--recipes", "O0,O2", "--batch_size", "2", "--repeats", "4"])
    measurements = benchmark.measure_models(args, frameworks, {32: 1}, {}, str(tmp_path))
    together = {"mindspore": ["mindspore O0", "mindspore O2"], "torch": ["torch"]}
    assert len(calls) == 2
    for runs, train_py in calls:
        assert runs == [run for framework in frameworks for run in together[framework]]
        assert (train_py.image_size, train_py.batch_size, train_py.steps, train_py.repeats) == (32, 2, 5, 4)
    assert sorted((m.framework, m.recipe, len(m.round_images_per_second)) for m in measurements) == [
        ("mindspore", "O0", 2), ("mindspore", "O2", 2), ("torch", "", 2), ("train.py", "", 2)]


@pytest.mark.parametrize("asked, warmups", [([], {32: 20, 224: 4}), (["--warmup", "0"], {32: 0, 224: 0}),
                                            (["--warmup", "3", "--steps", "2"], {32: 3, 224: 3})])
def test_each_worker_warms_up_four_timings_worth_unless_told(monkeypatch, tmp_path, asked, warmups):
    """MindSpore's first 15 or so training steps at 32x32 are slower than the rest: by default every worker (either
    framework) runs four timings' worth of untimed steps first, 20 at 32x32's 5-step timings. Records of each
    worker's run stand in for the measurements: this tests what the workers are told."""
    import benchmark
    told = []

    def measure_side_by_side(runs, threads, train_py=None):
        told.extend((run.framework, run.image_size, run.warmup) for run in runs)
        return [Measurement(run.framework, run.mode, run.image_size, run.batch_size, threads, [1.0]) for run in runs]
    monkeypatch.setattr(benchmark, "measure_side_by_side", measure_side_by_side)
    args = benchmark.parse_args(["--sizes", "32,224", "--modes", "train", *asked])
    benchmark.measure_models(args, ["mindspore", "torch"], {32: 1, 224: 1}, {}, str(tmp_path))
    assert told == [(framework, size, warmups[size]) for size in (32, 224) for framework in ("mindspore", "torch")]


@pytest.mark.slow
def test_workers_take_turns_timing_by_timing_and_wait_idle():
    """Workers of one size run one at a time, alternating timing by timing, so a slow phase of the machine hits
    each framework's timings alike; a waiting worker blocks instead of using the CPU, and none exits (which takes
    CPU) before the others' timings are done. Two real MindSpore workers
    (the fused inference network and the ResNet cell), three timings each."""
    runs = [WorkerRun("mindspore", "eval", "resnet18", 32, 2, warmup=2, repeats=3, steps=2, inference_network=network)
            for network in ("fused", "resnet")]
    fused, cell = measure_side_by_side(runs, 2)
    assert (fused.inference_network, cell.inference_network) == ("fused-blocked", "resnet")
    assert len(fused.timing_start_times) == len(cell.timing_start_times) == 3
    for i in range(3):  # each timing (steps x seconds per step) ends before the other worker's next one starts
        assert fused.timing_start_times[i] + 2 * fused.seconds_per_step[i] <= cell.timing_start_times[i]
        if i < 2:
            assert cell.timing_start_times[i] + 2 * cell.seconds_per_step[i] <= fused.timing_start_times[i + 1]
    # The first worker's exit, which takes CPU, waits for the second's last timing.
    assert fused.ended_at >= cell.timing_start_times[-1] + 2 * cell.seconds_per_step[-1]
    for waiting, timed in ((fused, cell), (cell, fused)):  # it waited through the other's turns
        assert waiting.idle_seconds >= sum(2 * seconds for seconds in timed.seconds_per_step)
        assert waiting.idle_cpu_seconds < 0.25 * waiting.idle_seconds  # a spinning waiter would use about 1
    assert "took turns, one timed at a time; while waiting, a worker used at most" in table([fused, cell])


def test_the_next_turn_waits_until_the_last_workers_threads_go_quiet():
    """Thread pools spin a while after their last task (onnxruntime's some 40 ms): the next worker's turn waits
    for that. A process spinning for 0.5 s holds the next turn back about as long; a sleeping one does not."""
    from src.benchmark import _settle
    spinning = subprocess.Popen([sys.executable, "-c", "import time, sys\nsys.stdin.readline()\n"
                                 "end = time.perf_counter() + 0.5\nprint('spinning', flush=True)\n"
                                 "while time.perf_counter() < end: pass\ntime.sleep(30)"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        spinning.stdin.write("go\n")
        spinning.stdin.flush()
        # Timed from the child's word that it spins: on a busy machine it may not run for a while after "go", and
        # a process that has not started yet is quiet.
        assert spinning.stdout.readline() == "spinning\n"
        started = time.perf_counter()
        _settle(spinning.pid)
        assert 0.35 < time.perf_counter() - started < 1.5
        started = time.perf_counter()
        _settle(spinning.pid)  # now asleep
        assert time.perf_counter() - started < 0.2
    finally:
        spinning.kill()
        spinning.wait()


@pytest.mark.slow
def test_a_worker_that_fails_stops_the_others(tmp_path):
    """A worker that fails (here: onnxruntime given no file) ends the measurement with its error, and the worker
    already waiting beside it does not outlive it."""
    import psutil  # a requirement of MindSpore
    # Children from before are not the measurement's: multiprocessing's resource tracker, which stays once an
    # earlier test in this process has used a spawn pool (conftest.in_fresh_process), is one.
    before = set(psutil.Process().children(recursive=True))
    runs = [WorkerRun("mindspore", "eval", "resnet18", 32, 2, warmup=1, repeats=1, steps=1),
            WorkerRun("onnxruntime", "eval", "resnet18", 32, 2, warmup=1, repeats=1, steps=1,
                      onnx_path=str(tmp_path / "missing.onnx"))]
    with pytest.raises(RuntimeError, match="onnxruntime eval 32: worker failed") as failure:
        measure_side_by_side(runs, 2)
    assert "missing.onnx" in str(failure.value)
    assert [child for child in psutil.Process().children(recursive=True) if child not in before] == []


@pytest.mark.slow
def test_train_py_takes_turns_stopped_between_them_and_its_stops_are_not_in_its_step_times(tmp_path):
    """--train_py runs train.py itself (two epochs, evaluated at the end) beside the workers: its second epoch's
    steps run a turn at a time between the workers' timings, the process stopped meanwhile, and a step's time leaves
    out the time the process was stopped in it."""
    steps, repeats = 3, 3
    worker, train_py = measure_side_by_side([WorkerRun("mindspore", "train", "resnet18", 32, 4, 4, repeats, steps)],
                                            2, TrainPyRun("resnet18", 32, 4, steps, repeats, str(tmp_path)))
    assert train_py.framework == "train.py" and len(train_py.seconds_per_step) == steps * repeats
    assert all(seconds > 0 for seconds in train_py.seconds_per_step)
    # Each timed turn of train.py starts after the worker's timing before it has ended, and its steps fit before
    # the worker's next timing: a step that kept the stop's time would overrun into it by a whole worker turn.
    worker_ends = [start + steps * seconds
                   for start, seconds in zip(worker.timing_start_times, worker.seconds_per_step)]
    for turn, start in enumerate(train_py.timing_start_times):
        assert start > worker_ends[turn]
        took = sum(train_py.seconds_per_step[turn * steps:(turn + 1) * steps])
        window = (worker.timing_start_times[turn + 1] if turn + 1 < repeats else worker.ended_at) - start
        assert took < window + 0.5 * steps * worker.seconds_per_step[turn]
    assert train_py.idle_cpu_seconds < 0.05 * train_py.idle_seconds  # stopped while the worker ran
    from conftest import read_metrics
    _, rows = read_metrics(tmp_path / "train-32")
    assert [row["epoch"] for row in rows] == ["1", "2"] and rows[1]["top1"]  # a whole run, evaluated at its end


@pytest.mark.slow
def test_a_train_py_that_fails_ends_the_measurement_with_its_error_and_no_process_left(tmp_path):
    """train.py's own one-line error (here: its data folder can't be made, a file is in the way) ends the
    measurement, and the worker waiting beside it does not outlive it."""
    import psutil  # a requirement of MindSpore
    before = set(psutil.Process().children(recursive=True))
    in_the_way = tmp_path / "a-file"
    in_the_way.write_text("")
    with pytest.raises(RuntimeError, match="train.py 32x32: failed") as failure:
        measure_side_by_side([WorkerRun("mindspore", "train", "resnet18", 32, 2, 1, 1, 1)], 2,
                             TrainPyRun("resnet18", 32, 2, 1, 1, str(in_the_way)))
    assert "a-file" in str(failure.value) and "Traceback" not in str(failure.value)
    assert [child for child in psutil.Process().children(recursive=True) if child not in before] == []


@pytest.mark.slow
def test_isa_avx2_caps_every_framework_and_leaves_onnxruntime_out(tmp_path):
    output = tmp_path / "bench.json"
    process = run_script("benchmark.py", ["--isa", "avx2", "--sizes", "32", "--modes", "eval", "--model_name",
                                          "resnet18", "--batch_size", "2", "--repeats", "1", "--warmup", "1",
                                          "--steps", "1", "--gemm_size", "256", "--output", str(output)], timeout=300)
    assert process.returncode == 0, process.stderr[-3000:]
    assert "onnxruntime has no switch" in process.stderr
    result = json.loads(output.read_text())
    assert "onnxruntime" not in [m["framework"] for m in result["measurements"]]
    ours = next(m for m in result["measurements"] if m["framework"] == "mindspore")
    assert ours["onednn_max_cpu_isa"] == "AVX2" and ours["conv_implementation"] == "onednn_blocked"
    assert result["environment"]["isa"].startswith("avx2 (ONEDNN_MAX_CPU_ISA=AVX2, ATEN_CPU_CAPABILITY=avx2")
    assert {g["onednn_max_cpu_isa"] for g in result["gemm"]["measurements"]} == {"AVX2"}


def test_missing_output_folder_is_refused_before_measuring(tmp_path):
    assert_one_line_error(run_script("benchmark.py", ["--output", str(tmp_path / "no" / "b.json")], timeout=60),
                          "--output", "does not exist")


def test_model_choices_match_the_architectures():
    import benchmark
    from src.resnet import ARCHITECTURES
    assert benchmark.ARCHITECTURES == tuple(ARCHITECTURES)


def test_freed_heap_goes_back_to_the_system():
    """Heap blocks freed below a live one stay resident under glibc; return_freed_heap hands them back. In a fresh
    process, whose heap no earlier test has shaped."""
    script = """
import ctypes, sys
sys.path.insert(0, sys.argv[1])
from src.process_memory import return_freed_heap

def resident():
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmRSS:"))
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
blocks = [libc.malloc(64 * 1024) for _ in range(3200)]  # 200 MB of blocks under the mmap threshold: the heap
pin = libc.malloc(64 * 1024)  # keeps the heap's top from shrinking when the blocks below it are freed
for block in blocks:
    ctypes.memset(block, 1, 64 * 1024)
for block in blocks:
    libc.free(block)
freed = resident()
print(return_freed_heap(), freed - resident())
"""
    result = subprocess.run([sys.executable, "-c", script, str(REPO)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    ran, returned = result.stdout.split()
    assert ran == "True"
    assert int(returned) > 150_000_000  # of the 200 MB freed
