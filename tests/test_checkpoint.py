"""Checkpoint files: atomic writes, damage detection on read, and architecture/head checks on load."""
import functools
import os
import re
from pathlib import Path

import numpy as np
import pytest

import mindspore as ms

from conftest import one_line_user_error, temp_files
from src.errors import UserError
from src.resnet import build_resnet
from src.weights.files import link_or_copy_atomic, read_checkpoint, save_checkpoint_atomic
from src.weights.loading import load_weights_report, network_weights
from src.weights.names import describe_weights

# --------------------------------------------------------------------------------------------- helpers


@functools.lru_cache(maxsize=None)
def shared_net(model_name: str, class_num: int):
    """A network built once per module and only read from (never loaded into)."""
    return build_resnet(model_name, class_num)


def params_of(net) -> dict:
    """name -> numpy copy of every parameter of net."""
    return {p.name: p.asnumpy().copy() for p in net.get_parameters()}


def as_save_list(arrays: dict) -> list:
    """The list form save_checkpoint accepts: [{'name', 'data'}]."""
    return [{"name": name, "data": ms.Tensor(value)} for name, value in arrays.items()]


def read_user_error(path) -> str:
    with pytest.raises(UserError) as excinfo:
        read_checkpoint(str(path))
    return one_line_user_error(excinfo, str(path))


@pytest.fixture(scope="module")
def resnet18_10(tmp_path_factory):
    """(path, arrays) of a resnet18 10-class checkpoint written by save_checkpoint_atomic."""
    net = build_resnet("resnet18", 10)
    path = tmp_path_factory.mktemp("r18") / "resnet18-10.ckpt"
    save_checkpoint_atomic(net, str(path), append_dict={"epoch_num": 4})
    return path, params_of(net)


# ------------------------------------------------------------------------------- save_checkpoint_atomic


def test_save_checkpoint_atomic_writes_final_file_and_round_trips(tmp_path):
    rng = np.random.default_rng(0)
    arrays = {
        "dense.weight": rng.standard_normal((7, 5)).astype(np.float32),
        "dense.bias": rng.standard_normal(7).astype(np.float32),
        "counts": np.arange(-3, 9, dtype=np.int32),
        "half": rng.standard_normal((2, 3, 4)).astype(np.float16),
    }
    target = tmp_path / "sub" / "model.ckpt"  # the folder does not exist yet
    written = save_checkpoint_atomic(as_save_list(arrays), str(target),
                                     append_dict={"epoch_num": 7, "model_name": "resnet18"})

    assert Path(written) == target
    assert target.is_file() and target.stat().st_size > 0
    assert sorted(p.name for p in target.parent.iterdir()) == ["model.ckpt"]  # no temporary file left

    entries = read_checkpoint(str(target))
    assert set(entries) == set(arrays) | {"epoch_num", "model_name"}
    for name, value in arrays.items():
        loaded = entries[name].asnumpy()
        assert loaded.dtype == value.dtype, name
        np.testing.assert_array_equal(loaded, value)
    assert int(entries["epoch_num"].asnumpy()) == 7
    assert entries["model_name"] == "resnet18"


def test_save_checkpoint_atomic_from_a_cell_round_trips(tmp_path):
    net = shared_net("resnet18", 3)
    path = save_checkpoint_atomic(net, str(tmp_path / "net.ckpt"))
    entries = read_checkpoint(str(path))
    expected = params_of(net)
    assert set(expected) <= set(entries)
    for name, value in expected.items():
        np.testing.assert_array_equal(entries[name].asnumpy(), value)


def test_save_checkpoint_atomic_overwrites_and_interrupted_write_keeps_old_file(tmp_path, monkeypatch):
    target = tmp_path / "model.ckpt"
    save_checkpoint_atomic(as_save_list({"w": np.zeros(4, np.float32)}), str(target), {"epoch_num": 1})
    save_checkpoint_atomic(as_save_list({"w": np.ones(4, np.float32)}), str(target), {"epoch_num": 2})
    assert int(read_checkpoint(str(target))["epoch_num"].asnumpy()) == 2
    good_bytes = target.read_bytes()

    real_save = ms.save_checkpoint

    def crashing_save(source, file_name, *args, **kwargs):
        real_save(source, file_name, *args, **kwargs)
        with open(file_name, "r+b") as handle:  # half a file, then the process "dies"
            handle.truncate(os.path.getsize(file_name) // 2)
        raise KeyboardInterrupt

    monkeypatch.setattr(ms, "save_checkpoint", crashing_save)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint_atomic(as_save_list({"w": np.full(4, 3, np.float32)}), str(target), {"epoch_num": 3})
    monkeypatch.undo()

    assert target.read_bytes() == good_bytes  # the final name never held the half-written file
    np.testing.assert_array_equal(read_checkpoint(str(target))["w"].asnumpy(), np.ones(4, np.float32))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.ckpt"]  # the half-written file was removed
    save_checkpoint_atomic(as_save_list({"w": np.full(4, 5, np.float32)}), str(target))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.ckpt"]
    np.testing.assert_array_equal(read_checkpoint(str(target))["w"].asnumpy(), np.full(4, 5, np.float32))


# ---------------------------------------------------------------------------------- link_or_copy_atomic


def test_link_or_copy_atomic_gives_identical_bytes(tmp_path):
    source = tmp_path / "epoch001.ckpt"
    payload = os.urandom(10_000)
    source.write_bytes(payload)
    destination = tmp_path / "last.ckpt"
    link_or_copy_atomic(source, destination)
    assert destination.read_bytes() == payload
    assert source.read_bytes() == payload
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch001.ckpt", "last.ckpt"]


def test_link_or_copy_atomic_replaces_existing_destination(tmp_path):
    first, second = tmp_path / "epoch001.ckpt", tmp_path / "epoch002.ckpt"
    first.write_bytes(b"first checkpoint" * 100)
    second.write_bytes(b"second, longer checkpoint" * 300)
    destination = tmp_path / "best.ckpt"
    destination.write_bytes(b"stale")
    link_or_copy_atomic(first, destination)
    assert destination.read_bytes() == first.read_bytes()
    link_or_copy_atomic(second, destination)
    assert destination.read_bytes() == second.read_bytes()
    assert first.read_bytes() == b"first checkpoint" * 100  # replacing a link does not write through it
    # The epoch file can be deleted (keep_checkpoint_max) and the destination still holds the data.
    second_bytes = second.read_bytes()
    second.unlink()
    assert destination.read_bytes() == second_bytes


def test_link_or_copy_atomic_twice_with_the_same_pair_leaves_no_staging_file(tmp_path):
    source, destination = tmp_path / "epoch001.ckpt", tmp_path / "last.ckpt"
    source.write_bytes(b"weights" * 100)
    link_or_copy_atomic(source, destination)
    link_or_copy_atomic(source, destination)  # destination is already a link to source
    assert destination.read_bytes() == source.read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch001.ckpt", "last.ckpt"]
    assert temp_files(tmp_path) == []


def test_link_or_copy_atomic_real_checkpoint_reads_back(tmp_path, resnet18_10):
    path, arrays = resnet18_10
    destination = tmp_path / "resnet18-last.ckpt"
    link_or_copy_atomic(path, destination)
    entries = read_checkpoint(str(destination))
    np.testing.assert_array_equal(entries["fc.weight"].asnumpy(), arrays["fc.weight"])


# -------------------------------------------------------------------------------- read_checkpoint errors


def test_read_checkpoint_missing_file(tmp_path):
    message = read_user_error(tmp_path / "nope.ckpt")
    assert "does not exist" in message


def test_read_checkpoint_empty_path_is_user_error():
    with pytest.raises(UserError) as excinfo:
        read_checkpoint("")
    one_line_user_error(excinfo, "--checkpoint_path")


def test_read_checkpoint_empty_file(tmp_path):
    path = tmp_path / "empty.ckpt"
    path.write_bytes(b"")
    message = read_user_error(path)
    assert "empty" in message


def test_read_checkpoint_truncated_file(tmp_path, resnet18_10):
    source, _ = resnet18_10
    path = tmp_path / "truncated.ckpt"
    with open(source, "rb") as handle:
        path.write_bytes(handle.read(100))
    read_user_error(path)


@pytest.mark.parametrize("garbage", [
    b"this is not a checkpoint\n" * 40,
    bytes(range(256)) * 8,
    bytes(2048),
    b"\x89PNG\r\n\x1a\n" + bytes(200),
], ids=["text", "byte-ramp", "zeros", "png-header"])
def test_read_checkpoint_garbage_bytes(tmp_path, garbage):
    path = tmp_path / "garbage.ckpt"
    path.write_bytes(garbage)
    read_user_error(path)


def test_read_checkpoint_detects_flipped_byte_in_tensor_data(tmp_path, resnet18_10):
    source, arrays = resnet18_10
    raw = source.read_bytes()
    name = "layer1.0.conv1.weight"
    data = arrays[name].tobytes()
    start = raw.find(data[:256])
    assert start > 0 and raw.find(data[:256], start + 1) == -1, "tensor bytes not found once in the file"
    assert raw[start:start + len(data)] == data, "tensor not stored contiguously"
    damaged = bytearray(raw)
    damaged[start + len(data) // 2] ^= 0x40  # one bit of one float in the middle of the tensor
    path = tmp_path / "bitrot.ckpt"
    path.write_bytes(bytes(damaged))

    # The premise: without the CRC the damage goes unnoticed and a wrong weight is loaded.
    silent = ms.load_checkpoint(str(path), crc_check=False)
    changed = silent[name].asnumpy() != arrays[name]
    assert changed.sum() == 1

    read_user_error(path)


# ---------------------------------------------------------------- network_weights / load_weights_report


@pytest.mark.slow
def test_load_resnet18_checkpoint_into_resnet50_names_architecture(resnet18_10):
    path, _ = resnet18_10
    net = shared_net("resnet50", 10)
    before = net.conv1.weight.asnumpy().copy()
    with pytest.raises(UserError) as excinfo:
        load_weights_report(net, str(path), "resnet50")
    message = one_line_user_error(excinfo, str(path), "resnet18", "--model_name")
    assert "--model_name resnet18" in message
    np.testing.assert_array_equal(net.conv1.weight.asnumpy(), before)  # conv1 shapes agree; still untouched


def test_load_10_class_checkpoint_into_5_class_net_names_class_counts(resnet18_10):
    path, arrays = resnet18_10
    net = build_resnet("resnet18", 5)
    before = net.conv1.weight.asnumpy().copy()
    with pytest.raises(UserError) as excinfo:
        load_weights_report(net, str(path), "resnet18")
    message = one_line_user_error(excinfo, str(path), "--class_num")
    rest = message.replace(str(path), "")
    assert re.search(r"\b10\b", rest) and re.search(r"\b5\b", rest), message
    assert "--class_num 10" in message
    # The network is checked before it is touched: no weight was loaded.
    np.testing.assert_array_equal(net.conv1.weight.asnumpy(), before)
    assert not np.array_equal(before, arrays["conv1.weight"])


def test_load_weights_ignores_optimizer_entries_and_loads_weights(tmp_path):
    rng = np.random.default_rng(1)
    source = build_resnet("resnet18", 4)
    arrays = params_of(source)
    # Non-default BatchNorm statistics, so the non-trainable parameters are checked as well.
    arrays["bn1.moving_mean"] = rng.standard_normal(64).astype(np.float32)
    arrays["layer3.1.bn2.moving_variance"] = rng.uniform(0.5, 2.0, 256).astype(np.float32)
    extras = {
        "moment1.conv1.weight": rng.standard_normal(arrays["conv1.weight"].shape).astype(np.float32),
        "moment2.fc.weight": rng.standard_normal(arrays["fc.weight"].shape).astype(np.float32),
        "global_step": np.array([123], np.int32),
    }
    path = tmp_path / "train-state.ckpt"
    save_checkpoint_atomic(as_save_list({**arrays, **extras}), str(path), append_dict={"epoch_num": 3})

    net = build_resnet("resnet18", 4)
    assert not np.array_equal(net.conv1.weight.asnumpy(), arrays["conv1.weight"])
    entries = load_weights_report(net, str(path), "resnet18").entries

    assert {"moment1.conv1.weight", "global_step", "epoch_num"} <= set(entries)
    loaded = params_of(net)
    assert set(loaded) == set(arrays)
    for name, value in arrays.items():
        np.testing.assert_array_equal(loaded[name], value, err_msg=name)
    assert "moment1.conv1.weight" not in loaded


def test_network_weights_returns_only_network_entries(resnet18_10):
    path, arrays = resnet18_10
    entries = read_checkpoint(str(path))
    assert "epoch_num" in entries
    weights = network_weights(entries, shared_net("resnet18", 10), str(path), "resnet18")
    assert set(weights) == set(arrays)


@pytest.mark.parametrize("dropped", ["layer2.1.bn1.moving_variance", "layer4.1.conv2.weight", "fc.bias"])
def test_load_weights_refuses_checkpoint_missing_a_parameter(tmp_path, resnet18_10, dropped):
    _, arrays = resnet18_10
    kept = {name: value for name, value in arrays.items() if name != dropped}
    path = tmp_path / "incomplete.ckpt"
    save_checkpoint_atomic(as_save_list(kept), str(path))
    assert describe_weights(read_checkpoint(str(path))) == ("resnet18", 10)  # otherwise it fits

    net = shared_net("resnet18", 10)
    before = params_of(net)
    with pytest.raises(UserError) as excinfo:
        load_weights_report(net, str(path), "resnet18")
    message = one_line_user_error(excinfo, str(path), dropped, "missing")
    assert "--model_name" not in message and "--class_num" not in message
    after = params_of(net)
    for name in before:
        np.testing.assert_array_equal(after[name], before[name], err_msg=name)


def test_network_weights_refuses_shape_mismatch(resnet18_10):
    path, _ = resnet18_10
    entries = dict(read_checkpoint(str(path)))
    entries["layer2.0.conv2.weight"] = ms.Tensor(np.zeros((128, 128, 1, 1), np.float32))
    with pytest.raises(UserError) as excinfo:
        network_weights(entries, shared_net("resnet18", 10), str(path), "resnet18")
    one_line_user_error(excinfo, str(path), "layer2.0.conv2.weight", "shape mismatch")


# ------------------------------------------------------------------------------------- describe_weights


@pytest.mark.parametrize("model_name, class_num", [
    ("resnet18", 10), pytest.param("resnet34", 3, marks=pytest.mark.slow), ("resnet50", 10),
    pytest.param("resnet101", 7, marks=pytest.mark.slow), pytest.param("resnet152", 2, marks=pytest.mark.slow),
])
def test_describe_weights_identifies_architecture_and_class_count(model_name, class_num):
    params = shared_net(model_name, class_num).parameters_dict()
    assert describe_weights(params) == (model_name, class_num)
    # Only the names matter, and the shape of fc.weight.
    names_only = {name: None for name in params}
    names_only["fc.weight"] = np.empty(params["fc.weight"].shape, np.float32)
    assert describe_weights(names_only) == (model_name, class_num)


def test_describe_weights_unknown():
    assert describe_weights({}) == (None, None)
    assert describe_weights({"dense.weight": np.zeros((3, 4))}) == (None, None)
    # resnet18's layout with one block removed is no known architecture; the head still tells the classes.
    params = shared_net("resnet18", 10).parameters_dict()
    partial = {name: value for name, value in params.items() if not name.startswith("layer4.1.")}
    assert describe_weights(partial) == (None, 10)
