"""The recipe configs, the DIGITS proxy data and the script that compares recipes on it."""
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import REPO, assert_one_line_error, read_metrics, run_script

RECIPES = sorted((REPO / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", RECIPES, ids=lambda path: path.name)
def test_every_config_loads_and_says_what_it_is(path):
    from src.model_utils.config import load_config
    config = load_config(["--config_path", str(path)])
    header = path.read_text(encoding="utf-8").split("\n\n")[0]
    assert f"python train.py --config_path configs/{path.name}" in header  # how to run it
    assert config.is_set("output_path")  # each recipe writes into its own folder
    if path.name.startswith("cifar10_"):
        # Recipes name their published source and say what was and was not measured here.
        assert "kuangliu/pytorch-cifar" in header and "Measured here: NOT on CIFAR-10" in header
        assert "docs/recipes.md" in header
        assert config.stem == "cifar" and (config.image_height, config.image_width) == (32, 32)


@pytest.fixture(scope="module")
def digits_dir(tmp_path_factory) -> Path:
    from src.digits_proxy import write_digits_cifar
    return write_digits_cifar(str(tmp_path_factory.mktemp("proxy") / "digits"))


def _records(path: Path) -> np.ndarray:
    return np.fromfile(path, np.uint8).reshape(-1, 3073)


def test_digits_proxy_holds_the_real_digits_once_then_repeats(digits_dir):
    from sklearn.datasets import load_digits
    from src.dataset import cifar_files
    from src.digits_proxy import TEST_IMAGES, TRAIN_IMAGES
    train, test = _records(digits_dir / "data_batch_1.bin"), _records(digits_dir / "test_batch.bin")
    assert len(train) == len(test) == 10000  # MindSpore's reader needs full files
    assert cifar_files(str(digits_dir), training=True) and cifar_files(str(digits_dir), training=False)
    for records, count in ((train, TRAIN_IMAGES), (test, TEST_IMAGES)):
        assert np.array_equal(records[count:2 * count], records[:count])  # repeated in order
        planes = records[:count, 1:].reshape(count, 3, 1024)
        assert np.array_equal(planes[:, 0], planes[:, 1]) and np.array_equal(planes[:, 0], planes[:, 2])  # grey
    # A stratified split of all 1,797 digits: every class in both parts, in the same proportions.
    everything = load_digits()
    assert TRAIN_IMAGES + TEST_IMAGES == len(everything.images)
    assert np.abs(np.bincount(test[:TEST_IMAGES, 0]) - TEST_IMAGES / 10).max() <= 2
    assert np.array_equal(np.bincount(train[:TRAIN_IMAGES, 0]) + np.bincount(test[:TEST_IMAGES, 0]),
                          np.bincount(everything.target))
    # Each record is one of the 8x8 digits scaled to 0-255 and resized bilinearly (as torch's interpolate does it).
    import torch
    for record in train[:3]:
        grey = record[1:1025].reshape(32, 32).astype(np.float64)
        nearest = np.abs(everything.images - grey.reshape(8, 4, 8, 4).mean(axis=(1, 3)) * 16 / 255).mean(axis=(1, 2))
        source = torch.tensor(everything.images[nearest.argmin()] * 255 / 16, dtype=torch.float32)[None, None]
        expected = torch.nn.functional.interpolate(source, size=(32, 32), mode="bilinear", align_corners=False)
        assert np.abs(expected[0, 0].numpy() - grey).max() <= 1.0  # uint8 rounding
        assert everything.target[nearest.argmin()] == record[0]


@pytest.mark.slow
def test_compare_script_runs_train_py_and_reuses_finished_runs(digits_dir, tmp_path):
    args = ["--epochs", "1", "--runs", "reference_imagenet", "--data_path", str(digits_dir),
            "--output_path", str(tmp_path / "cmp")]
    process = run_script("scripts/compare_recipes_on_digits.py", args)
    assert process.returncode == 0, process.stdout[-2000:] + process.stderr[-2000:]
    assert "NOT CIFAR-10" in process.stdout and "| reference_imagenet |" in process.stdout
    result, = json.loads((tmp_path / "cmp" / "comparison.json").read_text())
    _, metrics = read_metrics(tmp_path / "cmp" / "reference_imagenet")
    assert result["final_top1"] == pytest.approx(float(metrics[-1]["top1"])) and result["final_ema_top1"] is None
    log = (tmp_path / "cmp" / "reference_imagenet" / "compare_run.log").read_text()
    assert "DIGITS proxy data, not CIFAR-10" in log and "on 500 images" in log
    from src.onednn_conv import native_library, native_thread_count
    if native_library()[0]:  # train.py got this process's thread setting, not the one MindSpore's import sets
        assert f"native convolutions: {native_thread_count()} threads" in log
    again = run_script("scripts/compare_recipes_on_digits.py", args)
    assert again.returncode == 0 and "reusing the finished run" in again.stdout
    assert json.loads((tmp_path / "cmp" / "comparison.json").read_text())[0] == result


def test_compare_script_refuses_an_unknown_run(tmp_path):
    process = run_script("scripts/compare_recipes_on_digits.py", ["--runs", "reference_imagenet,fastest",
                                                                  "--output_path", str(tmp_path)])
    assert_one_line_error(process, "--runs", "fastest", "recipe_cifar")
    assert not (tmp_path / "comparison.md").exists()


def test_proxy_ema_keeps_the_recipes_share_of_the_run():
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        from compare_recipes_on_digits import proxy_batch_and_lr, proxy_ema_decay
    finally:
        sys.path.remove(str(REPO / "scripts"))
    recipe = {"ema_decay": 0.9999, "batch_size": 128, "epoch_size": 200, "lr": 0.1}
    # 10,000 of 78,200 steps on CIFAR-10; 480 proxy steps (batch 32: 40 an epoch, 12 epochs) -> 61.4 steps.
    assert proxy_ema_decay(recipe, 12) == pytest.approx(1 - 1 / (10000 * 480 / 78200), abs=1e-4)
    assert proxy_ema_decay({**recipe, "ema_decay": 0.0}, 12) == 0.0
    assert proxy_ema_decay({**recipe, "ema_decay": 0.99}, 1) == 0.5  # never a window under 2 steps
    assert proxy_batch_and_lr(recipe) == (32, pytest.approx(0.025))  # the linear scaling rule
    assert proxy_batch_and_lr({**recipe, "batch_size": 16}) == (16, 0.1)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["cifar10_resnet50_cifar_stem.yaml", "cifar10_resnet18_cpu_fast.yaml"])
def test_recipe_config_trains(name, digits_dir, tmp_path):
    """Each recipe's whole set of options (SGD Nesterov, schedules, AutoAugment, erasing, EMA) trains as written,
    on two batches of the proxy."""
    process = run_script("train.py", ["--config_path", f"configs/{name}", "--data_path", str(digits_dir),
                                      "--download", "false", "--train_num_samples", "64", "--batch_size", "32",
                                      "--eval_num_samples", "32", "--epoch_size", "1", "--eval_interval", "1",
                                      "--output_path", str(tmp_path), "--num_parallel_workers", "2"])
    assert process.returncode == 0, process.stdout[-2000:] + process.stderr[-2000:]
    _, (row,) = read_metrics(tmp_path)
    assert 0.0 <= float(row["top1"]) <= 1.0 and float(row["train_loss"]) > 0
    assert bool(row["ema_top1"]) == (name == "cifar10_resnet50_cifar_stem.yaml")
    assert "DIGITS proxy data, not CIFAR-10" in process.stdout + process.stderr


def _compare_module():
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import compare_recipes_on_digits
    finally:
        sys.path.remove(str(REPO / "scripts"))
    return compare_recipes_on_digits


def test_compare_runs_the_recipes_sgd_core_in_both_frameworks(tmp_path):
    """recipe_cifar_sgd and its PyTorch twin get the same arguments; only the script differs."""
    compare = _compare_module()
    import argparse
    args = argparse.Namespace(data_path=tmp_path / "digits", output_path=tmp_path / "out", epochs=12, seed=1)
    ours, twin = (compare.run_command(name, args) for name in ("recipe_cifar_sgd", "torch_recipe_cifar_sgd"))
    assert ours[1].endswith("train.py") and twin[1].endswith("torch_sgd_twin.py")
    assert [a.replace("recipe_cifar_sgd", "X") for a in ours[2:]] == \
        [a.replace("torch_recipe_cifar_sgd", "X") for a in twin[2:]]
    assert ours[ours.index("--auto_augment") + 1] == "none" and ours[ours.index("--ema_decay") + 1] == "0"
    assert ours.count("--ema_decay") == 1  # the EMA is off, not re-enabled by the window scaling
    assert ours[ours.index("--lr") + 1] == "0.025"  # the recipe's lr scaled to the proxy's batch of 32
    # The batch-64 candidate keeps its batch and its linearly scaled lr (the proxy's cap of 32 is per run).
    batch64 = compare.run_command("reference_imagenet_batch64", args)
    assert batch64.count("--batch_size") == 1 and batch64[batch64.index("--batch_size") + 1] == "64"
    assert batch64.count("--lr") == 1 and batch64[batch64.index("--lr") + 1] == "0.002"


@pytest.mark.slow
@pytest.mark.parametrize("extra, fragments", [
    ([], ["optimizer", "'adam'"]),  # default_config.yaml: the reference's Adam
    (["--config_path", "configs/cifar10_resnet50_cifar_stem.yaml"], ["auto_augment", "--auto_augment none"]),
    (["--config_path", "configs/cifar10_resnet50_cifar_stem.yaml", "--auto_augment", "none", "--random_erasing", "0",
      "--ema_decay", "0", "--image_height", "64"], ["image_height"]),
])
def test_torch_twin_refuses_what_it_does_not_reproduce(extra, fragments, tmp_path):
    process = run_script("scripts/torch_sgd_twin.py", ["--data_path", str(tmp_path), "--output_path",
                                                       str(tmp_path / "out")] + extra)
    assert_one_line_error(process, *fragments)
    assert not (tmp_path / "out" / "metrics.csv").exists()


@pytest.mark.slow
def test_torch_twin_trains_on_train_pys_schedule(digits_dir, tmp_path):
    """The twin trains torchvision's network on the proxy and logs train.py's per-step learning rates; a folder
    without the data is refused in one line."""
    from src.lr_schedule import build_lr_schedule
    args = ["--config_path", "configs/cifar10_resnet50_cifar_stem.yaml", "--auto_augment", "none",
            "--random_erasing", "0", "--ema_decay", "0", "--model_name", "resnet18", "--batch_size", "32",
            "--lr", "0.05", "--epoch_size", "2", "--train_num_samples", "96", "--eval_num_samples", "100",
            "--threads", "2"]
    process = run_script("scripts/torch_sgd_twin.py", ["--data_path", str(digits_dir), "--output_path",
                                                       str(tmp_path / "out")] + args)
    assert process.returncode == 0, process.stdout[-2000:] + process.stderr[-2000:]
    fields, rows = read_metrics(tmp_path / "out")
    from src.metrics_file import COLUMNS
    assert fields == list(COLUMNS) and len(rows) == 2  # train.py's metrics.csv
    rates = build_lr_schedule("cosine", 0.05, 2, 3, warmup_epochs=1)  # 96 images: 3 steps an epoch
    assert [float(row["lr"]) for row in rows] == pytest.approx([rates[2], rates[5]], rel=1e-5)
    assert all(np.isfinite(float(row["train_loss"])) and 0 <= float(row["top1"]) <= 1 for row in rows)
    missing = run_script("scripts/torch_sgd_twin.py", ["--data_path", str(tmp_path / "none"), "--output_path",
                                                       str(tmp_path / "out2")] + args)
    assert_one_line_error(missing, str(tmp_path / "none"), "--data_path")


def test_torch_twin_pads_its_crops_black_before_normalising():
    """As torchvision's RandomCrop(32, padding=4) and train.py's crop: the padding is black pixels, so it
    normalises to -mean/std, not to 0."""
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        from torch_sgd_twin import crop_and_flip
    finally:
        sys.path.remove(str(REPO / "scripts"))
    white = np.ones((64, 3, 32, 32), np.float32)
    cropped = crop_and_flip(white, np.random.default_rng(0))
    assert cropped.shape == white.shape and set(np.unique(cropped)) == {0.0, 1.0}
    assert (cropped == 0).any(axis=(1, 2, 3)).mean() > 0.5  # most of 64 crops are off-centre
    # A crop keeps 32x32 of the padded 40x40: at most 4 black rows and 4 black columns.
    assert ((cropped == 0).all(axis=(1, 3)).sum(axis=1) <= 4).all()
