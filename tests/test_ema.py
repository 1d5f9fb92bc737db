"""The EMA of the weights (ema_decay): its update rule inside the training step, its evaluation beside the raw
weights, its place in checkpoints, an exact resume, and eval/export/predict using it."""
import json
import re

import numpy as np
import mindspore as ms
import pytest
from mindspore import nn

from conftest import FAST_ARGS, read_ckpt_entries, read_metrics, run_script, sigterm_training, temp_files
from src.ema import PREFIX, WeightsEma, ema_entries_as_weights
from src.model_utils.config import load_config
from src.train_step import AmpSetting, build_train_step
from src.trainer import build_optimizer

RECIPE = ["--model_name", "resnet18", "--batch_size", "8", "--train_num_samples", "48", "--eval_num_samples", "32",
          "--epoch_size", "2", "--ema_decay", "0.9", "--stem", "cifar", *FAST_ARGS]  # 6 steps an epoch


@pytest.mark.parametrize("sink, optimizer", [(False, "momentum"), (True, "momentum"), (False, "native_adam"),
                                             (False, "native_momentum")])
def test_the_ema_follows_the_weights_after_each_update(sink, optimizer):
    """One step, decay d: ema = d * before + (1 - d) * after, for weights and BatchNorm statistics; so the EMA is
    updated after the optimizer (in the sink's graph too, where only the order of side effects decides it; the
    native updates write the weights unseen by that order, so training keeps it out of a sink's graph with an EMA:
    test_native_update_stays_out_of_a_sink_with_an_ema)."""
    # MindSpore's default is PyNative, which runs ops as written (conftest restores the mode after the test).
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_seed(0)
    native = optimizer.startswith("native")
    adam = optimizer == "native_adam"
    config = load_config(["--optimizer", "adam" if adam else "momentum", "--lr", "0.05" if adam else "0.5"])
    net = nn.SequentialCell(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Dense(4 * 4 * 4, 3))
    ema = WeightsEma(net, 0.75)
    step = build_train_step(net, build_optimizer(config, net.trainable_params(), np.ones(2, np.float32), native),
                            config, AmpSetting("O0"), sink=sink, ema=ema)
    before = {param.name: param.asnumpy().copy() for param in net.get_parameters()}
    rng = np.random.default_rng(0)
    step(ms.Tensor(rng.standard_normal((4, 3, 4, 4)).astype(np.float32)), ms.Tensor(np.array([0, 1, 2, 0], np.int32)))
    averages = {param.name[len(PREFIX):]: param.asnumpy() for param in ema.average_parameters()}
    assert averages.keys() == before.keys()
    for param in net.get_parameters():
        after = param.asnumpy()
        assert not np.array_equal(after, before[param.name]), param.name  # the step moved every parameter
        np.testing.assert_allclose(averages[param.name], 0.75 * before[param.name] + 0.25 * after, rtol=1e-6,
                                   atol=1e-7, err_msg=param.name)


def test_ema_entries_replace_the_weights_only_when_the_file_has_all_of_them():
    raw = {"conv1.weight": 1, "fc.bias": 2, "moment1.fc.bias": 3}
    assert ema_entries_as_weights(raw) is raw
    full = dict(raw, **{"ema.conv1.weight": 10, "ema.fc.bias": 20})
    assert ema_entries_as_weights(full) == {"conv1.weight": 10, "fc.bias": 20, "moment1.fc.bias": 3}
    foreign = dict(raw, **{"ema.something_else": 5})  # an EMA of names that are not this file's weights
    assert ema_entries_as_weights(foreign) is foreign


@pytest.fixture(scope="module")
def ema_run(cifar_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("ema")
    process = run_script("train.py", ["--data_path", str(cifar_dir), "--output_path", str(out), *RECIPE])
    assert process.returncode == 0, process.stderr[-3000:]
    return out, process.stdout


@pytest.mark.slow
def test_training_evaluates_and_saves_the_ema_and_eval_py_uses_it_by_default(ema_run, cifar_dir, tmp_path):
    out, log = ema_run
    assert "epoch 2 eval (EMA weights): top-1" in log
    _, rows = read_metrics(out)
    last = rows[-1]
    assert all(row["ema_top1"] for row in rows) and last["ema_eval_loss"] != last["eval_loss"]
    entries = read_ckpt_entries(out / "resnet18-last.ckpt")
    weights = [name for name in entries if name.startswith(("conv1.", "layer", "bn1.", "fc."))]
    assert all(PREFIX + name in entries for name in weights)
    base = ["eval.py", "--data_path", str(cifar_dir), "--checkpoint_path", str(out / "resnet18-last.ckpt"),
            "--model_name", "resnet18", "--eval_num_samples", "32", *FAST_ARGS]
    for use_ema, column, loss_column in (("true", "ema_top1", "ema_eval_loss"), ("false", "top1", "eval_loss")):
        folder = tmp_path / use_ema
        process = run_script(base[0], base[1:] + ["--output_path", str(folder), "--use_ema", use_ema])
        assert process.returncode == 0, process.stderr[-3000:]
        assert ("holds an EMA of its weights: using it" in process.stdout) == (use_ema == "true")
        result = json.loads((folder / "eval_result.json").read_text())
        # eval.py, float32 on the same images, reproduces the in-training evaluation of the same weights.
        assert result["top1"] == pytest.approx(float(last[column]))
        assert result["loss"] == pytest.approx(float(last[loss_column]), rel=1e-4)


@pytest.mark.slow
def test_export_and_predict_use_the_ema_weights(ema_run, tmp_path):
    out, _ = ema_run
    checkpoint = str(out / "resnet18-last.ckpt")
    common = ["--model_name", "resnet18"]  # stem and input size: the checkpoint's
    exported = run_script("export.py", ["--checkpoint_path", checkpoint, "--output_path", str(tmp_path),
                                        "--batch_size", "1", "--verify", *common])
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert "holds an EMA of its weights: using it" in exported.stdout
    image = tmp_path / "image.png"
    from PIL import Image
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (32, 32, 3), np.uint8)).save(image)
    scores = {}
    for use_ema in ("true", "false"):
        predicted = run_script("predict.py", ["--checkpoint_path", checkpoint, "--use_ema", use_ema, *common,
                                              str(image)])
        assert predicted.returncode == 0, predicted.stderr[-3000:]
        assert ("holds an EMA of its weights: using it" in predicted.stdout) == (use_ema == "true")
        scores[use_ema] = re.findall(r"\d\.\d{4}", predicted.stdout.split(str(image))[-1])
    assert scores["true"] != scores["false"]  # other weights, other probabilities


@pytest.mark.slow
def test_a_run_with_ema_stopped_mid_epoch_resumes_to_the_same_ema(ema_run, cifar_dir, tmp_path):
    straight, _ = ema_run
    args = ["--data_path", str(cifar_dir), "--output_path", str(tmp_path), *RECIPE]
    log_path = tmp_path / "run.log"
    sigterm_training(args, log_path, "epoch 1/2 step 3/6")
    interrupted = tmp_path / "resnet18-interrupted.ckpt"
    assert any(name.startswith(PREFIX) for name in read_ckpt_entries(interrupted)) and temp_files(tmp_path) == []
    resumed = run_script("train.py", args + ["--resume", str(interrupted)])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    ours, theirs = read_ckpt_entries(tmp_path / "resnet18-last.ckpt"), read_ckpt_entries(straight / "resnet18-last.ckpt")
    averaged = [name for name in theirs if name.startswith(PREFIX)]
    assert averaged
    for name in averaged:
        assert np.array_equal(ours[name].asnumpy(), theirs[name].asnumpy()), name


def test_native_update_stays_out_of_a_sink_with_an_ema():
    from src.trainer import native_update_allowed
    assert native_update_allowed(load_config([]), "onednn_blocked")
    assert native_update_allowed(load_config(["--ema_decay", "0.9"]), "onednn_blocked")  # EMA in its own graph
    assert native_update_allowed(load_config(["--dataset_sink_mode", "true"]), "onednn_blocked")
    assert not native_update_allowed(load_config(["--ema_decay", "0.9", "--dataset_sink_mode", "true"]),
                                     "onednn_blocked")
    assert not native_update_allowed(load_config([]), "mindspore")

