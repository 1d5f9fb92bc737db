"""export.py: real MINDIR (fixed and dynamic batch) and ONNX exports, run back through ms.load/GraphCell and
onnxruntime against the checkpoint's network; atomic, read-only outputs; a failed --verify publishes nothing;
each refusal is one line with exit code 2."""
import json
import os
import stat
from pathlib import Path

import numpy as np
import pytest

from conftest import assert_one_line_error, read_ckpt_entries, run_script, temp_files

SMALL = ["--model_name", "resnet18", "--image_height", "32", "--image_width", "32"]


def make_checkpoint(path: Path, model_name: str = "resnet18", seed: int = 3) -> Path:
    """A freshly built network with non-trivial BatchNorm statistics (so eval-mode and train-mode BatchNorm
    differ and an export of the wrong mode would be seen), saved as a .ckpt."""
    import mindspore as ms
    from src.resnet import build_resnet
    ms.set_seed(seed)
    net = build_resnet(model_name, 10)
    rng = np.random.default_rng(seed)
    for param in net.get_parameters():
        if param.name.endswith("moving_mean"):
            param.set_data(ms.Tensor(rng.normal(0, 0.1, param.shape).astype(np.float32)))
        elif param.name.endswith("moving_variance"):
            param.set_data(ms.Tensor(rng.uniform(0.5, 2.0, param.shape).astype(np.float32)))
    ms.save_checkpoint(net, str(path))
    return path


def network_from(checkpoint: Path, model_name: str = "resnet18"):
    import mindspore as ms
    from src.resnet import build_resnet
    net = build_resnet(model_name, 10)
    ms.load_param_into_net(net, read_ckpt_entries(checkpoint), strict_load=True)
    net.set_train(False)
    return net


def summary_of(process) -> dict:
    return json.loads(process.stdout.strip().splitlines()[-1])


def exported_files(folder: Path):
    return sorted(p.name for p in folder.rglob("*") if p.suffix in (".mindir", ".onnx", ".air"))


def nothing_staged(folder: Path) -> bool:
    return temp_files(folder) == []


def expected_mode() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return 0o444 & ~umask


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "r18.ckpt")


@pytest.fixture(scope="module")
def reference_net(checkpoint):
    return network_from(checkpoint)


def run_export_script(checkpoint: Path, out: Path, *args: str, env=None):
    return run_script("export.py", ["--checkpoint_path", str(checkpoint), "--output_path", str(out), *SMALL, *args],
                      env=env)


# ---------------------------------------------------------------- real exports, checked independently

@pytest.mark.slow
def test_mindir_export_verifies_and_reproduces_the_checkpoint(checkpoint, reference_net, tmp_path):
    import mindspore as ms
    from mindspore import nn
    from src.inference import mindir_signature
    process = run_export_script(checkpoint, tmp_path, "--file_format", "MINDIR", "--batch_size", "2", "--verify")
    assert process.returncode == 0, process.stderr[-3000:]
    summary = summary_of(process)
    target = tmp_path / "resnet18.mindir"
    assert summary["file"] == str(target) and summary["input_shape"] == [2, 3, 32, 32]
    [check] = summary["verify"]
    assert check["batch_size"] == 2 and check["ok"] and check["max_abs_diff"] <= 1e-5
    assert "verify MINDIR batch 2: max abs difference" in process.stdout and f"wrote {target}" in process.stdout
    assert stat.S_IMODE(target.stat().st_mode) == expected_mode()
    assert exported_files(tmp_path) == ["resnet18.mindir"] and nothing_staged(tmp_path)
    # Independently of export.py's own check: the file holds the checkpoint's network in inference mode.
    assert mindir_signature(str(target)) == ([2, 3, 32, 32], [2, 10])
    batch = np.random.default_rng(7).standard_normal((2, 3, 32, 32)).astype(np.float32)
    exported = nn.GraphCell(ms.load(str(target)))(ms.Tensor(batch)).asnumpy()
    expected = reference_net(ms.Tensor(batch)).asnumpy()
    assert np.max(np.abs(exported - expected)) <= 1e-5


@pytest.mark.slow
def test_dynamic_batch_mindir_verifies_at_two_batch_sizes(checkpoint, reference_net, tmp_path):
    import mindspore as ms
    from mindspore import nn
    from src.inference import mindir_signature
    process = run_export_script(checkpoint, tmp_path, "--file_format", "MINDIR", "--dynamic_batch", "--verify",
                                "--batch_size", "3", "--file_name", "r18-dynamic")
    assert process.returncode == 0, process.stderr[-3000:]
    summary = summary_of(process)
    target = tmp_path / "r18-dynamic.mindir"
    assert summary["file"] == str(target) and summary["input_shape"] == [None, 3, 32, 32]
    assert [c["batch_size"] for c in summary["verify"]] == [3, 1]
    assert all(c["ok"] and c["max_abs_diff"] <= 1e-5 for c in summary["verify"])
    assert mindir_signature(str(target)) == ([-1, 3, 32, 32], [-1, 10])
    graph = nn.GraphCell(ms.load(str(target)))
    batch = np.random.default_rng(8).standard_normal((5, 3, 32, 32)).astype(np.float32)  # a third size
    assert np.max(np.abs(graph(ms.Tensor(batch)).asnumpy() - reference_net(ms.Tensor(batch)).asnumpy())) <= 1e-5


@pytest.mark.slow
def test_onnx_export_verifies_through_onnxruntime(checkpoint, reference_net, tmp_path):
    import mindspore as ms
    onnxruntime = pytest.importorskip("onnxruntime")
    process = run_export_script(checkpoint, tmp_path, "--file_format", "ONNX", "--batch_size", "2", "--verify",
                                "--file_name", "r18.onnx")  # a name with the suffix keeps a single suffix
    assert process.returncode == 0, process.stderr[-3000:]
    summary = summary_of(process)
    target = tmp_path / "r18.onnx"
    assert summary["file"] == str(target) and exported_files(tmp_path) == ["r18.onnx"]
    [check] = summary["verify"]
    assert check["ok"] and 0 <= check["max_abs_diff"] <= 1e-4
    assert "verify ONNX batch 2" in process.stdout
    session = onnxruntime.InferenceSession(str(target), providers=["CPUExecutionProvider"])
    [model_input] = session.get_inputs()
    assert list(model_input.shape) == [2, 3, 32, 32]
    batch = np.random.default_rng(9).standard_normal((2, 3, 32, 32)).astype(np.float32)
    exported = session.run(None, {model_input.name: batch})[0]
    assert np.max(np.abs(exported - reference_net(ms.Tensor(batch)).asnumpy())) <= 1e-4


@pytest.mark.slow
def test_resnet50_mindir_export_verifies(tmp_path):
    """The default architecture once (bottleneck blocks, about 95 MB of MINDIR); the dynamic batch is covered
    with resnet18 above."""
    checkpoint = make_checkpoint(tmp_path / "r50.ckpt", "resnet50")
    process = run_script("export.py", ["--checkpoint_path", str(checkpoint), "--output_path", str(tmp_path),
                                       "--image_height", "32", "--image_width", "32", "--batch_size", "2",
                                       "--verify"])
    assert process.returncode == 0, process.stderr[-3000:]
    summary = summary_of(process)
    assert summary["file"] == str(tmp_path / "resnet50.mindir") and summary["model_name"] == "resnet50"
    [check] = summary["verify"]
    assert check["batch_size"] == 2 and check["ok"] and check["max_abs_diff"] <= 1e-5
    assert (tmp_path / "resnet50.mindir").stat().st_size > 90e6


# ---------------------------------------------------------------- atomic writes and a failing --verify

@pytest.mark.slow
def test_a_second_export_replaces_the_read_only_first(reference_net, tmp_path):
    from src.exporting import export_network
    target = tmp_path / "model.mindir"
    first = export_network(reference_net, target, "MINDIR", 1, (32, 32))
    assert first.path == target
    if os.geteuid() != 0:  # root may write anyway
        assert not os.access(target, os.W_OK)
    inode = target.stat().st_ino
    second = export_network(reference_net, target, "MINDIR", 2, (32, 32))
    assert second.path == target and target.stat().st_ino != inode
    assert stat.S_IMODE(target.stat().st_mode) == expected_mode()
    assert nothing_staged(tmp_path)


@pytest.mark.slow
def test_verify_detects_an_export_that_differs(reference_net, checkpoint, tmp_path):
    """An exported file checked against another network fails: the check is able to fail."""
    import mindspore as ms
    from src.exporting import export_network, verify_export
    from src.resnet import build_resnet
    target = export_network(reference_net, tmp_path / "a.mindir", "MINDIR", 2, (32, 32)).path
    ms.set_seed(11)
    other = build_resnet("resnet18", 10)
    [same] = verify_export(reference_net, target, "MINDIR", (32, 32), [2])
    [different] = verify_export(other, target, "MINDIR", (32, 32), [2])
    assert same.ok and same.max_abs == 0.0
    assert not different.ok and different.max_abs > 1e-2


@pytest.mark.slow
def test_failed_verify_exits_1_and_publishes_nothing(checkpoint, tmp_path, monkeypatch, capsys):
    import src.exporting as exporting
    from src.model_utils.config import load_config
    from src.utils import RunEnv, get_logger
    real_runner = exporting.exported_runner

    def drifting_runner(path, file_format):  # an export that is off by 1e-2 (say a broken converter)
        run = real_runner(path, file_format)
        return lambda batch: run(batch) + 1e-2

    monkeypatch.setattr(exporting, "exported_runner", drifting_runner)
    config = load_config(["--checkpoint_path", str(checkpoint), "--output_path", str(tmp_path), *SMALL,
                          "--batch_size", "2", "--verify"], prog="export.py")
    code, summary = exporting.run_export(config, RunEnv("CPU"), get_logger(None))
    assert code == 1 and summary["file"] is None and not summary["verify"][0]["ok"]
    assert summary["verify"][0]["max_abs_diff"] == pytest.approx(1e-2, rel=1e-3)
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "verify failed" in errors[0] and "was not written" in errors[0]
    assert exported_files(tmp_path) == [] and nothing_staged(tmp_path)


def test_tolerance_rules():
    from src.exporting import VERIFY_ATOL, VERIFY_RTOL, compare_outputs
    reference = np.array([[10.0, -20.0]], np.float32)
    assert compare_outputs(reference, reference).ok
    assert compare_outputs(reference, reference + 1e-4).ok  # within 1e-4 + 1e-4 * 20
    assert not compare_outputs(reference, reference + (VERIFY_ATOL + VERIFY_RTOL * 20) * 1.5).ok
    assert not compare_outputs(reference, np.full_like(reference, np.nan)).ok
    assert not compare_outputs(reference, reference[:, :1]).ok  # wrong shape


# ---------------------------------------------------------------- refusals: one line, exit code 2, nothing written

# Each case starts export.py (a few seconds): air_on_cpu runs in the fast loop, the others are slow (pytest.ini).
@pytest.mark.parametrize("case", [case if case == "air_on_cpu" else pytest.param(case, marks=pytest.mark.slow)
                                  for case in ["air_on_cpu", "onnx_dynamic", "missing_checkpoint", "damaged_checkpoint",
                                               "no_checkpoint", "wrong_architecture"]])
def test_refusals(case, checkpoint, tmp_path):
    source = str(checkpoint)
    args = ["--file_format", "MINDIR"]
    if case == "air_on_cpu":
        args, fragments = ["--file_format", "AIR"], ["AIR", "Ascend", "CPU"]
    elif case == "onnx_dynamic":
        args, fragments = ["--file_format", "ONNX", "--dynamic_batch"], ["--dynamic_batch", "MINDIR only"]
    elif case == "missing_checkpoint":
        source = str(tmp_path / "absent.ckpt")
        fragments = [source, "does not exist"]
    elif case == "damaged_checkpoint":
        data = checkpoint.read_bytes()
        damaged = tmp_path / "damaged.ckpt"
        damaged.write_bytes(data[: len(data) // 3])
        source, fragments = str(damaged), [str(damaged), "damaged"]
    elif case == "no_checkpoint":
        source, fragments = "", ["--checkpoint_path"]
    else:  # resnet18 weights exported as resnet34
        args, fragments = ["--file_format", "MINDIR", "--model_name", "resnet34"], ["resnet18", "--model_name"]
    out = tmp_path / "out"
    process = run_script("export.py", ["--checkpoint_path", source, "--output_path", str(out), *SMALL, *args])
    assert_one_line_error(process, *fragments)
    assert not out.exists() or exported_files(out) == []


@pytest.mark.slow
def test_onnx_verify_without_onnxruntime_is_refused(checkpoint, tmp_path):
    shadow = tmp_path / "shadow" / "onnxruntime"  # an onnxruntime that fails to import, first on the path
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('onnxruntime hidden by the test')\n")
    process = run_export_script(checkpoint, tmp_path / "out", "--file_format", "ONNX", "--batch_size", "1",
                                "--verify", env={"PYTHONPATH": str(shadow.parent)})
    assert_one_line_error(process, "onnxruntime", "not installed")
    assert not (tmp_path / "out").exists()
