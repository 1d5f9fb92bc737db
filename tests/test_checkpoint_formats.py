"""Foreign checkpoints through the one loading path (src.weights.loading.load_weights_report): MindSpore models-zoo and
mindcv ResNet checkpoints, PyTorch/torchvision .pth files, and every refusal.

The zoo and mindcv checkpoints are written here by networks built like theirs, so the names are the ones their
networks produce (attribute names, SequentialCell indices, BatchNorm fields), read from:
- models zoo: mindspore-ai/models official/cv/ResNet/src/resnet.py (ResidualBlockBase for ResNet-18/34 with
  res_base=True, ResidualBlock for ResNet-50/101/152, ResNet with end_point) and train.py (Model + Momentum,
  ModelCheckpoint with append_info epoch_num/step_num);
- mindcv: mindspore-lab/mindcv mindcv/models/resnet.py (BasicBlock/Bottleneck with down_sample, ResNet with
  max_pool and classifier) and mindcv/utils/train_step.py (TrainStep: scale_sense, updates, ema.* copies).
Each is saved from its training cell, with the optimizer's state next to the weights, like a training run does.
"""
import logging
from typing import Dict

import numpy as np
import pytest

import mindspore as ms
from mindspore import nn

from conftest import one_line_user_error, read_ckpt_entries
from src.errors import UserError
from src.resnet import build_resnet
from src.weights.files import save_checkpoint_atomic
from src.weights.loading import load_weights_report
from src.weights.names import (MINDCV, OURS, TORCH, ZOO, describe_weights, detect_format, find_wrapper_prefix,
                               is_training_state, match_names, to_our_name, zoo_bn_eps)

LOGGER_NAME = "test_checkpoint_formats"

# ----------------------------------------------------------------------------- networks named like the zoo's


class ZooBasicBlock(nn.Cell):
    """The models zoo's ResidualBlockBase with res_base=True (its ResNet-18/34 block)."""

    def __init__(self, in_channel: int, out_channel: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channel, out_channel, 3, stride, pad_mode="pad", padding=1)
        self.bn1d = nn.BatchNorm2d(out_channel, eps=1e-4, momentum=0.9)  # _bn(out_channel): no res_base
        self.conv2 = nn.Conv2d(out_channel, out_channel, 3, 1, pad_mode="pad", padding=1)
        self.bn2d = nn.BatchNorm2d(out_channel, eps=1e-4, momentum=0.9)
        self.relu = nn.ReLU()
        self.down_sample_layer = None
        if stride != 1 or in_channel != out_channel:
            self.down_sample_layer = nn.SequentialCell([
                nn.Conv2d(in_channel, out_channel, 1, stride, pad_mode="pad", padding=0),
                nn.BatchNorm2d(out_channel, eps=1e-5, momentum=0.1)])  # _bn(out_channel, res_base)

    def construct(self, x):
        identity = x
        out = self.relu(self.bn1d(self.conv1(x)))
        out = self.bn2d(self.conv2(out))
        if self.down_sample_layer is not None:
            identity = self.down_sample_layer(x)
        return self.relu(out + identity)


class ZooBottleneck(nn.Cell):
    """The models zoo's ResidualBlock (ResNet-50/101/152): pad_mode 'same', eps 1e-4, stride on conv2."""

    def __init__(self, in_channel: int, out_channel: int, stride: int = 1) -> None:
        super().__init__()
        channel = out_channel // 4
        self.conv1 = nn.Conv2d(in_channel, channel, 1, 1, pad_mode="same")
        self.bn1 = nn.BatchNorm2d(channel, eps=1e-4, momentum=0.9)
        self.conv2 = nn.Conv2d(channel, channel, 3, stride, pad_mode="same")
        self.bn2 = nn.BatchNorm2d(channel, eps=1e-4, momentum=0.9)
        self.conv3 = nn.Conv2d(channel, out_channel, 1, 1, pad_mode="same")
        self.bn3 = nn.BatchNorm2d(out_channel, eps=1e-4, momentum=0.9)
        self.relu = nn.ReLU()
        self.down_sample_layer = None
        if stride != 1 or in_channel != out_channel:
            self.down_sample_layer = nn.SequentialCell([
                nn.Conv2d(in_channel, out_channel, 1, stride, pad_mode="same"),
                nn.BatchNorm2d(out_channel, eps=1e-4, momentum=0.9)])

    def construct(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        if self.down_sample_layer is not None:
            identity = self.down_sample_layer(x)
        return self.relu(out + identity)


class ZooResNet(nn.Cell):
    """The models zoo's ResNet: conv1/bn1 stem, layer1..4, mean over H and W, end_point."""

    def __init__(self, depth: str, class_num: int) -> None:
        super().__init__()
        basic = depth in ("resnet18", "resnet34")
        layers = {"resnet18": [2, 2, 2, 2], "resnet34": [3, 4, 6, 3], "resnet50": [3, 4, 6, 3]}[depth]
        block = ZooBasicBlock if basic else ZooBottleneck
        ins = [64, 64, 128, 256] if basic else [64, 256, 512, 1024]
        outs = [64, 128, 256, 512] if basic else [256, 512, 1024, 2048]
        if basic:  # res_base=True
            self.conv1 = nn.Conv2d(3, 64, 7, 2, pad_mode="pad", padding=3)
            self.bn1 = nn.BatchNorm2d(64, eps=1e-5, momentum=0.1)
            self.maxpool = nn.SequentialCell([nn.Pad(((0, 0), (0, 0), (1, 1), (1, 1))),
                                              nn.MaxPool2d(3, 2, pad_mode="valid")])
        else:
            self.conv1 = nn.Conv2d(3, 64, 7, 2, pad_mode="same")
            self.bn1 = nn.BatchNorm2d(64, eps=1e-4, momentum=0.9)
            self.maxpool = nn.MaxPool2d(3, 2, pad_mode="same")
        self.relu = nn.ReLU()
        for index, (count, cin, cout, stride) in enumerate(zip(layers, ins, outs, [1, 2, 2, 2]), start=1):
            cells = [block(cin, cout, stride)] + [block(cout, cout, 1) for _ in range(1, count)]
            setattr(self, f"layer{index}", nn.SequentialCell(cells))
        self.end_point = nn.Dense(outs[3], class_num)

    def construct(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.end_point(x.mean(axis=(2, 3)))


# ----------------------------------------------------------------------------- networks named like mindcv's


class MindcvBasicBlock(nn.Cell):
    def __init__(self, in_channels: int, channels: int, stride: int = 1, down_sample=None) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, channels, 3, stride, pad_mode="pad", padding=1)
        self.bn1 = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(channels, channels, 3, 1, pad_mode="pad", padding=1)
        self.bn2 = nn.BatchNorm2d(channels)
        self.down_sample = down_sample

    def construct(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.down_sample is not None:
            identity = self.down_sample(x)
        return self.relu(out + identity)


class MindcvBottleneck(nn.Cell):
    def __init__(self, in_channels: int, channels: int, stride: int = 1, down_sample=None) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, channels, 1, 1)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, stride, pad_mode="pad", padding=1)
        self.bn2 = nn.BatchNorm2d(channels)
        self.conv3 = nn.Conv2d(channels, channels * 4, 1, 1)
        self.bn3 = nn.BatchNorm2d(channels * 4)
        self.relu = nn.ReLU()
        self.down_sample = down_sample

    def construct(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        if self.down_sample is not None:
            identity = self.down_sample(x)
        return self.relu(out + identity)


class MindcvResNet(nn.Cell):
    def __init__(self, depth: str, num_classes: int) -> None:
        super().__init__()
        basic = depth in ("resnet18", "resnet34")
        block, expansion = (MindcvBasicBlock, 1) if basic else (MindcvBottleneck, 4)
        layers = {"resnet18": [2, 2, 2, 2], "resnet34": [3, 4, 6, 3], "resnet50": [3, 4, 6, 3]}[depth]
        self.conv1 = nn.Conv2d(3, 64, 7, 2, pad_mode="pad", padding=3)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU()
        self.max_pool = nn.MaxPool2d(3, 2, pad_mode="same")
        channels_in = 64
        for index, (count, channels, stride) in enumerate(zip(layers, [64, 128, 256, 512], [1, 2, 2, 2]), start=1):
            down_sample = None
            if stride != 1 or channels_in != channels * expansion:
                down_sample = nn.SequentialCell([nn.Conv2d(channels_in, channels * expansion, 1, stride),
                                                 nn.BatchNorm2d(channels * expansion)])
            cells = [block(channels_in, channels, stride, down_sample)]
            channels_in = channels * expansion
            cells += [block(channels_in, channels) for _ in range(1, count)]
            setattr(self, f"layer{index}", nn.SequentialCell(cells))
        self.classifier = nn.Dense(512 * expansion, num_classes)

    def construct(self, x):
        x = self.max_pool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.classifier(x.mean(axis=(2, 3)))


class MindcvTrainStep(nn.TrainOneStepWithLossScaleCell):
    """Holds what mindcv's TrainStep adds to a checkpoint: scale_sense, updates and (with EMA) ema.* copies."""

    def __init__(self, network, optimizer, weights) -> None:
        super().__init__(network, optimizer, ms.Tensor(1024.0, ms.float32))
        self.updates = ms.Parameter(ms.Tensor(0.0, ms.float32), name="updates")
        self.ema_weight = ms.ParameterTuple(weights).clone("ema", init="same")


# ------------------------------------------------------------------------------------------------- helpers


def randomise(net: nn.Cell, seed: int) -> Dict[str, np.ndarray]:
    """Gives every parameter distinct random values (BN variances positive); returns name -> values."""
    rng = np.random.default_rng(seed)
    values = {}
    for param in net.get_parameters():
        if param.name.endswith("moving_variance"):
            value = rng.uniform(0.5, 1.5, param.shape)
        elif param.name.endswith("gamma"):
            value = rng.uniform(0.5, 1.5, param.shape)
        else:
            value = rng.normal(0.0, 0.05, param.shape)
        param.set_data(ms.Tensor(value.astype(np.float32)))
        values[param.name] = value.astype(np.float32)
    return values


def save_like_training(net: nn.Cell, path, scheme: str) -> None:
    """Saves net from a training cell with optimizer state, as the zoo's or mindcv's training writes it."""
    loss = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
    lr = ms.Tensor(np.linspace(0.1, 0.0, 20).astype(np.float32))
    if scheme == ZOO:  # Model(net, loss, Momentum) + ModelCheckpoint(append_info=[epoch_num, step_num])
        optimizer = nn.Momentum(net.trainable_params(), learning_rate=lr, momentum=0.9)
        cell = nn.TrainOneStepCell(nn.WithLossCell(net, loss), optimizer)
    else:  # mindcv: TrainStep with loss scale and EMA, here with AdamWeightDecay (adam_m/adam_v)
        optimizer = nn.AdamWeightDecay(net.trainable_params(), learning_rate=lr)
        cell = MindcvTrainStep(nn.WithLossCell(net, loss), optimizer, list(net.get_parameters()))
    ms.save_checkpoint(cell, str(path), append_dict={"epoch_num": 7, "step_num": 700})


def logits(net: nn.Cell, images: np.ndarray) -> np.ndarray:
    net.set_train(False)
    return net(ms.Tensor(images)).asnumpy()


@pytest.fixture
def logger(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER_NAME)
    return logging.getLogger(LOGGER_NAME)


IMAGES = np.random.default_rng(0).normal(size=(2, 3, 32, 32)).astype(np.float32)

# Names the zoo's and mindcv's networks give, read off their resnet.py (a sample of each kind of module).
ZOO_RESNET18_NAMES = ["conv1.weight", "bn1.gamma", "bn1.moving_variance", "layer1.0.conv1.weight",
                      "layer1.0.bn1d.gamma", "layer1.1.bn2d.moving_mean", "layer2.0.down_sample_layer.0.weight",
                      "layer2.0.down_sample_layer.1.beta", "layer4.1.bn2d.moving_variance", "end_point.weight",
                      "end_point.bias"]
ZOO_RESNET50_NAMES = ["conv1.weight", "bn1.beta", "layer1.0.conv3.weight", "layer1.0.bn3.moving_mean",
                      "layer1.0.down_sample_layer.0.weight", "layer1.0.down_sample_layer.1.moving_variance",
                      "layer3.5.bn2.gamma", "layer4.2.conv3.weight", "end_point.weight", "end_point.bias"]
MINDCV_RESNET18_NAMES = ["conv1.weight", "bn1.gamma", "layer1.0.bn1.moving_mean", "layer2.0.down_sample.0.weight",
                         "layer2.0.down_sample.1.moving_variance", "layer4.1.conv2.weight", "classifier.weight",
                         "classifier.bias"]
MINDCV_RESNET50_NAMES = ["conv1.weight", "layer1.0.conv3.weight", "layer1.0.down_sample.0.weight",
                         "layer1.0.down_sample.1.gamma", "layer3.5.bn3.beta", "classifier.weight", "classifier.bias"]


@pytest.fixture(scope="module")
def foreign_checkpoints(tmp_path_factory):
    """(scheme, depth, class_num) -> (path, the source network, name -> values) for zoo and mindcv files."""
    folder = tmp_path_factory.mktemp("foreign")
    made = {}

    def make(scheme: str, depth: str, class_num: int = 10):
        key = (scheme, depth, class_num)
        if key not in made:
            net = ZooResNet(depth, class_num) if scheme == ZOO else MindcvResNet(depth, class_num)
            values = randomise(net, seed=len(made) + 1)
            path = folder / f"{scheme}-{depth}-{class_num}.ckpt"
            save_like_training(net, path, scheme)
            made[key] = (path, net, values)
        return made[key]
    return make


# ------------------------------------------------------------------------------- pure name mapping


@pytest.mark.parametrize("scheme, name, ours", [
    (ZOO, "end_point.weight", "fc.weight"),
    (ZOO, "layer2.0.down_sample_layer.0.weight", "layer2.0.downsample.0.weight"),
    (ZOO, "layer2.0.down_sample_layer.1.moving_variance", "layer2.0.downsample.1.moving_variance"),
    (ZOO, "layer1.1.bn1d.gamma", "layer1.1.bn1.gamma"),
    (ZOO, "layer3.0.bn2d.beta", "layer3.0.bn2.beta"),
    (ZOO, "layer3.0.bn3.beta", "layer3.0.bn3.beta"),
    (ZOO, "bn1.moving_mean", "bn1.moving_mean"),
    (MINDCV, "classifier.bias", "fc.bias"),
    (MINDCV, "layer4.0.down_sample.1.gamma", "layer4.0.downsample.1.gamma"),
    (MINDCV, "layer4.0.conv2.weight", "layer4.0.conv2.weight"),
    (TORCH, "layer1.0.bn1.running_var", "layer1.0.bn1.moving_variance"),
    (TORCH, "layer1.0.downsample.1.weight", "layer1.0.downsample.1.gamma"),
    (TORCH, "fc.weight", "fc.weight"),
    (TORCH, "bn1.num_batches_tracked", None),
    (OURS, "layer1.0.bn1.gamma", "layer1.0.bn1.gamma"),
])
def test_to_our_name(scheme, name, ours):
    assert to_our_name(name, scheme) == ours


def test_detect_format_from_names():
    assert detect_format(ZOO_RESNET18_NAMES) == ZOO
    assert detect_format(ZOO_RESNET50_NAMES) == ZOO
    assert detect_format(MINDCV_RESNET18_NAMES) == MINDCV
    assert detect_format(MINDCV_RESNET50_NAMES) == MINDCV
    assert detect_format(["conv1.weight", "bn1.running_mean", "fc.weight"]) == TORCH
    assert detect_format(build_resnet("resnet18", 10).parameters_dict()) == OURS
    assert detect_format([]) == OURS


def test_training_state_is_told_from_weights():
    ours = set(build_resnet("resnet18", 10).parameters_dict())
    for name in ["moments.conv1.weight", "moment1.fc.bias", "adam_v.layer1.0.conv1.weight", "ema.bn1.moving_mean",
                 "global_step", "learning_rate", "epoch_num", "step_num", "scale_sense", "beta1_power",
                 "bn1.num_batches_tracked", "some_optimizer.layer1.0.conv1.weight"]:
        assert is_training_state(name, OURS, ours), name
    assert is_training_state("moments.end_point.weight", ZOO, ours)
    assert is_training_state("adam_m.classifier.bias", MINDCV, ours)
    # A deeper network's weights are not "a copy of conv1.weight with the prefix layer4.2."
    for name in ["layer4.2.conv1.weight", "layer1.0.conv3.weight", "fc2.weight"]:
        assert not is_training_state(name, OURS, ours), name


def test_match_names_reports_missing_and_unmatched():
    ours = list(build_resnet("resnet18", 10).parameters_dict())
    names = [name for name in ours if name != "layer3.0.conv1.weight"] + ["moments.fc.weight", "extra.weight"]
    match = match_names(names, ours)
    assert match.fmt == OURS
    assert match.missing == ["layer3.0.conv1.weight"]
    assert match.training_state == ["moments.fc.weight"]
    assert match.unmatched == ["extra.weight"]
    assert len(match.mapping) == len(ours) - 1


def test_wrapper_prefix_found_only_when_unambiguous():
    ours = list(build_resnet("resnet18", 10).parameters_dict())
    assert find_wrapper_prefix(["network." + name for name in ours] + ["moments.network.conv1.weight"]) == "network."
    assert find_wrapper_prefix(ours + ["ema.conv1.weight"]) == ""
    assert find_wrapper_prefix(["ema." + name for name in ours]) == ""  # EMA copies alone are not a wrapper
    assert find_wrapper_prefix(["a." + name for name in ours] + ["b." + name for name in ours]) == ""


def test_zoo_bn_eps_follows_the_zoo_network():
    # ResNet-18/34: stem and shortcut BNs are built with res_base (eps 1e-5), block BNs without (1e-4).
    assert zoo_bn_eps("bn1.moving_variance", basic_block=True) == 1e-5
    assert zoo_bn_eps("layer2.0.downsample.1.moving_variance", basic_block=True) == 1e-5
    assert zoo_bn_eps("layer2.0.bn1.moving_variance", basic_block=True) == 1e-4
    # ResNet-50/101/152: every BN has eps 1e-4.
    assert zoo_bn_eps("bn1.moving_variance", basic_block=False) == 1e-4
    assert zoo_bn_eps("layer2.0.downsample.1.gamma", basic_block=False) == 1e-4
    assert zoo_bn_eps("layer2.0.conv1.weight", basic_block=False) is None


# ------------------------------------------------------------------- zoo and mindcv files, real loading path


@pytest.mark.parametrize("scheme, depth, expected_names", [
    (ZOO, "resnet18", ZOO_RESNET18_NAMES), (ZOO, "resnet50", ZOO_RESNET50_NAMES),
    (MINDCV, "resnet18", MINDCV_RESNET18_NAMES), (MINDCV, "resnet50", MINDCV_RESNET50_NAMES),
])
@pytest.mark.slow
def test_foreign_checkpoint_loads_with_nothing_unmatched(foreign_checkpoints, logger, caplog, scheme, depth,
                                                         expected_names):
    path, source, values = foreign_checkpoints(scheme, depth)
    entries = read_ckpt_entries(path)
    assert set(expected_names) <= set(entries)  # the file carries the names their source code gives
    assert set(values) <= set(entries)
    net = build_resnet(depth, 10)

    report = load_weights_report(net, str(path), depth, logger)

    assert report.fmt == scheme
    assert report.match.unmatched == [] and report.match.missing == []
    assert len(report.loaded) == len(list(net.get_parameters())) == len(values)
    state = set(report.match.training_state)
    assert {"global_step", "learning_rate", "epoch_num", "step_num"} <= state
    if scheme == ZOO:
        assert {"moments.conv1.weight", "moments.end_point.weight", "momentum"} <= state
    else:
        assert {"adam_m.conv1.weight", "adam_v.classifier.bias", "ema.layer1.0.bn1.moving_mean", "scale_sense",
                "updates"} <= state
    # Every value landed in the parameter of the same role.
    ours = {param.name: param.asnumpy() for param in net.get_parameters()}
    basic = depth == "resnet18"
    for name, value in values.items():
        our_name = report.match.mapping[name]
        expected = value
        if scheme == ZOO and our_name.endswith("moving_variance") and zoo_bn_eps(our_name, basic) == 1e-4:
            expected = value + np.float32(9e-5)  # eps 1e-4 in the zoo's BN, 1e-5 in ours
        np.testing.assert_allclose(ours[our_name], expected, rtol=0, atol=1e-7, err_msg=f"{name} -> {our_name}")
    spot = {ZOO: ("end_point.weight", "fc.weight"), MINDCV: ("classifier.weight", "fc.weight")}[scheme]
    np.testing.assert_array_equal(ours[spot[1]], values[spot[0]])
    log = caplog.text
    assert f"{path}" in log and ("models-zoo" if scheme == ZOO else "mindcv") in log
    assert "set aside" in log and "global_step" in report.match.training_state


def test_zoo_resnet18_gives_the_zoo_networks_outputs(foreign_checkpoints, logger, caplog):
    """Same padding as ours; the eps 1e-4 BatchNorms are matched by the moving_variance adjustment."""
    path, source, _ = foreign_checkpoints(ZOO, "resnet18")
    net = build_resnet("resnet18", 10)
    load_weights_report(net, str(path), "resnet18", logger)
    np.testing.assert_allclose(logits(net, IMAGES), logits(source, IMAGES), rtol=1e-4, atol=1e-5)
    assert "eps 1e-4" in caplog.text and "raised by 9e-5" in caplog.text


def _conv_like(conv: nn.Conv2d, pad_mode: str) -> nn.Conv2d:
    """conv's weights in a Conv2d that pads as pad_mode."""
    out_channels, in_channels, kernel, _ = conv.weight.shape
    replacement = nn.Conv2d(in_channels, out_channels, kernel, conv.stride[-1], pad_mode=pad_mode)
    replacement.weight.set_data(ms.Tensor(conv.weight.asnumpy()))
    return replacement


@pytest.mark.slow
def test_zoo_resnet50_differs_only_by_the_logged_padding(foreign_checkpoints, logger, caplog):
    path, source, _ = foreign_checkpoints(ZOO, "resnet50")
    net = build_resnet("resnet50", 10)
    load_weights_report(net, str(path), "resnet50", logger)
    ours, theirs = logits(net, IMAGES), logits(source, IMAGES)
    assert not np.allclose(ours, theirs, rtol=1e-3, atol=1e-3)  # the log says outputs differ: they do
    assert "DIFFER" in caplog.text and "pad_mode 'same'" in caplog.text
    # Pad as the log says the zoo does (stem conv, max pool, stride-2 3x3 convs): then the outputs agree, so the
    # eps adjustment and the names are right and padding is the only difference.
    net.conv1 = _conv_like(net.conv1, "same")
    net.maxpool = nn.MaxPool2d(3, 2, pad_mode="same")
    for layer in (net.layer2, net.layer3, net.layer4):
        layer[0].conv2 = _conv_like(layer[0].conv2, "same")
    np.testing.assert_allclose(logits(net, IMAGES), theirs, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("depth", ["resnet18", "resnet50"])
@pytest.mark.slow
def test_mindcv_differs_only_by_the_logged_max_pool(foreign_checkpoints, logger, caplog, depth):
    path, source, _ = foreign_checkpoints(MINDCV, depth)
    net = build_resnet(depth, 10)
    load_weights_report(net, str(path), depth, logger)
    theirs = logits(source, IMAGES)
    assert not np.allclose(logits(net, IMAGES), theirs, rtol=1e-3, atol=1e-3)
    assert "mindcv's ResNet max pool uses pad_mode 'same'" in caplog.text
    net.maxpool = nn.MaxPool2d(3, 2, pad_mode="same")
    np.testing.assert_allclose(logits(net, IMAGES), theirs, rtol=1e-4, atol=1e-4)


def test_torchvision_pth_loads_with_the_same_outputs(tmp_path, logger, caplog):
    torch = pytest.importorskip("torch")
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    source = torchvision.models.resnet18(num_classes=10)
    with torch.no_grad():  # non-default BN statistics
        for module in source.modules():
            if isinstance(module, torch.nn.BatchNorm2d):
                module.running_mean.uniform_(-0.1, 0.1)
                module.running_var.uniform_(0.5, 1.5)
    path = tmp_path / "resnet18-tv.pth"
    torch.save({"state_dict": source.state_dict(), "epoch": 3}, path)  # wrapped, with a non-tensor entry
    net = build_resnet("resnet18", 10)
    report = load_weights_report(net, str(path), "resnet18", logger)
    assert report.fmt == TORCH and report.match.unmatched == [] and report.match.missing == []
    assert all(name.endswith("num_batches_tracked") for name in report.match.training_state)
    source.eval()
    expected = source(torch.from_numpy(IMAGES)).detach().numpy()
    np.testing.assert_allclose(logits(net, IMAGES), expected, rtol=1e-4, atol=1e-4)
    assert "PyTorch/torchvision state_dict, names converted in memory" in caplog.text


def test_wrapper_prefix_is_removed(tmp_path, logger, caplog):
    source = build_resnet("resnet18", 10)
    values = randomise(source, seed=11)
    path = tmp_path / "wrapped.ckpt"
    ms.save_checkpoint([{"name": "network." + name, "data": ms.Tensor(value)} for name, value in values.items()],
                       str(path))
    net = build_resnet("resnet18", 10)
    report = load_weights_report(net, str(path), "resnet18", logger)
    assert report.match.prefix == "network." and report.match.unmatched == []
    np.testing.assert_array_equal(net.fc.weight.asnumpy(), values["fc.weight"])
    assert "wrapper prefix 'network.'" in caplog.text


def test_unmatched_entries_are_logged_not_loaded(tmp_path, logger, caplog):
    values = randomise(build_resnet("resnet18", 10), seed=12)
    extra = {"aux_head.weight": np.ones((3, 4), np.float32)}
    path = tmp_path / "extra.ckpt"
    save_checkpoint_atomic([{"name": n, "data": ms.Tensor(v)} for n, v in {**values, **extra}.items()], str(path))
    report = load_weights_report(build_resnet("resnet18", 10), str(path), "resnet18", logger)
    assert report.match.unmatched == ["aux_head.weight"]
    assert "1 entries of" in caplog.text and "aux_head.weight" in caplog.text


# ------------------------------------------------------------------------------------------- refusals


@pytest.mark.slow
def test_zoo_resnet50_into_resnet18_names_the_architecture(foreign_checkpoints, logger):
    path, _, _ = foreign_checkpoints(ZOO, "resnet50")
    net = build_resnet("resnet18", 10)
    before = net.conv1.weight.asnumpy().copy()
    with pytest.raises(UserError) as excinfo:
        load_weights_report(net, str(path), "resnet18", logger)
    one_line_user_error(excinfo, str(path), "resnet50", "--model_name resnet50")
    np.testing.assert_array_equal(net.conv1.weight.asnumpy(), before)


@pytest.mark.slow
def test_deeper_checkpoint_holding_every_name_is_still_refused(tmp_path, logger):
    """resnet34 has every resnet18 name with the same shapes: the architecture check must catch it."""
    path = tmp_path / "resnet34.ckpt"
    ms.save_checkpoint(build_resnet("resnet34", 10), str(path))
    net = build_resnet("resnet18", 10)
    with pytest.raises(UserError) as excinfo:
        load_weights_report(net, str(path), "resnet18", logger)
    one_line_user_error(excinfo, str(path), "resnet34", "--model_name resnet34")


@pytest.mark.parametrize("scheme", [ZOO, MINDCV])
@pytest.mark.slow
def test_foreign_head_mismatch_is_refused_unless_a_new_head_is_allowed(foreign_checkpoints, logger, caplog, scheme):
    path, _, values = foreign_checkpoints(scheme, "resnet18", 1000)
    net = build_resnet("resnet18", 10)
    fresh_fc = net.fc.weight.asnumpy().copy()
    before = net.conv1.weight.asnumpy().copy()
    with pytest.raises(UserError) as excinfo:
        load_weights_report(net, str(path), "resnet18", logger)
    one_line_user_error(excinfo, str(path), "1000-class head", "--class_num 1000")
    np.testing.assert_array_equal(net.conv1.weight.asnumpy(), before)

    report = load_weights_report(net, str(path), "resnet18", logger, allow_new_head=True)
    assert report.new_head and "fc.weight" not in report.loaded
    np.testing.assert_array_equal(net.fc.weight.asnumpy(), fresh_fc)
    np.testing.assert_array_equal(net.conv1.weight.asnumpy(), values["conv1.weight"])
    assert "1000-class head, this run has 10 classes" in caplog.text and "re-initialised head" in caplog.text


@pytest.mark.slow
def test_same_class_count_loads_the_head_too(foreign_checkpoints, logger):
    path, _, values = foreign_checkpoints(MINDCV, "resnet18")
    net = build_resnet("resnet18", 10)
    report = load_weights_report(net, str(path), "resnet18", logger, allow_new_head=True)
    assert not report.new_head
    np.testing.assert_array_equal(net.fc.weight.asnumpy(), values["classifier.weight"])


@pytest.mark.slow
def test_zoo_se_resnet_is_refused(tmp_path, logger):
    values = randomise(build_resnet("resnet50", 10), seed=13)
    se = {("conv1_0.weight" if n == "conv1.weight" else n.replace("downsample", "down_sample_layer")): v
          for n, v in values.items()}
    se["layer3.5.se_dense_0.weight"] = np.zeros((256, 1024), np.float32)
    path = tmp_path / "se.ckpt"
    ms.save_checkpoint([{"name": n, "data": ms.Tensor(v)} for n, v in se.items()], str(path))
    with pytest.raises(UserError) as excinfo:
        load_weights_report(build_resnet("resnet50", 10), str(path), "resnet50", logger)
    one_line_user_error(excinfo, str(path), "missing", "conv1.weight")


@pytest.mark.parametrize("pin, ok", [("", True), ("full", True), ("prefix", True), ("wrong", False),
                                     ("not-hex", False), ("abc", False)])
@pytest.mark.slow
def test_checkpoint_sha256_pin_on_load(foreign_checkpoints, logger, pin, ok):
    import hashlib
    path, _, _ = foreign_checkpoints(MINDCV, "resnet18")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    value = {"": "", "full": digest.upper(), "prefix": digest[:12], "wrong": ("0" if digest[0] != "0" else "1") * 64,
             "not-hex": "xyz12345", "abc": "abc"}[pin]
    net = build_resnet("resnet18", 10)
    if ok:
        load_weights_report(net, str(path), "resnet18", logger, sha256=value)
        return
    with pytest.raises(UserError) as excinfo:
        load_weights_report(net, str(path), "resnet18", logger, sha256=value)
    if pin == "wrong":
        one_line_user_error(excinfo, str(path), digest, "--checkpoint_sha256")
    else:
        one_line_user_error(excinfo, "checkpoint_sha256", "8 to 64 hex digits")


def test_pth_that_needs_unpickling_is_refused(tmp_path, logger):
    torch = pytest.importorskip("torch")
    path = tmp_path / "model.pth"
    torch.save(torch.nn.Linear(2, 2), path)  # a whole module: needs arbitrary unpickling
    with pytest.raises(UserError) as excinfo:
        load_weights_report(build_resnet("resnet18", 10), str(path), "resnet18", logger)
    one_line_user_error(excinfo, str(path), "unpickle")


@pytest.mark.parametrize("content", [b"", b"PK\x03\x04 not really a zip", b"\x80\x02 broken pickle"],
                         ids=["empty", "zip-magic", "pickle-magic"])
def test_damaged_files_are_refused_in_one_line(tmp_path, logger, content):
    path = tmp_path / "weights.pth"
    path.write_bytes(content)
    with pytest.raises(UserError) as excinfo:
        load_weights_report(build_resnet("resnet18", 10), str(path), "resnet18", logger)
    one_line_user_error(excinfo, str(path))


@pytest.mark.slow
def test_describe_weights_understands_converted_foreign_names(foreign_checkpoints):
    path, _, _ = foreign_checkpoints(ZOO, "resnet50")
    entries = read_ckpt_entries(path)
    match = match_names(entries, list(build_resnet("resnet50", 10).parameters_dict()))
    converted = {match.renamed(name): value for name, value in entries.items() if name in match.mapping}
    assert describe_weights(converted) == ("resnet50", 10)


def test_mindspore_checkpoint_with_a_torch_suffix_is_one_line(tmp_path, logger):
    """MindSpore reads .ckpt files only; a checkpoint renamed to .pth is taken for a PyTorch file and refused."""
    ms.save_checkpoint(build_resnet("resnet18", 10), str(tmp_path / "saved.ckpt"))
    path = (tmp_path / "saved.ckpt").rename(tmp_path / "misnamed.pth")
    with pytest.raises(UserError) as excinfo:
        load_weights_report(build_resnet("resnet18", 10), str(path), "resnet18", logger)
    one_line_user_error(excinfo, str(path), "not a PyTorch checkpoint")
