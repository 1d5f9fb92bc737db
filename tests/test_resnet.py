"""ResNet network: sizes, torchvision names, BatchNorm settings, initialisation, and numerical parity with
torchvision blocks and whole networks (weights copied over by renaming the BatchNorm fields only)."""
import functools
import math
from typing import Dict, Optional, Tuple

import mindspore as ms
import numpy as np
import pytest
import torch
import torchvision
from mindspore import nn
from torchvision.models import resnet as tv_resnet

from conftest import randomise_batchnorm
from src import resnet
from src.resnet import BasicBlock, Bottleneck, build_resnet, count_trainable_parameters

ms.set_context(mode=ms.PYNATIVE_MODE)

DEPTHS = ["resnet18", "resnet34", "resnet50", "resnet101", "resnet152"]
NUM_CLASSES = 10

# torch BatchNorm field -> MindSpore BatchNorm parameter; torch's num_batches_tracked has no counterpart.
BN_FIELDS = {"weight": "gamma", "bias": "beta", "running_mean": "moving_mean", "running_var": "moving_variance"}

# Per-block parity tolerances (|ms - torch| <= ATOL + RTOL * |torch|) and the whole-network relative bound.
RTOL, ATOL = 1e-5, 1e-4
NET_REL_TOL = 1e-4


# ----------------------------------------------------------------------------------------------- helpers

def is_bn_module(path: str) -> bool:
    """torchvision's BatchNorm modules are named bn1/bn2/bn3 or downsample.1."""
    return path.rsplit(".", 1)[-1] in ("bn1", "bn2", "bn3") or path == "downsample.1" \
        or path.endswith(".downsample.1")


def ms_name(torch_key: str) -> Optional[str]:
    """The MindSpore parameter name for a torch state_dict key (None for num_batches_tracked)."""
    module, _, field = torch_key.rpartition(".")
    if field == "num_batches_tracked":
        return None
    if is_bn_module(module):
        field = BN_FIELDS[field]
    return f"{module}.{field}" if module else field


def torch_to_ms_arrays(module: torch.nn.Module) -> Dict[str, np.ndarray]:
    """The torch module's state_dict as {MindSpore name: float32 array}."""
    arrays = {}
    for key, tensor in module.state_dict().items():
        name = ms_name(key)
        if name is not None:
            arrays[name] = tensor.detach().cpu().numpy().copy()
    return arrays


def copy_torch_into_ms(module: torch.nn.Module, cell: nn.Cell) -> None:
    """Loads every torch weight and BN statistic into the MindSpore cell; fails on any unmatched name."""
    params = {name: ms.Parameter(ms.Tensor(array), name=name)
              for name, array in torch_to_ms_arrays(module).items()}
    not_loaded, unused = ms.load_param_into_net(cell, params, strict_load=True)
    assert not not_loaded and not unused, (not_loaded, unused)


def assert_close(actual: np.ndarray, expected: np.ndarray, what: str,
                 rtol: float = RTOL, atol: float = ATOL) -> Tuple[float, float]:
    """Elementwise |actual - expected| <= atol + rtol*|expected|; returns (max abs diff, max rel diff)."""
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    diff = np.abs(actual.astype(np.float64) - expected.astype(np.float64))
    max_abs = float(diff.max())
    max_rel = float((diff / np.maximum(np.abs(expected), 1e-12)).max())
    bad = diff > atol + rtol * np.abs(expected)
    assert not bad.any(), (f"{what}: {int(bad.sum())}/{bad.size} elements differ; max abs diff {max_abs:.3g}, "
                           f"max rel diff {max_rel:.3g}, max |expected| {float(np.abs(expected).max()):.3g}")
    return max_abs, max_rel


@functools.lru_cache(maxsize=None)
def pristine_ms(name: str) -> resnet.ResNet:
    """A freshly initialised MindSpore network, built once per module; tests must not change its weights."""
    ms.set_seed(0)
    return build_resnet(name, num_classes=NUM_CLASSES)


@functools.lru_cache(maxsize=None)
def pristine_tv(name: str) -> torch.nn.Module:
    """torchvision's network of the same depth, built once per module."""
    torch.manual_seed(0)
    return getattr(torchvision.models, name)(num_classes=NUM_CLASSES)


def bn_cells(net: nn.Cell):
    return [(name, cell) for name, cell in net.cells_and_names() if isinstance(cell, nn.BatchNorm2d)]


# -------------------------------------------------------------------------------- sizes and output shape

@pytest.mark.parametrize("name", DEPTHS)
@pytest.mark.slow
def test_parameter_count_matches_torchvision(name):
    """Guards the layer layout: the trainable scalar count equals torchvision's for the same depth."""
    expected = sum(p.numel() for p in pristine_tv(name).parameters())
    assert count_trainable_parameters(pristine_ms(name)) == expected
    if name == "resnet50":
        assert expected == 23_528_522


@pytest.mark.parametrize("name", [DEPTHS[0], *[pytest.param(name, marks=pytest.mark.slow) for name in DEPTHS[1:]]])
def test_forward_gives_one_logit_row_per_image(name):
    """A 32x32 batch goes through every depth and gives (N, num_classes) finite logits."""
    net = pristine_ms(name)
    net.set_train(False)
    x = np.random.default_rng(1).standard_normal((2, 3, 32, 32)).astype(np.float32)
    logits = net(ms.Tensor(x)).asnumpy()
    assert logits.shape == (2, NUM_CLASSES)
    assert np.isfinite(logits).all()


def test_build_resnet_refuses_unknown_names():
    """An unknown architecture is a ValueError that lists the known ones."""
    with pytest.raises(ValueError, match="resnet50"):
        build_resnet("resnet42")


# ----------------------------------------------------------------------------------- torchvision names

def test_bn_rename_rule_finds_exactly_torchvisions_batchnorms():
    """The name rule used for the mapping (bn1/bn2/bn3/downsample.1) picks out exactly torch's BN modules."""
    for name in ("resnet18", "resnet50"):
        modules = dict(pristine_tv(name).named_modules())
        by_type = {path for path, m in modules.items() if isinstance(m, torch.nn.BatchNorm2d)}
        by_name = {path for path in modules if path and is_bn_module(path)}
        assert by_type == by_name


@pytest.mark.parametrize("name", [name if name in ("resnet18", "resnet50") else pytest.param(name, marks=pytest.mark.slow)
                                  for name in DEPTHS])  # one network of each block type in the fast loop
def test_torchvision_state_dict_maps_one_to_one_onto_parameters(name):
    """Every torch key has a same-shaped MindSpore parameter after the BN rename, and nothing is left over."""
    ms_shapes = {pname: tuple(p.shape) for pname, p in pristine_ms(name).parameters_and_names()}
    tv_shapes = {ms_name(key): tuple(t.shape) for key, t in pristine_tv(name).state_dict().items()
                 if ms_name(key) is not None}
    assert sorted(set(tv_shapes) - set(ms_shapes)) == []
    assert sorted(set(ms_shapes) - set(tv_shapes)) == []
    mismatched = {k: (ms_shapes[k], tv_shapes[k]) for k in tv_shapes if ms_shapes[k] != tv_shapes[k]}
    assert mismatched == {}
    # load_param_into_net looks parameters up by Parameter.name, which must be the same hierarchical name.
    assert set(pristine_ms(name).parameters_dict()) == set(ms_shapes)


@pytest.mark.parametrize("name, expected", [
    ("resnet18", {"conv1.weight": (64, 3, 7, 7), "bn1.gamma": (64,), "bn1.moving_variance": (64,),
                  "layer1.0.conv2.weight": (64, 64, 3, 3), "layer2.0.downsample.0.weight": (128, 64, 1, 1),
                  "layer2.0.downsample.1.gamma": (128,), "fc.weight": (10, 512), "fc.bias": (10,)}),
    ("resnet50", {"conv1.weight": (64, 3, 7, 7), "bn1.gamma": (64,), "bn1.moving_variance": (64,),
                  "layer1.0.conv2.weight": (64, 64, 3, 3), "layer2.0.downsample.0.weight": (512, 256, 1, 1),
                  "layer2.0.downsample.1.gamma": (512,), "fc.weight": (10, 2048), "fc.bias": (10,)}),
])
def test_names_the_issue_asks_for_exist(name, expected):
    """The exact parameter names (and shapes) a torchvision checkpoint needs."""
    shapes = {pname: tuple(p.shape) for pname, p in pristine_ms(name).parameters_and_names()}
    assert {k: shapes.get(k) for k in expected} == expected


# ------------------------------------------------------------------------------------ BatchNorm settings

@pytest.mark.parametrize("name", ["resnet18", "resnet50"])
def test_every_batchnorm_uses_torch_default_eps_and_momentum(name):
    """eps 1e-5 and momentum 0.9 in MindSpore's convention, i.e. torch's 0.1 in the update op."""
    torch_bn = torch.nn.BatchNorm2d(1)
    cells = bn_cells(pristine_ms(name))
    n_torch = sum(isinstance(m, torch.nn.BatchNorm2d) for m in pristine_tv(name).modules())
    assert len(cells) == n_torch
    assert resnet.BN_EPS == torch_bn.eps and resnet.BN_MOMENTUM == pytest.approx(1 - torch_bn.momentum)
    for path, cell in cells:
        # The cell stores 1 - momentum (the torch convention) and hands it to the training BatchNorm op.
        assert 1.0 - cell.momentum == pytest.approx(0.9), path
        assert cell.bn_train.momentum == pytest.approx(torch_bn.momentum), path
        assert cell.eps == pytest.approx(1e-5, rel=1e-9), path
        assert cell.bn_train.epsilon == pytest.approx(1e-5) and cell.bn_infer.epsilon == pytest.approx(1e-5), path
        assert cell.use_batch_statistics is None, path  # follows set_train


# ------------------------------------------------------------------------------------------ initialisation

@pytest.mark.parametrize("name", ["resnet18", "resnet50"])
def test_conv_weights_are_he_normal_fan_out(name):
    """Each conv weight is zero-mean normal with std sqrt(2 / fan_out), fan_out = out_channels * kh * kw."""
    convs = [(path, cell) for path, cell in pristine_ms(name).cells_and_names() if isinstance(cell, nn.Conv2d)]
    assert convs
    for path, cell in convs:
        w = cell.weight.asnumpy().astype(np.float64)
        out_ch, in_ch, kh, kw = w.shape
        expected_std = math.sqrt(2.0 / (out_ch * kh * kw))
        # >= 9,408 samples per layer: the std estimate is within ~0.8 % (1 sigma), so 5 % is a loose bound,
        # yet fan_in would be off by 2x or more for the stem and the 1x1 convolutions of a Bottleneck.
        assert w.std() == pytest.approx(expected_std, rel=0.05), (path, w.shape, w.std(), expected_std)
        assert abs(w.mean()) < 0.05 * expected_std, (path, w.mean())
    # The stem distinguishes fan_out (64*49) from fan_in (3*49) by a factor sqrt(64/3) ~ 4.6 in std.
    stem = pristine_ms(name).conv1.weight.asnumpy()
    assert stem.std() < 0.5 * math.sqrt(2.0 / (3 * 7 * 7))


@pytest.mark.parametrize("name", ["resnet18", "resnet50"])
def test_batchnorm_and_dense_initialisation(name):
    """BN gamma ones / beta zeros / stats 0 and 1; Dense bias zero and weight uniform in +-1/sqrt(fan_in)."""
    net = pristine_ms(name)
    for path, cell in bn_cells(net):
        assert np.all(cell.gamma.asnumpy() == 1.0), path
        assert np.all(cell.beta.asnumpy() == 0.0), path
        assert np.all(cell.moving_mean.asnumpy() == 0.0), path
        assert np.all(cell.moving_variance.asnumpy() == 1.0), path
    weight = net.fc.weight.asnumpy().astype(np.float64)
    fan_in = weight.shape[1]
    bound = 1.0 / math.sqrt(fan_in)  # HeUniform(negative_slope=sqrt(5)): gain sqrt(1/3) * sqrt(3/fan_in)
    assert np.all(net.fc.bias.asnumpy() == 0.0)
    assert np.abs(weight).max() <= bound * (1 + 1e-6)
    assert np.abs(weight).max() >= 0.98 * bound  # fills the interval, not a narrower one
    assert weight.std() == pytest.approx(bound / math.sqrt(3), rel=0.05)


def _last_bn_gammas(net: resnet.ResNet):
    """Names of each residual block's last BN gamma, derived from the block type (bn2 / bn3)."""
    names = set()
    for path, cell in net.cells_and_names():
        if isinstance(cell, BasicBlock):
            names.add(f"{path}.bn2.gamma")
        elif isinstance(cell, Bottleneck):
            names.add(f"{path}.bn3.gamma")
    return names


@pytest.mark.parametrize("name, blocks", [("resnet18", 8), pytest.param("resnet50", 16, marks=pytest.mark.slow)])
def test_zero_init_residual_zeroes_only_each_blocks_last_bn(name, blocks):
    """zero_init_residual=True zeroes bn2 (BasicBlock) / bn3 (Bottleneck) gamma of every block only."""
    net = build_resnet(name, num_classes=NUM_CLASSES, zero_init_residual=True)
    last = _last_bn_gammas(net)
    assert len(last) == blocks
    gammas = {pname: p.asnumpy() for pname, p in net.parameters_and_names() if pname.endswith(".gamma")}
    assert last <= set(gammas)
    for pname, value in gammas.items():
        expected = 0.0 if pname in last else 1.0
        assert np.all(value == expected), (pname, value[:4])
    # Default: no gamma is zero.
    default = pristine_ms(name)
    assert all(np.all(p.asnumpy() == 1.0) for pname, p in default.parameters_and_names() if pname.endswith(".gamma"))


def test_zero_init_residual_blocks_start_as_identity():
    """With the last BN zeroed, a block without downsample maps a non-negative input to itself (eval)."""
    net = build_resnet("resnet18", num_classes=NUM_CLASSES, zero_init_residual=True)
    net.set_train(False)
    x = np.maximum(np.random.default_rng(2).standard_normal((2, 64, 8, 8)), 0).astype(np.float32)
    out = net.layer1(ms.Tensor(x)).asnumpy()
    np.testing.assert_array_equal(out, x)


# ---------------------------------------------------------------------------- per-block parity with torch

def _block_pair(kind: str, inplanes: int, planes: int, stride: int):
    """A MindSpore block and torchvision's block of the same configuration (downsample when needed)."""
    ms_cls, tv_cls = (BasicBlock, tv_resnet.BasicBlock) if kind == "basic" else (Bottleneck, tv_resnet.Bottleneck)
    out = planes * ms_cls.expansion
    ms_down = tv_down = None
    if stride != 1 or inplanes != out:
        ms_down = nn.SequentialCell([resnet.conv1x1(inplanes, out, stride), resnet.batch_norm(out)])
        tv_down = torch.nn.Sequential(tv_resnet.conv1x1(inplanes, out, stride), torch.nn.BatchNorm2d(out))
    return ms_cls(inplanes, planes, stride, ms_down), tv_cls(inplanes, planes, stride, tv_down)


BLOCK_CASES = {
    "basic_stride1": ("basic", 64, 64, 1),
    "basic_stride2_downsample": ("basic", 64, 128, 2),
    "bottleneck_stride1_downsample": ("bottleneck", 64, 64, 1),
    "bottleneck_stride2_downsample": ("bottleneck", 256, 128, 2),
}


# The fast loop keeps the stride-2 cases (each block type, with its downsample); the stride-1 cases are slow.
@pytest.fixture(params=[name if "stride2" in name else pytest.param(name, marks=pytest.mark.slow)
                        for name in sorted(BLOCK_CASES)], name="blocks")
def fixture_blocks(request):
    """(MindSpore block, torch block, input): same weights, random BN statistics, input (4, C, 16, 16)."""
    kind, inplanes, planes, stride = BLOCK_CASES[request.param]
    torch.manual_seed(0)
    ms_block, tv_block = _block_pair(kind, inplanes, planes, stride)
    assert (tv_block.downsample is None) == (request.param == "basic_stride1")
    randomise_batchnorm(tv_block, np.random.default_rng(3), batches_tracked=False)
    copy_torch_into_ms(tv_block, ms_block)
    x = np.random.default_rng(4).standard_normal((4, inplanes, 16, 16)).astype(np.float32)
    return ms_block, tv_block, x


def test_block_eval_parity(blocks):
    """Eval mode (moving statistics) gives torch's output."""
    ms_block, tv_block, x = blocks
    ms_block.set_train(False)
    tv_block.eval()
    with torch.no_grad():
        expected = tv_block(torch.from_numpy(x)).numpy()
    assert_close(ms_block(ms.Tensor(x)).asnumpy(), expected, "eval output")


def test_block_train_parity(blocks):
    """Train mode (batch statistics) gives torch's output."""
    ms_block, tv_block, x = blocks
    ms_block.set_train(True)
    tv_block.train()
    with torch.no_grad():
        expected = tv_block(torch.from_numpy(x)).numpy()
    assert_close(ms_block(ms.Tensor(x)).asnumpy(), expected, "train output")


def test_block_moving_statistics_follow_torch_running_statistics(blocks):
    """After one train-mode forward, moving_mean/moving_variance equal torch's running_mean/running_var
    (momentum 0.9 here is torch's 0.1; the variance update uses the unbiased batch variance in both)."""
    ms_block, tv_block, x = blocks
    before = {k: v.copy() for k, v in torch_to_ms_arrays(tv_block).items()}
    ms_block.set_train(True)
    tv_block.train()
    with torch.no_grad():
        tv_block(torch.from_numpy(x))
    ms_block(ms.Tensor(x))
    after_tv = torch_to_ms_arrays(tv_block)
    after_ms = {name: p.asnumpy() for name, p in ms_block.parameters_and_names()}
    stats = [k for k in after_tv if k.endswith((".moving_mean", ".moving_variance"))]
    assert len(stats) == 2 * sum(isinstance(m, torch.nn.BatchNorm2d) for m in tv_block.modules())
    for key in stats:
        assert not np.allclose(after_tv[key], before[key]), key  # the statistic really moved
        assert_close(after_ms[key], after_tv[key], key)


# -------------------------------------------------------------------------------- whole-network parity

def test_maxpool_matches_torch_padded_maxpool_on_relu_output():
    """Zero padding + valid MaxPool2d equals torch's MaxPool2d(3, 2, padding=1) on non-negative input."""
    pool = pristine_ms("resnet18").maxpool
    rng = np.random.default_rng(5)
    for size in (16, 17):
        x = np.maximum(rng.standard_normal((2, 4, size, size)), 0).astype(np.float32)
        expected = torch.nn.MaxPool2d(3, 2, padding=1)(torch.from_numpy(x)).numpy()
        np.testing.assert_array_equal(pool(ms.Tensor(x)).asnumpy(), expected)


@pytest.mark.parametrize("name", ["resnet18", "resnet50"])
@pytest.mark.slow
def test_whole_network_eval_parity(name):
    """torchvision weights loaded by name give torchvision's eval logits at 64x64."""
    torch.manual_seed(0)
    tv_net = getattr(torchvision.models, name)(num_classes=NUM_CLASSES)
    randomise_batchnorm(tv_net, np.random.default_rng(6), batches_tracked=False)
    tv_net.eval()
    ms_net = build_resnet(name, num_classes=NUM_CLASSES)
    copy_torch_into_ms(tv_net, ms_net)
    ms_net.set_train(False)
    x = np.random.default_rng(7).standard_normal((2, 3, 64, 64)).astype(np.float32)
    with torch.no_grad():
        expected = tv_net(torch.from_numpy(x)).numpy()
    actual = ms_net(ms.Tensor(x)).asnumpy()
    scale = float(np.abs(expected).max())
    max_abs = float(np.abs(actual - expected).max())
    assert scale > 0
    assert max_abs <= NET_REL_TOL * scale, f"max abs diff {max_abs:.3g} on logits up to {scale:.3g}"
