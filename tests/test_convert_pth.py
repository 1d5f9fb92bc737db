"""convert_pth.py and src.weights.convert: .pth -> .ckpt -> .pth, wrappers, --drop_head, --verify, and every
refusal (one 'error:' line, exit code 2, no output file). The CLI is run as a real subprocess; .pth files are
written with torch.save from torchvision networks built here (random weights, nothing downloaded)."""
import json
from collections import OrderedDict
from pathlib import Path
from typing import Dict, List

import numpy as np
import pytest

torch = pytest.importorskip("torch")
torchvision = pytest.importorskip("torchvision")

import mindspore as ms

from conftest import assert_one_line_error, read_ckpt_entries, run_script
from src.weights.convert import (NUM_BATCHES_TRACKED_ENTRY, MismatchError, convert_pth_to_ckpt,
                                 torch_to_mindspore_weights)
from src.weights.files import load_torch_state_dict
from src.weights.names import torch_to_mindspore_name

SCRIPT = "convert_pth.py"
NUM_CLASSES = 10


# ----------------------------------------------------------------------------------------------- helpers

def make_state(num_classes: int = NUM_CLASSES, seed: int = 0) -> "OrderedDict[str, torch.Tensor]":
    """torchvision resnet18's state_dict with non-trivial BatchNorm statistics and num_batches_tracked."""
    torch.manual_seed(seed)
    net = torchvision.models.resnet18(num_classes=num_classes)
    rng = np.random.default_rng(seed)
    with torch.no_grad():
        for module in net.modules():
            if isinstance(module, torch.nn.BatchNorm2d):
                c = module.num_features
                module.running_mean.copy_(torch.from_numpy(rng.normal(0, 0.2, c).astype(np.float32)))
                module.running_var.copy_(torch.from_numpy(rng.uniform(0.5, 2.0, c).astype(np.float32)))
                module.num_batches_tracked.fill_(int(rng.integers(1, 10_000)))
    return net.state_dict()


@pytest.fixture(scope="module")
def state() -> "OrderedDict[str, torch.Tensor]":
    return make_state()


@pytest.fixture(scope="module")
def pth(state, tmp_path_factory) -> Path:
    """A bare resnet18 state_dict saved with torch.save."""
    path = tmp_path_factory.mktemp("pth") / "resnet18.pth"
    torch.save(state, path)
    return path


def files_under(folder: Path) -> List[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file()) if folder.exists() else []


def ckpt_arrays(path: Path) -> Dict[str, np.ndarray]:
    return {name: value.asnumpy() for name, value in read_ckpt_entries(path).items() if hasattr(value, "asnumpy")}


def assert_ckpt_holds(path: Path, state, skip=()) -> None:
    """The .ckpt holds every tensor of state under its MindSpore name, bit for bit (num_batches_tracked aside)."""
    arrays = ckpt_arrays(path)
    expected = {torch_to_mindspore_name(k): v.numpy() for k, v in state.items() if torch_to_mindspore_name(k)}
    expected = {k: v for k, v in expected.items() if k not in skip}
    assert sorted(arrays) == sorted(expected)
    for name, value in expected.items():
        assert arrays[name].dtype == value.dtype and arrays[name].tobytes() == value.tobytes(), name


def refuse(args: List[str], out: Path, *fragments: str, env=None) -> str:
    """Runs the script, expects the one-line refusal naming every fragment and no file under out's folder."""
    process = run_script(SCRIPT, args, env=env)
    line = assert_one_line_error(process, *fragments)
    assert files_under(out.parent) == [], files_under(out.parent)
    return line


# ----------------------------------------------------------------------------------------- conversions

@pytest.fixture(scope="module")
def converted(pth, tmp_path_factory):
    """(.ckpt path, finished process) of the command-line conversion of pth, verified (--verify writes nothing)."""
    out = tmp_path_factory.mktemp("converted") / "out" / "resnet18.ckpt"
    process = run_script(SCRIPT, ["--pth_path", str(pth), "--ckpt_path", str(out), "--verify", "--image_size", "32"])
    assert process.returncode == 0, process.stderr[-3000:]
    return out, process


@pytest.mark.slow
def test_cli_converts_and_verifies(converted, state):
    """A bare state_dict converts; --verify compares logits with torchvision and passes; the .ckpt holds every
    weight bit for bit, torch's num_batches_tracked in a side entry, and nothing else is left in the folder."""
    out, process = converted
    assert "converted" in process.stdout and "resnet18, 10 classes" in process.stdout
    assert "verify passed: max abs logit difference" in process.stdout
    assert_ckpt_holds(out, state)
    counters = json.loads(str(read_ckpt_entries(out)[NUM_BATCHES_TRACKED_ENTRY]))
    assert counters == {k.rpartition(".")[0]: int(v) for k, v in state.items() if k.endswith("num_batches_tracked")}
    assert files_under(out.parent) == [out]  # no staging file left behind


@pytest.mark.slow
def test_round_trip_pth_ckpt_pth_is_bit_identical(converted, state, tmp_path):
    """.pth -> .ckpt -> .pth (--reverse, verified) gives the same keys in the same order, dtypes and bytes,
    num_batches_tracked included, and torchvision's load_state_dict(strict=True) accepts it."""
    ckpt, back = converted[0], tmp_path / "back" / "r18.pth"
    reverse = run_script(SCRIPT, ["--reverse", "--ckpt_path", str(ckpt), "--pth_path", str(back), "--verify",
                                  "--image_size", "32"])
    assert reverse.returncode == 0, reverse.stderr[-3000:]
    assert "verify passed" in reverse.stdout
    again = torch.load(back, weights_only=True)
    assert list(again) == list(state)
    for key, tensor in state.items():
        assert again[key].dtype == tensor.dtype and again[key].shape == tensor.shape, key
        assert again[key].numpy().tobytes() == tensor.numpy().tobytes(), key
    torchvision.models.resnet18(num_classes=NUM_CLASSES).load_state_dict(again, strict=True)
    assert files_under(back.parent) == [back]
    assert files_under(ckpt.parent) == [ckpt]  # --reverse only read the .ckpt


@pytest.mark.parametrize("form", ["state_dict", "model", "dataparallel", "nested_with_optimizer"])
def test_wrapped_and_prefixed_files_convert_like_the_bare_state_dict(form, state, tmp_path):
    """{'state_dict': ...}, {'model': ...}, DataParallel/DDP 'module.' names and a training checkpoint with
    optimizer state and an epoch all give the bare state_dict's conversion, and the notes say what was done."""
    prefixed = OrderedDict((f"module.{k}", v) for k, v in state.items())
    content = {"state_dict": {"state_dict": state, "epoch": 7},
               "model": {"model": state},
               "dataparallel": prefixed,
               "nested_with_optimizer": {"model": prefixed, "optimizer": {"state": {}, "param_groups": []},
                                         "epoch": 3}}[form]
    path = tmp_path / f"{form}.pth"
    torch.save(content, path)
    conversion = convert_pth_to_ckpt(str(path), str(tmp_path / f"{form}.ckpt"))
    assert_ckpt_holds(tmp_path / f"{form}.ckpt", state)
    notes = " ".join(conversion.notes)
    if form in ("dataparallel", "nested_with_optimizer"):
        assert "'module.'" in notes
    if form != "dataparallel":
        assert "took the weights from the" in notes


@pytest.mark.slow
def test_drop_head_leaves_fc_out_and_says_so(pth, state, tmp_path):
    """--drop_head with another class count: the .ckpt has every weight but fc, stdout says so, and --verify
    (both networks then share torchvision's fresh 100-class head) still compares every converted weight."""
    out = tmp_path / "backbone.ckpt"
    process = run_script(SCRIPT, ["--pth_path", str(pth), "--ckpt_path", str(out), "--num_classes", "100",
                                  "--drop_head", "--verify", "--image_size", "32"])
    assert process.returncode == 0, process.stderr[-3000:]
    assert "left fc.weight and fc.bias out (--drop_head)" in process.stdout
    assert "no head (--drop_head)" in process.stdout and "verify passed" in process.stdout
    assert_ckpt_holds(out, state, skip=("fc.weight", "fc.bias"))


@pytest.mark.slow
def test_reverse_sets_training_state_aside(tmp_path):
    """A .ckpt with optimizer moments and resume fields next to the weights (as train.py writes) converts back;
    the training state is set aside and listed, num_batches_tracked becomes 0."""
    from src.weights.files import save_checkpoint_atomic
    from src.resnet import build_resnet
    net = build_resnet("resnet18", NUM_CLASSES)
    items = [{"name": p.name, "data": p} for p in net.get_parameters()]
    items += [{"name": f"moment1.{p.name}", "data": ms.Tensor(np.zeros(p.shape, np.float32))}
              for p in net.trainable_params()]
    ckpt = tmp_path / "trained.ckpt"
    save_checkpoint_atomic(items, str(ckpt), append_dict={"epoch_num": 3, "global_step": 120, "model_name": "resnet18"})
    out = tmp_path / "exported.pth"
    process = run_script(SCRIPT, ["--reverse", "--ckpt_path", str(ckpt), "--pth_path", str(out)])
    assert process.returncode == 0, process.stderr[-3000:]
    assert "set aside" in process.stdout and "moment1.conv1.weight" in process.stdout
    exported = torch.load(out, weights_only=True)
    torchvision.models.resnet18(num_classes=NUM_CLASSES).load_state_dict(exported, strict=True)
    assert all(int(v) == 0 for k, v in exported.items() if k.endswith("num_batches_tracked"))
    for p in net.get_parameters():
        torch_name = p.name.replace("gamma", "weight").replace("beta", "bias") \
            .replace("moving_mean", "running_mean").replace("moving_variance", "running_var")
        assert np.array_equal(exported[torch_name].numpy(), p.asnumpy()), p.name


def test_half_precision_tensors_are_widened_exactly(state, tmp_path):
    """float16 and bfloat16 files convert to float32 (the network's type) with the same values, and say so."""
    for dtype in (torch.float16, torch.bfloat16):
        half = OrderedDict((k, v.to(dtype) if v.is_floating_point() else v) for k, v in state.items())
        path = tmp_path / f"{dtype}.pth"
        torch.save(half, path)
        conversion = torch_to_mindspore_weights(load_torch_state_dict(str(path)), str(path))
        assert any("to float32" in note for note in conversion.notes), conversion.notes
        for key, value in half.items():
            name = torch_to_mindspore_name(key)
            if name:
                assert conversion.weights[name].dtype == np.float32
                np.testing.assert_array_equal(conversion.weights[name], value.float().numpy())


def test_mismatch_lists_every_unmatched_name(state, tmp_path):
    """All unmatched names are kept (the one-line message shows the first few and a count)."""
    broken = OrderedDict(state)
    removed = [k for k in state if k.startswith("layer3.")][:12]
    for key in removed:
        del broken[key]
    broken["extra.weight"] = torch.zeros(3)
    path = tmp_path / "broken.pth"
    torch.save(broken, path)
    with pytest.raises(MismatchError) as excinfo:
        torch_to_mindspore_weights(load_torch_state_dict(str(path)), str(path))
    expected_missing = sorted(k for k in removed if not k.endswith("num_batches_tracked"))
    assert sorted(excinfo.value.missing) == expected_missing
    assert excinfo.value.unexpected == ["extra.weight"]
    assert f"(+{len(expected_missing) - 8} more)" in str(excinfo.value)


# ---------------------------------------------------------------------------------------------- refusals

class WritesMarker:
    """Unpickling this runs open(marker, 'w'): a file that needs arbitrary code to load."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


@pytest.mark.slow
def test_file_that_needs_unpickling_is_refused_and_not_executed(tmp_path, state):
    """A .pth holding a Python object whose unpickling runs code is refused in one line and nothing runs; the
    same file loaded the unsafe way would have created the marker (so the check can fail)."""
    marker = tmp_path / "marker-created-by-unpickling"
    path = tmp_path / "evil.pth"
    torch.save({"state_dict": state, "payload": WritesMarker(marker)}, path)
    out = tmp_path / "out" / "evil.ckpt"
    refuse(["--pth_path", str(path), "--ckpt_path", str(out)], out, str(path), "needs arbitrary code to unpickle",
           "(it references io.open)", "torch.save(model.state_dict(), path)")
    assert not marker.exists()
    torch.load(path, weights_only=False)  # the unsafe way, in the test only
    assert marker.exists()


@pytest.mark.slow
def test_whole_pickled_model_is_refused(tmp_path):
    """torch.save(model) (a pickled nn.Module, not a state_dict) needs unpickling: refused, told how to re-save."""
    path = tmp_path / "whole_model.pth"
    torch.save(torchvision.models.resnet18(num_classes=NUM_CLASSES), path)
    out = tmp_path / "out" / "model.ckpt"
    refuse(["--pth_path", str(path), "--ckpt_path", str(out)], out, str(path), "unpickle", "ResNet")


def _truncated(source: Path, target: Path) -> None:
    data = source.read_bytes()
    target.write_bytes(data[:len(data) // 2])


def _crc_broken(source: Path, target: Path) -> None:
    data = bytearray(source.read_bytes())
    middle = len(data) // 2  # inside a tensor's bytes: torch.load alone would not notice
    data[middle:middle + 64] = bytes(255 - b for b in data[middle:middle + 64])
    target.write_bytes(bytes(data))


@pytest.mark.parametrize("case, fragments", [
    ("missing", ["does not exist", "--pth_path"]),
    ("folder", ["does not exist", "it is a folder"]),
    ("empty", ["is empty (0 bytes)"]),
    ("text", ["damaged or not a PyTorch checkpoint"]),
    ("random_bytes", ["damaged or not a PyTorch checkpoint"]),
    ("mindspore_ckpt", ["damaged or not a PyTorch checkpoint"]),
    ("truncated", ["damaged or not a PyTorch checkpoint"]),
    ("crc_broken", ["is damaged", "does not match its CRC"]),
    ("not_a_state_dict", ["holds no state_dict"]),
])
@pytest.mark.slow
def test_unreadable_pth_is_refused(case, fragments, pth, tmp_path):
    """Missing, empty, foreign, truncated or corrupted inputs: one line naming the file, exit 2, nothing written."""
    path = tmp_path / f"{case}.pth"
    if case == "folder":
        path.mkdir()
    elif case == "empty":
        path.write_bytes(b"")
    elif case == "text":
        path.write_text("these are not weights\n")
    elif case == "random_bytes":
        path.write_bytes(np.random.default_rng(0).integers(0, 256, 5000, dtype=np.uint8).tobytes())
    elif case == "mindspore_ckpt":
        saved = tmp_path / "weights.ckpt"  # save_checkpoint insists on the .ckpt suffix; then renamed
        ms.save_checkpoint([{"name": "conv1.weight", "data": ms.Tensor(np.zeros((2, 2), np.float32))}], str(saved))
        saved.rename(path)
    elif case == "truncated":
        _truncated(pth, path)
    elif case == "crc_broken":
        _crc_broken(pth, path)
    elif case == "not_a_state_dict":
        torch.save([torch.zeros(3)], path)
    out = tmp_path / "out" / "model.ckpt"
    refuse(["--pth_path", str(path), "--ckpt_path", str(out)], out, str(path), *fragments)


def _edited(state, edit: str) -> "OrderedDict[str, torch.Tensor]":
    changed = OrderedDict(state)
    if edit == "names":
        del changed["layer1.0.bn1.running_mean"]
        changed["layer1.0.bn9.weight"] = torch.zeros(64)
    elif edit == "shape":
        changed["conv1.weight"] = torch.zeros(64, 3, 5, 5)
    return changed


@pytest.mark.parametrize("edit, args, fragments", [
    ("names", [], ["does not fit resnet18", "nothing was written", "layer1.0.bn9.weight",
                   "layer1.0.bn1.running_mean"]),
    ("shape", [], ["conv1.weight (64, 3, 5, 5) vs (64, 3, 7, 7)"]),
    ("none", ["--num_classes", "100"], ["10-class head", "--num_classes is 100", "--drop_head"]),
    ("none", ["--model_name", "resnet34"], ["holds resnet18 weights, not resnet34", "--model_name resnet18"]),
])
@pytest.mark.slow
def test_file_that_does_not_fit_is_refused(edit, args, fragments, state, tmp_path):
    """Unmatched names on either side (listed), a shape mismatch, a class count or architecture that disagrees
    with the file: refused in one line, nothing written."""
    path = tmp_path / "input.pth"
    torch.save(_edited(state, edit), path)
    out = tmp_path / "out" / "model.ckpt"
    refuse(["--pth_path", str(path), "--ckpt_path", str(out), *args], out, str(path), *fragments)


@pytest.mark.parametrize("args, fragments", [
    (["--model_name", "resnet42"], ["--model_name", "invalid choice: 'resnet42'"]),
    (["--num_classes", "abc"], ["--num_classes", "must be a whole number"]),
    (["--tolerance", "-1"], ["--tolerance", "must be 0 or more"]),
    (["--image_size", "16"], ["--image_size", "at least 32"]),
    (["--reverse", "--drop_head"], ["--drop_head applies to .pth -> .ckpt only"]),
])
def test_bad_options_are_refused_in_one_line(args, fragments, pth, tmp_path):
    out = tmp_path / "out" / "model.ckpt"
    refuse(["--pth_path", str(pth), "--ckpt_path", str(out), *args], out, *fragments)


def test_script_lists_the_project_architectures():
    """convert_pth.py names the architectures without importing MindSpore (fast refusals); they must stay
    src.resnet's."""
    import convert_pth
    from src.resnet import ARCHITECTURES
    assert convert_pth.ARCHITECTURES == tuple(ARCHITECTURES)


def test_missing_required_option_is_one_line(pth, tmp_path):
    refuse(["--pth_path", str(pth)], tmp_path / "out" / "x.ckpt", "the following arguments are required: --ckpt_path")


@pytest.mark.parametrize("case, fragments", [
    ("same_as_input", ["is the same file as the input"]),
    ("folder", ["is a folder"]),
    ("no_suffix", ["must end in .ckpt"]),
])
def test_bad_output_path_is_refused(case, fragments, pth, tmp_path):
    """The output may not be the input, a folder, or (MindSpore appends .ckpt) a name without .ckpt."""
    out = {"same_as_input": pth, "folder": tmp_path / "out", "no_suffix": tmp_path / "out" / "model"}[case]
    if case == "folder":
        out.mkdir()
    before = pth.read_bytes()
    refuse(["--pth_path", str(pth), "--ckpt_path", str(out)], tmp_path / "out" / "x", "--ckpt_path", str(out),
           *fragments)
    assert pth.read_bytes() == before


def test_verify_without_torchvision_is_refused(pth, tmp_path):
    """--verify where torchvision cannot be imported (a stand-in package that raises ImportError comes first on
    PYTHONPATH): one line, nothing written."""
    fake = tmp_path / "fake_site"
    (fake / "torchvision").mkdir(parents=True)
    (fake / "torchvision" / "__init__.py").write_text("raise ImportError('torchvision is not installed')\n")
    out = tmp_path / "out" / "model.ckpt"
    refuse(["--pth_path", str(pth), "--ckpt_path", str(out), "--verify"], out, "--verify needs torchvision",
           env={"PYTHONPATH": str(fake)})


@pytest.mark.slow
def test_verify_above_tolerance_exits_1_and_writes_nothing(pth, tmp_path):
    """A forced failure (tolerance 1e-12, below float32 rounding): exit code 1, one line with the measured
    differences, and the .ckpt does not get its name."""
    out = tmp_path / "out" / "model.ckpt"
    process = run_script(SCRIPT, ["--pth_path", str(pth), "--ckpt_path", str(out), "--verify", "--image_size", "32",
                                  "--tolerance", "1e-12"])
    assert process.returncode == 1, (process.stdout[-2000:], process.stderr[-2000:])
    assert "Traceback" not in process.stderr
    lines = [line for line in process.stderr.splitlines() if line.startswith("verify FAILED")]
    assert len(lines) == 1, process.stderr[-2000:]
    assert "max abs logit difference" in lines[0] and "tolerance 1e-12" in lines[0] and "was not written" in lines[0]
    measured = float(lines[0].split("max relative ")[1].split()[0])
    assert 1e-12 < measured < 1e-5  # a real float32 difference, not a mapping error
    assert files_under(out.parent) == []


@pytest.mark.parametrize("case, fragments", [
    ("damaged", ["is damaged", "cut off"]),
    ("no_head", ["has no fc head", "--drop_head"]),
    ("missing_parameter", ["does not fit resnet18", "layer2.0.bn1.moving_mean"]),
])
@pytest.mark.slow
def test_reverse_refusals(case, fragments, pth, tmp_path):
    """--reverse of a damaged .ckpt, of one converted with --drop_head, or of one lacking a parameter."""
    source = tmp_path / "source.ckpt"
    if case == "no_head":
        convert_pth_to_ckpt(str(pth), str(source), num_classes=100, drop_head=True)
    else:
        convert_pth_to_ckpt(str(pth), str(source))
    if case == "damaged":
        data = source.read_bytes()
        source.chmod(0o600)
        source.write_bytes(data[:len(data) // 3])
    elif case == "missing_parameter":
        arrays = ckpt_arrays(source)
        del arrays["layer2.0.bn1.moving_mean"]
        source.chmod(0o600)
        ms.save_checkpoint([{"name": k, "data": ms.Tensor(v)} for k, v in arrays.items()], str(source))
    out = tmp_path / "out" / "exported.pth"
    refuse(["--reverse", "--ckpt_path", str(source), "--pth_path", str(out)], out, str(source), *fragments)
