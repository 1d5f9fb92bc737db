"""train.py --pretrained: the registry, downloads (from a local HTTP server serving generated files), the cache,
SHA-256 pins, head re-initialisation, and each refusal, in-process and through train.py / eval.py.

Nothing here reaches the internet: every file is generated in the test and served from an http.server bound to
127.0.0.1; the registry entries under test point there.
"""
import hashlib
import logging
import re
from pathlib import Path
from typing import Dict, List

import numpy as np
import pytest
import yaml

import mindspore as ms

from conftest import (FAST_ARGS, assert_one_line_error, flip_one_byte, one_line_user_error, read_ckpt_entries,
                      run_script)
from local_http import NO_PROXY, LocalServer, no_proxy_for_localhost  # noqa: F401 (an autouse fixture)
from src.errors import UserError
from src.model_utils.config import load_config
from src.resnet import build_resnet
from src.weights.pretrained import (REGISTRY_PATH, download_weights, fetch, hash_in_file_name, load_pretrained,
                                    read_registry, resolve_pretrained)

LOGGER_NAME = "test_pretrained"


# ------------------------------------------------------------------------------ a local HTTP server


@pytest.fixture
def server():
    local = LocalServer()
    yield local
    local.close()


@pytest.fixture
def logger(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER_NAME)
    return logging.getLogger(LOGGER_NAME)


def sha256_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def files_in(folder: Path) -> List[str]:
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


@pytest.fixture(scope="module")
def torchvision_pth(tmp_path_factory):
    """(bytes, path) of a torchvision resnet18 state_dict with the ImageNet head (1000 classes), as released."""
    torch = pytest.importorskip("torch")
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.resnet18()  # 1000 classes
    path = tmp_path_factory.mktemp("pth") / "resnet18-imagenet.pth"
    torch.save(model.state_dict(), path)
    return path.read_bytes(), path


def config_for(*args: str):
    return load_config(["--model_name", "resnet18", "--class_num", "10", *args])


# ------------------------------------------------------------------------------------------- the registry


def test_registry_lists_torchvisions_imagenet_weights_with_their_hash_prefixes():
    registry = read_registry()
    models = registry["torchvision_imagenet"]
    assert sorted(models) == ["resnet101", "resnet152", "resnet18", "resnet34", "resnet50"]
    for model_name, entry in models.items():
        assert re.fullmatch(rf"https://download\.pytorch\.org/models/{model_name}-[0-9a-f]{{8}}\.pth", entry.url)
        assert entry.sha256_prefix == hash_in_file_name(entry.url) and entry.num_classes == 1000
    raw = yaml.safe_load(REGISTRY_PATH.read_text())
    assert raw["torchvision_imagenet"]["models"]["resnet50"]["imagenet_top1"] == pytest.approx(76.13)


def test_registry_matches_the_installed_torchvision():
    resnet = pytest.importorskip("torchvision.models.resnet")
    models = read_registry()["torchvision_imagenet"]
    for model_name, enum in [("resnet18", "ResNet18_Weights"), ("resnet34", "ResNet34_Weights"),
                             ("resnet50", "ResNet50_Weights"), ("resnet101", "ResNet101_Weights"),
                             ("resnet152", "ResNet152_Weights")]:
        weights = getattr(resnet, enum).IMAGENET1K_V1
        assert models[model_name].url == weights.url
        assert weights.meta["_metrics"]["ImageNet-1K"]["acc@1"] == pytest.approx(
            yaml.safe_load(REGISTRY_PATH.read_text())["torchvision_imagenet"]["models"][model_name]["imagenet_top1"])


@pytest.mark.parametrize("name, expected", [
    ("resnet18-f37072fd.pth", "f37072fd"), ("resnet50-0676ba61.pth.tar", "0676ba61"),
    ("resnet-50.pth", ""), ("model-best.ckpt", ""), ("resnet50.pth", ""), ("weights-abc1234.pth", ""),
])
def test_hash_in_file_name(name, expected):
    assert hash_in_file_name(name) == expected


def test_broken_registry_file_is_one_line(tmp_path, logger):
    registry = tmp_path / "registry.yaml"
    registry.write_text("torchvision_imagenet:\n  models:\n    resnet18: {url: x}\n")
    with pytest.raises(UserError) as excinfo:
        resolve_pretrained("torchvision_imagenet", "resnet18", str(tmp_path), "", logger, registry)
    one_line_user_error(excinfo, str(registry), "sha256_prefix")


# ------------------------------------------------------------------------------------- downloads and the cache


def test_download_with_hash_in_name_is_verified_and_cached(server, tmp_path, logger, caplog):
    data = np.random.default_rng(1).bytes(3 * (1 << 20) + 5)  # more than one read chunk
    name = f"weights-{sha256_of(data)[:8]}.pth"
    url = server.serve(data, name)
    cache = tmp_path / "cache"

    path, still = resolve_pretrained(url, "resnet18", str(cache), "", logger)

    assert Path(path) == cache / name and Path(path).read_bytes() == data and still == ""
    assert files_in(cache) == [name]  # no temporary file left
    assert "verified" in caplog.text
    # Second time: from the cache, checked again, no request.
    resolve_pretrained(url, "resnet18", str(cache), "", logger)
    assert server.requests == [f"/{name}"]
    assert "using cached" in caplog.text


def test_damaged_download_is_refused_and_removed(server, tmp_path, logger):
    data = np.random.default_rng(2).bytes(100_000)
    name = f"weights-{sha256_of(data)[:8]}.pth"
    url = server.serve(flip_one_byte(data), name)
    cache = tmp_path / "cache"
    with pytest.raises(UserError) as excinfo:
        resolve_pretrained(url, "resnet18", str(cache), "", logger)
    one_line_user_error(excinfo, url, "SHA-256", sha256_of(data)[:8], "removed")
    assert files_in(cache) == []


def test_truncated_download_is_refused_and_removed(server, tmp_path, logger):
    data = np.random.default_rng(3).bytes(50_000)
    url = server.serve(data, "weights.pth", declared_length=len(data) + 1000)
    cache = tmp_path / "cache"
    with pytest.raises(UserError) as excinfo:
        resolve_pretrained(url, "resnet18", str(cache), sha256_of(data), logger)
    one_line_user_error(excinfo, url)
    assert files_in(cache) == []


def test_missing_url_is_refused(server, tmp_path, logger):
    with pytest.raises(UserError) as excinfo:
        resolve_pretrained(server.url("nothing-here.pth"), "resnet18", str(tmp_path / "cache"), "", logger)
    one_line_user_error(excinfo, server.url("nothing-here.pth"), "Not Found", "--pretrained FILE")
    assert files_in(tmp_path / "cache") == []


def test_checkpoint_sha256_pins_a_download_and_wins_over_the_name(server, tmp_path, logger):
    data = np.random.default_rng(4).bytes(20_000)
    # A name whose hex digits are not this file's SHA-256 (e.g. another hash): the pin decides.
    url = server.serve(data, "weights-0123abcd.pth")
    path, _ = resolve_pretrained(url, "resnet18", str(tmp_path / "a"), sha256_of(data), logger)
    assert Path(path).read_bytes() == data
    wrong = sha256_of(b"something else")
    with pytest.raises(UserError) as excinfo:
        resolve_pretrained(url, "resnet18", str(tmp_path / "b"), wrong, logger)
    one_line_user_error(excinfo, url, sha256_of(data), wrong)
    assert files_in(tmp_path / "b") == []


def test_download_without_any_hash_logs_its_digest(server, tmp_path, logger, caplog):
    data = b"weights without a published hash" * 100
    url = server.serve(data, "weights.pth")
    resolve_pretrained(url, "resnet18", str(tmp_path), "", logger)
    assert f"--checkpoint_sha256 {sha256_of(data)}" in caplog.text


def test_damaged_cached_file_is_refused_and_left_for_inspection(server, tmp_path, logger):
    data = b"good weights" * 1000
    name = f"weights-{sha256_of(data)[:8]}.pth"
    url = server.serve(data, name)
    (tmp_path / name).write_bytes(flip_one_byte(data))
    with pytest.raises(UserError) as excinfo:
        fetch(url, str(tmp_path), sha256_of(data)[:8], logger)
    one_line_user_error(excinfo, str(tmp_path / name), "delete it")
    assert server.requests == [] and (tmp_path / name).read_bytes() == flip_one_byte(data)


def test_interrupted_download_leaves_no_partial_file(server, tmp_path, logger, monkeypatch):
    url = server.serve(b"x" * (3 << 20), "weights.pth")
    real_sha256 = hashlib.sha256

    class Interrupting:
        def __init__(self):
            self.inner, self.calls = real_sha256(), 0

        def update(self, chunk):
            self.calls += 1
            if self.calls == 2:
                raise KeyboardInterrupt
            self.inner.update(chunk)

    monkeypatch.setattr("src.download.hashlib.new", lambda algorithm: Interrupting())
    with pytest.raises(KeyboardInterrupt):
        download_weights(url, tmp_path / "weights.pth", "", logger)
    assert files_in(tmp_path) == []


def test_unwritable_cache_dir_is_one_line(server, tmp_path, logger):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    url = server.serve(b"data", "weights.pth")
    with pytest.raises(UserError) as excinfo:
        resolve_pretrained(url, "resnet18", str(blocker / "cache"), "", logger)
    one_line_user_error(excinfo, "pretrained_cache_dir")


# ------------------------------------------------------------------------------------ the registry route


@pytest.fixture
def local_registry(tmp_path, server, torchvision_pth):
    """A registry like the real one whose torchvision_imagenet resnet18 points at the local server."""
    data, _ = torchvision_pth
    prefix = sha256_of(data)[:8]
    url = server.serve(data, f"resnet18-{prefix}.pth")
    path = tmp_path / "registry.yaml"
    path.write_text(yaml.safe_dump({"torchvision_imagenet": {
        "description": "local copy", "num_classes": 1000,
        "models": {"resnet18": {"url": url, "sha256_prefix": prefix}}}}))
    return path, url, prefix


def test_registry_name_downloads_verifies_converts_and_reinitialises_the_head(local_registry, tmp_path, logger,
                                                                               caplog, torchvision_pth):
    torch = pytest.importorskip("torch")
    registry, url, prefix = local_registry
    cache = tmp_path / "cache"
    config = config_for("--pretrained", "torchvision_imagenet", "--pretrained_cache_dir", str(cache))
    net = build_resnet("resnet18", 10)
    fresh_fc = net.fc.weight.asnumpy().copy()

    report = load_pretrained(net, config, logger, registry_path=registry)

    assert report.fmt == "torch" and report.new_head
    assert files_in(cache) == [f"resnet18-{prefix}.pth"]
    state = torch.load(torchvision_pth[1], weights_only=True)
    np.testing.assert_array_equal(net.layer1[0].conv1.weight.asnumpy(), state["layer1.0.conv1.weight"].numpy())
    np.testing.assert_array_equal(net.layer4[1].bn2.moving_variance.asnumpy(),
                                  state["layer4.1.bn2.running_var"].numpy())
    np.testing.assert_array_equal(net.fc.weight.asnumpy(), fresh_fc)
    log = caplog.text
    assert url in log and "verified" in log and "1000-class head, this run has 10 classes" in log


def test_registry_has_no_entry_for_the_model(local_registry, tmp_path, logger):
    registry, _, _ = local_registry
    with pytest.raises(UserError) as excinfo:
        resolve_pretrained("torchvision_imagenet", "resnet50", str(tmp_path), "", logger, registry)
    one_line_user_error(excinfo, "resnet50", "resnet18")


def test_pin_contradicting_the_registry_is_refused_before_downloading(local_registry, server, tmp_path, logger):
    registry, _, prefix = local_registry
    other = ("1" if prefix[0] == "0" else "0") + prefix[1:]
    with pytest.raises(UserError) as excinfo:
        resolve_pretrained("torchvision_imagenet", "resnet18", str(tmp_path), other, logger, registry)
    one_line_user_error(excinfo, other, prefix)
    assert server.requests == []


@pytest.mark.parametrize("value, fragments", [
    ("imagenet", ["unknown --pretrained value 'imagenet'", "torchvision_imagenet"]),
    ("torchvision_imagenett", ["did you mean torchvision_imagenet?"]),
    ("weights/missing.ckpt", ["--pretrained file weights/missing.ckpt does not exist"]),
])
def test_unknown_pretrained_values_are_one_line(tmp_path, logger, value, fragments):
    with pytest.raises(UserError) as excinfo:
        resolve_pretrained(value, "resnet18", str(tmp_path), "", logger)
    one_line_user_error(excinfo, *fragments)


# ------------------------------------------------------------------------------- load_pretrained and --resume


def test_local_file_with_same_class_count_loads_the_head(tmp_path, logger):
    source = build_resnet("resnet18", 10)
    path = tmp_path / "mine.ckpt"
    ms.save_checkpoint(source, str(path))
    net = build_resnet("resnet18", 10)
    report = load_pretrained(net, config_for("--pretrained", str(path)), logger)
    assert report.fmt == "ours" and not report.new_head
    np.testing.assert_array_equal(net.fc.weight.asnumpy(), source.fc.weight.asnumpy())


def test_local_file_pin_mismatch_is_refused(tmp_path, logger):
    path = tmp_path / "mine.ckpt"
    ms.save_checkpoint(build_resnet("resnet18", 10), str(path))
    with pytest.raises(UserError) as excinfo:
        load_pretrained(build_resnet("resnet18", 10), config_for("--pretrained", str(path), "--checkpoint_sha256",
                                                                 "ab" * 32), logger)
    one_line_user_error(excinfo, str(path), "ab" * 32)


def test_resume_file_is_checked_against_the_pin_and_pretrained_is_skipped(tmp_path, logger, caplog):
    path = tmp_path / "resnet18-last.ckpt"
    ms.save_checkpoint(build_resnet("resnet18", 10), str(path))
    digest = sha256_of(path.read_bytes())
    net = build_resnet("resnet18", 10)
    assert load_pretrained(net, config_for("--resume", str(path), "--pretrained", "torchvision_imagenet",
                                           "--checkpoint_sha256", digest[:16]), logger) is None
    assert "not loaded" in caplog.text and digest in caplog.text
    with pytest.raises(UserError) as excinfo:
        load_pretrained(net, config_for("--resume", str(path), "--checkpoint_sha256", "0" * 16), logger)
    one_line_user_error(excinfo, str(path), digest)


def test_resume_from_a_pth_is_refused(torchvision_pth, logger):
    _, path = torchvision_pth
    with pytest.raises(UserError) as excinfo:
        load_pretrained(build_resnet("resnet18", 10), config_for("--resume", str(path)), logger)
    one_line_user_error(excinfo, str(path), f"--pretrained {path}")


def test_pin_without_a_file_to_check_is_refused(logger):
    with pytest.raises(UserError) as excinfo:
        load_pretrained(build_resnet("resnet18", 10), config_for("--checkpoint_sha256", "0" * 64), logger)
    one_line_user_error(excinfo, "checkpoint_sha256", "--pretrained")


def test_nothing_to_do_without_pretrained(logger):
    assert load_pretrained(build_resnet("resnet18", 10), config_for(), logger) is None


# ---------------------------------------------------------------------------------- train.py / eval.py


def tiny_train_args(cifar_dir: Path, out: Path) -> List[str]:
    return ["--data_path", str(cifar_dir), "--output_path", str(out), "--model_name", "resnet18", "--class_num", "10",
            "--epoch_size", "1", "--batch_size", "8", "--train_num_samples", "16", "--eval_num_samples", "8",
            *FAST_ARGS]


@pytest.fixture(scope="module")
def finetuned(cifar_dir, torchvision_pth, tmp_path_factory):
    """train.py --pretrained <torchvision resnet18 .pth with 1000 classes> --class_num 10, one tiny epoch."""
    _, pth = torchvision_pth
    out = tmp_path_factory.mktemp("finetune")
    process = run_script("train.py", tiny_train_args(cifar_dir, out) + ["--pretrained", str(pth)])
    assert process.returncode == 0, (process.stdout[-3000:], process.stderr[-3000:])
    return out, process


@pytest.mark.slow
def test_train_from_a_torchvision_pth_reinitialises_the_head_and_trains(finetuned, torchvision_pth):
    torch = pytest.importorskip("torch")
    out, process = finetuned
    log = (out / "train.log").read_text()
    assert "PyTorch/torchvision state_dict, names converted in memory" in log
    assert "has a 1000-class head, this run has 10 classes" in log and "re-initialised head" in log
    assert "epoch 1/1 step 2/2 loss" in log
    assert (out / "metrics.csv").read_text().count("\n") == 2
    trained = read_ckpt_entries(out / "resnet18-last.ckpt")
    assert tuple(trained["fc.weight"].shape) == (10, 512)
    # The backbone started from the .pth: after two small steps it is still close to it.
    state = torch.load(torchvision_pth[1], weights_only=True)
    before = state["layer3.0.conv1.weight"].numpy().ravel()
    after = trained["layer3.0.conv1.weight"].asnumpy().ravel()
    assert np.corrcoef(before, after)[0, 1] > 0.99


@pytest.mark.slow
def test_resume_with_a_wrong_pin_fails_in_one_line(finetuned, cifar_dir, tmp_path):
    out, _ = finetuned
    last = out / "resnet18-last.ckpt"
    process = run_script("train.py", tiny_train_args(cifar_dir, tmp_path) +
                         ["--resume", str(last), "--epoch_size", "2", "--checkpoint_sha256", "0" * 64])
    assert_one_line_error(process, str(last), sha256_of(last.read_bytes()))
    assert list(tmp_path.glob("*.ckpt")) == []


@pytest.mark.slow
def test_train_refuses_a_damaged_download_in_one_line(server, cifar_dir, tmp_path, torchvision_pth):
    data, _ = torchvision_pth
    prefix = sha256_of(data)[:8]
    url = server.serve(flip_one_byte(data), f"resnet18-{prefix}.pth")
    cache = tmp_path / "cache"
    process = run_script("train.py", tiny_train_args(cifar_dir, tmp_path / "out") +
                         ["--pretrained", url, "--pretrained_cache_dir", str(cache)], env=NO_PROXY)
    assert_one_line_error(process, url, "SHA-256", prefix, "removed")
    assert server.requests == [f"/resnet18-{prefix}.pth"]
    assert files_in(cache) == []  # no weights file, no temporary file
    assert list(tmp_path.rglob("*.ckpt")) == [] and not (tmp_path / "out" / "metrics.csv").exists()


@pytest.mark.slow
def test_train_refuses_a_pin_mismatch_in_one_line(cifar_dir, tmp_path, torchvision_pth):
    data, pth = torchvision_pth
    wrong = ("0" if sha256_of(data)[0] != "0" else "1") * 64
    process = run_script("train.py", tiny_train_args(cifar_dir, tmp_path) +
                         ["--pretrained", str(pth), "--checkpoint_sha256", wrong])
    assert_one_line_error(process, str(pth), sha256_of(data), wrong, "--checkpoint_sha256")
    assert list(tmp_path.glob("*.ckpt")) == []


@pytest.mark.slow
def test_train_refuses_an_unknown_pretrained_value_in_one_line(cifar_dir, tmp_path):
    process = run_script("train.py", tiny_train_args(cifar_dir, tmp_path) + ["--pretrained", "imagenet"])
    assert_one_line_error(process, "unknown --pretrained value 'imagenet'", "torchvision_imagenet")
    assert list(tmp_path.glob("*.ckpt")) == []


@pytest.mark.slow
def test_train_refuses_a_damaged_cached_registry_file_without_the_network(cifar_dir, tmp_path):
    entry = read_registry()["torchvision_imagenet"]["resnet18"]
    cache = tmp_path / "cache"
    cache.mkdir()
    cached = cache / Path(entry.url).name
    cached.write_bytes(b"half of an old download")
    process = run_script("train.py", tiny_train_args(cifar_dir, tmp_path / "out") +
                         ["--pretrained", "torchvision_imagenet", "--pretrained_cache_dir", str(cache)])
    assert_one_line_error(process, str(cached), entry.sha256_prefix, "delete it")
    assert cached.read_bytes() == b"half of an old download"


def _zoo_named(params: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
    """This project's resnet18 names as the models zoo's resnet18 names them (end_point, bn1d/bn2d,
    down_sample_layer)."""
    renamed = {}
    for name, value in params.items():
        name = re.sub(r"^fc\.", "end_point.", name)
        name = name.replace(".downsample.", ".down_sample_layer.")
        name = re.sub(r"(layer\d\.\d+)\.bn([12])\.", r"\1.bn\2d.", name)
        renamed[name] = value
    return renamed


@pytest.mark.slow
def test_eval_refuses_a_foreign_head_mismatch_in_one_line(cifar_dir, tmp_path):
    params = {p.name: p.asnumpy() for p in build_resnet("resnet18", 1000).get_parameters()}
    zoo = _zoo_named(params)
    assert "layer1.0.bn1d.gamma" in zoo and "layer2.0.down_sample_layer.1.gamma" in zoo
    path = tmp_path / "zoo-resnet18-imagenet.ckpt"
    ms.save_checkpoint([{"name": n, "data": ms.Tensor(v)} for n, v in zoo.items()], str(path),
                       append_dict={"epoch_num": 90, "step_num": 450360})
    process = run_script("eval.py", ["--data_path", str(cifar_dir), "--output_path", str(tmp_path / "out"),
                                     "--model_name", "resnet18", "--checkpoint_path", str(path), *FAST_ARGS])
    assert_one_line_error(process, str(path), "1000-class head", "--class_num 1000")
    assert not (tmp_path / "out" / "eval_result.json").exists()


@pytest.mark.slow
def test_eval_takes_a_torchvision_pth_with_a_pin(cifar_dir, tmp_path):
    torch = pytest.importorskip("torch")
    torchvision = pytest.importorskip("torchvision")
    path = tmp_path / "resnet18-cifar.pth"
    torch.save(torchvision.models.resnet18(num_classes=10).state_dict(), path)
    prefix = sha256_of(path.read_bytes())[:16]
    process = run_script("eval.py", ["--data_path", str(cifar_dir), "--output_path", str(tmp_path / "out"),
                                     "--model_name", "resnet18", "--checkpoint_path", str(path),
                                     "--checkpoint_sha256", prefix, "--eval_num_samples", "16", *FAST_ARGS])
    assert process.returncode == 0, process.stderr[-3000:]
    assert "PyTorch/torchvision state_dict, names converted in memory" in (tmp_path / "out" / "eval.log").read_text()
    assert (tmp_path / "out" / "eval_result.json").is_file()
