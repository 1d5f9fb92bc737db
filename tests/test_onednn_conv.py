"""The blocked-layout oneDNN convolutions (native/onednn_conv.cc via src/onednn_conv.py): numerically MindSpore's
Conv2d, really on blocked layouts, and a clear fallback or refusal wherever they can't run."""
import os
import re
import shutil
import subprocess
import sys
from typing import List, Optional, Tuple

import numpy as np
import pytest

import mindspore as ms
from mindspore import nn

from conftest import (REPO, assert_one_line_error, avx2_capped_case, cpu_has_avx512, native_channel_block,
                      onednn_exec_fields, onednn_exec_log, rel_diff, run_with_onednn_log, script_env)
from src.errors import UserError
from src.onednn_conv import BlockedConv2d, channel_block, resolve_conv_implementation
from src.resnet import conv_bn, conv_bn_add_relu, conv_bn_relu


# (in, out, kernel, stride, padding, input size): every kind of convolution in the ResNets.
# Input size 1: one-pixel convolutions, which the training path runs as matrix products of the centre tap.
# Input size 2 at stride 2: one output pixel from a 2x2 map (into layer4 at 32x32), matrix products of the gathered
# input pixels and the taps they meet (four for 3x3, one for 1x1).
# 1x1 stride 1 from 256 channels: on AVX2 the fused convolution + BatchNorm runs its input gradient as a forward
# convolution with the kernels transposed. 1x1 stride 1 on a 2x2 map: with AVX-512 the fused call's weight gradient is
# a matrix product over the batch's pixels.
CASES = [(3, 64, 7, 2, 3, 32), (64, 64, 3, 1, 1, 8), (128, 128, 3, 2, 1, 8), (64, 256, 1, 1, 0, 8),
         (256, 512, 1, 2, 0, 8), (512, 512, 3, 1, 1, 1), (512, 256, 1, 1, 0, 1), (64, 128, 3, 2, 1, 1),
         (64, 128, 3, 2, 1, 2), (128, 256, 1, 2, 0, 2), (256, 128, 1, 1, 0, 4), (1024, 256, 1, 1, 0, 2)]


def conv_pair(ci, co, k, s, p):
    """nn.Conv2d and BlockedConv2d with the same weights, drawn as nn.Conv2d's default initializer draws them
    (uniform within 1 / sqrt(fan_in)) but from a generator of their own: the global one's state depends on the
    tests run before in the process, and some draws put a BatchNorm output within rounding of a ReLU's zero."""
    kwargs = dict(stride=s, pad_mode="pad" if p else "valid", padding=p, has_bias=False)
    plain, blocked = nn.Conv2d(ci, co, k, **kwargs), BlockedConv2d(ci, co, k, **kwargs)
    bound = 1 / np.sqrt(ci * k * k)
    weights = np.random.default_rng(7).uniform(-bound, bound, (co, ci, k, k)).astype(np.float32)
    plain.weight.set_data(ms.Tensor(weights))
    blocked.weight.set_data(ms.Tensor(weights))
    return plain, blocked


def forward_and_gradients(conv: nn.Cell, x: np.ndarray, upstream: np.ndarray):
    def objective(images):
        return (conv(images) * ms.Tensor(upstream)).sum()
    grad_fn = ms.value_and_grad(objective, grad_position=0, weights=conv.trainable_params())
    _, (dx, (dw,)) = grad_fn(ms.Tensor(x))
    return conv(ms.Tensor(x)).asnumpy(), dx.asnumpy(), dw.asnumpy()


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[2]}x{c[2]}s{c[3]}p{c[4]}_{c[0]}to{c[1]}_h{c[5]}")
@pytest.mark.parametrize("mode", [pytest.param(ms.GRAPH_MODE, marks=pytest.mark.slow), ms.PYNATIVE_MODE],
                         ids=["graph", "pynative"])
def test_forward_and_gradients_equal_mindspore_conv2d(case, mode):
    ms.set_context(mode=mode)
    ci, co, k, s, p, h = case
    plain, blocked = conv_pair(ci, co, k, s, p)
    assert blocked.blocked_op is not None
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, ci, h, h)).astype(np.float32)
    out_h = (h + 2 * p - k) // s + 1
    upstream = rng.standard_normal((4, co, out_h, out_h)).astype(np.float32)
    for expected, actual in zip(forward_and_gradients(plain, x, upstream), forward_and_gradients(blocked, x, upstream)):
        assert actual.shape == expected.shape
        assert rel_diff(actual, expected) < 1e-5  # float32 rounding of another summation order


@pytest.mark.slow
def test_unsupported_configurations_run_mindspore_conv2d():
    ms.set_context(mode=ms.GRAPH_MODE)
    x = ms.Tensor(np.random.default_rng(1).standard_normal((2, 8, 9, 9)).astype(np.float32))
    for kwargs in (dict(group=2, pad_mode="valid"), dict(dilation=2, pad_mode="valid"),
                   dict(stride=3, pad_mode="valid"), dict(pad_mode="same", stride=2), dict(pad_mode="pad", padding=5)):
        blocked = BlockedConv2d(8, 8, 3, has_bias=True, **kwargs)
        plain = nn.Conv2d(8, 8, 3, has_bias=True, **kwargs)
        plain.weight.set_data(blocked.weight.data)
        plain.bias.set_data(blocked.bias.data)
        assert blocked.blocked_op is None, kwargs
        np.testing.assert_array_equal(blocked(x).asnumpy(), plain(x).asnumpy())


def test_bias_is_added():
    ms.set_context(mode=ms.GRAPH_MODE)
    blocked = BlockedConv2d(4, 6, 3, pad_mode="pad", padding=1, has_bias=True, bias_init="normal")
    plain = nn.Conv2d(4, 6, 3, pad_mode="pad", padding=1, has_bias=True)
    plain.weight.set_data(blocked.weight.data)
    plain.bias.set_data(blocked.bias.data)
    x = ms.Tensor(np.random.default_rng(2).standard_normal((2, 4, 5, 5)).astype(np.float32))
    assert blocked.blocked_op is not None
    assert rel_diff(blocked(x).asnumpy(), plain(x).asnumpy()) < 1e-5


def test_resolution():
    assert resolve_conv_implementation("auto", "CPU")[0] == "onednn_blocked"
    assert resolve_conv_implementation("mindspore", "CPU")[0] == "mindspore"
    assert resolve_conv_implementation("auto", "Ascend")[0] == "mindspore"
    with pytest.raises(UserError, match="onednn_blocked runs on CPU only, not GPU"):
        resolve_conv_implementation("onednn_blocked", "GPU")


VERBOSE_SCRIPT = """
import json, sys
import numpy as np, mindspore as ms
from src.resnet import build_resnet
ms.set_context(mode=ms.GRAPH_MODE)
net = build_resnet("resnet50", 10, conv_implementation="onednn_blocked")
net.set_train(False)
print(json.dumps(float(np.abs(net(ms.Tensor(np.ones((2, 3, 32, 32), np.float32))).asnumpy()).sum())))
"""


WINOGRAD_TRAINING_LAYERS = 3
PIXEL_ROWS_WEIGHT_GRADIENTS = 12
TRANSPOSED_INPUT_GRADIENT_LAYERS = 23
# On AVX2 the 1x1 stride-2 layers with at least 128 input channels run their input gradient so too, then spread to
# the even pixels: at 32x32 layer2's and layer3's shortcuts (layer4's is a matrix product of the gathered pixels).
STRIDED_TRANSPOSED_INPUT_GRADIENT_LAYERS = 2


@pytest.mark.parametrize("isa", [pytest.param(None, id="uncapped"), avx2_capped_case("AVX2", id="AVX2")])
@pytest.mark.slow
def test_oneDNN_runs_training_batchnorm_on_the_convolutions_blocked_output(isa, default_training_log):
    """A training step: every BatchNorm runs in oneDNN's jit code on channel blocks (16 with AVX-512, else 8),
    forward on batch statistics and backward, and no convolution pass runs a reference kernel (with AVX-512, none
    runs GEMM either). At 32x32 layer4's seven one-pixel convolutions (1x1 input and output) run as three matrix
    products each, on the plain weights, and so do its two stride-2 ones (a 2x2 input into one pixel), on the
    gathered input pixels and taps, and layer3's five 3x3 stride-1 ones on 2x2 maps, on weights expanded per pair
    of pixels; with AVX-512 so do the weight gradients of the 1x1 stride-1 ones on 2x2 maps, over the batch's pixels;
    the input gradients of the 3x3 stride-1 layers on large enough maps run natively (Winograd), and on
    AVX2 their weight gradients too, and so do those products' forward and input gradient. The images' gradient is
    not computed."""
    block = native_channel_block(isa)
    log = (default_training_log if isa is None else training_steps_log(isa))[0]  # the first step's
    norms = [fields for fields in log if fields[5] == "batch_normalization"]
    assert sorted(fields[7] for fields in norms) == ["backward"] * 53 + ["forward_training"] * 53
    for fields in norms:
        assert "ref" not in fields[6] and f"blocked:aBcd{block}b:" in fields[8], fields
    convolutions = [fields for fields in log if fields[5] == "convolution"]
    kinds = sorted(fields[7] for fields in convolutions)
    # No backward_data for the stem: nothing uses the images' gradient, so the graph drops its native call.
    # layer1's three 3x3 stride-1 layers (8x8 maps: 32 tiles of 2x2 at batch 2) run their input gradient natively
    # (Winograd), and on AVX2 their weight gradient too; their forward stays oneDNN's, and so do layer2's (4x4 maps:
    # 8 tiles).
    weight_gradients = WINOGRAD_TRAINING_LAYERS if block == 8 else 0
    # With AVX-512 the weight gradients of the 1x1 stride-1 layers on 2x2 maps are matrix products over the batch's
    # pixels: layer3's eleven (five 1024 -> 256, six 256 -> 1024) and layer4's first 1024 -> 512.
    pixel_rows = 0 if block == 8 else PIXEL_ROWS_WEIGHT_GRADIENTS
    # On AVX2 the input gradients of the 1x1 layers with at least 128 input channels run as forward convolutions
    # with the kernels transposed: of the stride-1 ones, layer1's two 256 -> 64, layer2's eight, layer3's twelve and
    # layer4's first (on a 2x2 map; its others are one-pixel products); of the stride-2 ones, layer2's and layer3's.
    transposed = TRANSPOSED_INPUT_GRADIENT_LAYERS + STRIDED_TRANSPOSED_INPUT_GRADIENT_LAYERS if block == 8 else 0
    assert kinds == (["backward_data"] * (38 - WINOGRAD_TRAINING_LAYERS - transposed)
                     + ["backward_weights"] * (39 - weight_gradients - pixel_rows)
                     + ["forward_training"] * (39 + transposed))
    for fields in convolutions:
        assert "ref" not in fields[6] and (block == 8 or "gemm" not in fields[6]), fields
        assert not re.search(r"oh1k.*ow1k", fields[-2]), fields  # one-pixel outputs are matrix products
        channels, kernel, stride = map(int, re.search(r"_ic(\d+)oc\d+_ih\d+oh\d+kh(\d+)sh(\d+)", fields[-2]).groups())
        if block == 8 and fields[7] == "backward_data" and kernel == 1:
            assert channels < 128, fields
    # The stem's max pool: oneDNN's jit pooling on channel blocks, its argmax kept for the gradient.
    pools = [fields for fields in log if fields[5] == "pooling"]
    assert sorted(fields[7] for fields in pools) == ["backward_data", "forward_training"], pools
    for fields in pools:
        assert "ref" not in fields[6] and f"blocked:aBcd{block}b:" in fields[8], fields
    products = [fields for fields in log  # the classifier's matmuls have its 10 classes as a dimension
                 if fields[5] == "matmul" and "10" not in re.split("[x:]", fields[-2])]
    # 14 convolutions, 3 products each. On AVX2 the forward and input-gradient products of the batch (2 rows) run
    # natively, and the weight gradients, (O x 2) x (2 x I), stay in oneDNN. With AVX-512, the 1x1 layers' weight
    # gradients on 2x2 maps, (O x 8) x (8 x I) over 2 images of 4 pixels, I in column blocks where oneDNN splits it.
    assert len(products) == (14 if block == 8 else 42 + pixel_rows), [fields[-2] for fields in products]
    if block == 8:
        assert all(re.fullmatch(r"\d+x2:2x\d+", fields[-2]) for fields in products), [f[-2] for f in products]
    else:
        over_pixels = [re.fullmatch(r"(?:1x)?(\d+)x8:(?:(\d+)x)?8x(\d+)", fields[-2]) for fields in products]
        shapes = sorted((int(m[1]), int(m[2] or 1) * int(m[3])) for m in over_pixels if m)
        assert shapes == sorted([(256, 1024)] * 5 + [(1024, 256)] * 6 + [(512, 1024)]), shapes
    for fields in products:
        # Plain (N, C) and (O, I) matrices, or views of them split into a batch of column blocks: no channel blocks.
        assert "ref" not in fields[6] and not re.search(r":blocked:\w*\d", fields[8]), fields


@pytest.mark.slow
def test_oneDNN_runs_the_convolutions_on_blocked_layouts():
    """oneDNN's own log of what ran: every convolution on a blocked layout, none through GEMM."""
    convolutions = [fields for fields in onednn_exec_log(["-c", VERBOSE_SCRIPT]) if fields[5] == "convolution"]
    assert len(convolutions) == 53  # resnet50's convolutions, one forward each
    for fields in convolutions:
        line = ",".join(fields)
        implementation, layouts, problem = fields[6], fields[8], fields[11]
        assert "gemm" not in implementation and "ref" not in implementation, line
        assert re.search(r"dst:f32:a:blocked:aBcd(8|16)b", layouts), line  # channels in blocks of 8 or 16
        if not problem.startswith("mb2_ic3oc"):  # the 3-channel stem may read its input plain
            assert re.search(r"src:f32:a:blocked:aBcd(8|16)b", layouts), line


@pytest.mark.slow
def test_stale_library_falls_back_under_auto_and_is_refused_when_asked_for(tmp_path, cifar_dir):
    """A native/onednn_conv.cc edited after the build: auto logs why and uses MindSpore's Conv2D."""
    copy = tmp_path / "repo"
    shutil.copytree(REPO, copy, ignore=shutil.ignore_patterns("data", "output", "build", "*.egg-info", ".git",
                                                              "__pycache__", "rank_*"))
    with open(copy / "native" / "onednn_conv.cc", "a", encoding="utf-8") as source:
        source.write("// edited\n")
    args = ["--data_path", str(cifar_dir), "--output_path", str(tmp_path / "out"), "--checkpoint_path",
            str(tmp_path / "missing.ckpt")]
    env = {key: value for key, value in os.environ.items() if key != "ONEDNN_MAX_CPU_ISA"}
    auto = subprocess.run([sys.executable, "eval.py", *args], cwd=copy, env=env, capture_output=True, text=True,
                          timeout=300)
    assert "conv_implementation auto: using mindspore (the installed native convolution library was built from " \
           "another onednn_conv.cc: run python -m pip install ./native)" in auto.stdout, auto.stdout[-2000:]
    assert "ONEDNN_MAX_CPU_ISA=AVX2 (project default), convolutions: mindspore" in auto.stdout
    asked = subprocess.run([sys.executable, "eval.py", *args, "--conv_implementation", "onednn_blocked"], cwd=copy,
                           env=env, capture_output=True, text=True, timeout=300)
    assert_one_line_error(asked, "conv_implementation onednn_blocked", "python -m pip install ./native")


@pytest.mark.slow
def test_build_without_a_compiler_installs_and_records_why(tmp_path):
    """pip install ./native with no working C++ compiler: installed, no library, the reason kept."""
    target = tmp_path / "site"
    env = dict(os.environ, CXX=str(tmp_path / "no-such-compiler"))
    process = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(target),
                              str(REPO / "native")], env=env, capture_output=True, text=True, timeout=600)
    assert process.returncode == 0, process.stdout[-2000:] + process.stderr[-2000:]
    package = target / "resnet_onednn_conv"
    assert not (package / "libonednn_conv.so").exists()
    assert "no-such-compiler" in (package / "BUILD_ERROR.txt").read_text()
    probe = ("from src.onednn_conv import resolve_conv_implementation; "
             "print(' | '.join(resolve_conv_implementation('auto', 'CPU')))")
    resolved = subprocess.run([sys.executable, "-c", probe], cwd=REPO, env=dict(os.environ, PYTHONPATH=str(target)),
                              capture_output=True, text=True, timeout=120)
    assert resolved.stdout.startswith("mindspore | the native convolution library failed to build ([Errno 2] "
                                      "No such file or directory"), resolved.stdout + resolved.stderr
    assert "no-such-compiler" in resolved.stdout


def conv_batchnorm_results(conv: nn.Conv2d, bn: nn.BatchNorm2d, x: np.ndarray, upstream: np.ndarray,
                           blocked: bool = False, relu: bool = False, identity: Optional[np.ndarray] = None,
                           relu_gradient_by_users: bool = False):
    """y, the moving statistics after one training forward, and the gradients of (y * upstream).sum() for x,
    the weights, gamma and beta (and the identity, where given): through conv_bn (relu: conv_bn_relu; with an
    identity conv_bn_add_relu), as the ResNet blocks call it (blocked: on channel blocks, as a training step of
    ResNet does, reordered from and to the plain layout around it; relu_gradient_by_users: the block's end leaves
    the ReLU's gradient to its output's user, ReluOutputGradient, as ResNet's last block does)."""
    from src.onednn_conv import ChannelBlocks, ReluOutputGradient
    bn.set_train(True)
    conv.set_train(True)
    to_blocks, from_blocks = ChannelBlocks(True), ChannelBlocks(False)
    user = ReluOutputGradient() if relu_gradient_by_users else nn.Identity()

    def forward(images, residual=None):
        if residual is not None:
            if blocked:
                return from_blocks(user(conv_bn_add_relu(conv, bn, nn.ReLU(), to_blocks(images), to_blocks(residual),
                                                         True, relu_gradient_by_users)))
            return conv_bn_add_relu(conv, bn, nn.ReLU(), images, residual)
        if relu:
            if blocked:
                return from_blocks(conv_bn_relu(conv, bn, nn.ReLU(), to_blocks(images), True))
            return conv_bn_relu(conv, bn, nn.ReLU(), images)
        if blocked:
            return from_blocks(conv_bn(conv, bn, to_blocks(images), True))
        return conv_bn(conv, bn, images)

    def objective(images, *residual):
        return (forward(images, *residual) * ms.Tensor(upstream)).sum()
    inputs = [ms.Tensor(x)] + ([] if identity is None else [ms.Tensor(identity)])
    grad_fn = ms.grad(objective, grad_position=tuple(range(len(inputs))), weights=[conv.weight, bn.gamma, bn.beta])
    input_gradients, (dw, dgamma, dbeta) = grad_fn(*inputs)
    start = [bn.moving_mean.asnumpy(), bn.moving_variance.asnumpy()]  # the gradient's forward moved them once
    y = forward(*inputs).asnumpy()
    return [y, bn.moving_mean.asnumpy(), bn.moving_variance.asnumpy(), input_gradients[0].asnumpy(), dw.asnumpy(),
            dgamma.asnumpy(), dbeta.asnumpy()] + [gradient.asnumpy() for gradient in input_gradients[1:]], start


# Cases of the fused convolution + BatchNorm on channel blocks. h 2 at stride 1 and padding 1: every output pixel
# meets every input pixel (layer3 at 32x32), a matrix product of the whole input with weights expanded per pixel pair.
# 3x3 stride-1 layers' gradients on larger maps run Winograd's F(2x2, 3x3) (with AVX-512 the input gradient only);
# h 7 cuts its last 2x2 tiles, and 32 -> 48 channels gives the input gradient other panels than the weight gradient.
# On AVX2 1x1 stride-2 layers from 128 channels spread a forward convolution's result to the even pixels (h 7: the
# last input row and column are even, 4 output rows from 7).
BLOCKED_CASES = [(64, 64, 3, 1, 1, 8), (64, 128, 3, 1, 1, 2), (256, 256, 3, 1, 1, 2), (128, 128, 3, 2, 1, 4),
                 (256, 1024, 1, 1, 0, 2), (32, 48, 3, 1, 1, 7), (256, 512, 1, 2, 0, 8), (128, 256, 1, 2, 0, 7)]
# The forward and the input gradient run F(4x4, 3x3) where their products are large (tiles x in x out at least 2^23,
# as ResNet-50's 3x3 layers at 224x224), and with AVX-512 the weight gradient too: at batch 30, 480 tiles of 4x4, the
# 15x15 maps' last ones cut; 144 input channels leave the weight gradient's products one panel unpaired. Its output,
# 1,080,000 numbers, is past kFusedBatchNormNumbers: as a residual block's end it runs the native BatchNorm.
LARGE_WINOGRAD_CASE, LARGE_WINOGRAD_BATCH = (144, 160, 3, 1, 1, 15), 30


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[2]}x{c[2]}s{c[3]}p{c[4]}_{c[0]}to{c[1]}_h{c[5]}")
@pytest.mark.parametrize("mode", [pytest.param(ms.GRAPH_MODE, marks=pytest.mark.slow), ms.PYNATIVE_MODE],
                         ids=["graph", "pynative"])
@pytest.mark.parametrize("deferred", [False, True], ids=["", "deferred_input_gradient"])
def test_convolution_with_batchnorm_equals_conv2d_then_batchnorm2d(case, mode, deferred):
    """Training: the fused convolution + BatchNorm gives nn.Conv2d + nn.BatchNorm2d's output, moving statistics
    and gradients (input, weights, gamma, beta); also with the input gradient in a native call of its own (a
    network's first convolution), which runs when the input gradient is asked for, as here."""
    check_convolution_with_batchnorm(case, mode, deferred, blocked=False)


@pytest.mark.parametrize("case", BLOCKED_CASES, ids=lambda c: f"{c[2]}x{c[2]}s{c[3]}p{c[4]}_{c[0]}to{c[1]}_h{c[5]}")
@pytest.mark.parametrize("mode", [pytest.param(ms.GRAPH_MODE, marks=pytest.mark.slow), ms.PYNATIVE_MODE],
                         ids=["graph", "pynative"])
def test_convolution_with_batchnorm_on_channel_blocks_equals_conv2d_then_batchnorm2d(case, mode):
    """The same on channel blocks in and out, as ResNet's training step runs layer1..layer4."""
    check_convolution_with_batchnorm(case, mode, False, blocked=True)


@pytest.mark.parametrize("case", BLOCKED_CASES + [CASES[5], CASES[8]],
                         ids=lambda c: f"{c[2]}x{c[2]}s{c[3]}p{c[4]}_{c[0]}to{c[1]}_h{c[5]}")
@pytest.mark.parametrize("mode", [pytest.param(ms.GRAPH_MODE, marks=pytest.mark.slow), ms.PYNATIVE_MODE],
                         ids=["graph", "pynative"])
@pytest.mark.parametrize("blocked", [False, True], ids=["plain", "blocked"])
def test_convolution_with_batchnorm_and_relu_equals_conv2d_batchnorm2d_relu(case, mode, blocked):
    """conv_bn_relu: the ReLU runs inside the native call (fused into oneDNN's BatchNorm, its mask kept for the
    gradient), and gives nn.Conv2d + nn.BatchNorm2d + nn.ReLU's output, statistics and gradients."""
    check_convolution_with_batchnorm(case, mode, False, blocked=blocked, relu=True)


# offset: added to the input, so that each channel's mean of the convolution's output is many times its spread
# (6300 values a channel), where BatchNorm's variance from plain sums of squares would lose its digits to
# cancellation.
@pytest.mark.parametrize("residual, users", [(False, False), (True, False), (True, True)],
                         ids=["", "add_relu", "add_relu_gradient_by_user"])
@pytest.mark.parametrize("offset", [0.0, 40.0], ids=["", "offset"])
def test_convolution_with_batchnorm_on_large_maps_equals_conv2d_then_batchnorm2d(residual, users, offset):
    """The same on channel blocks for a 3x3 layer whose Winograd products are as large as ResNet-50's at 224x224
    (its forward and gradients as F(4x4, 3x3) with AVX-512, in the uncapped rerun); also as a residual block's end
    (applying its ReLU's gradient itself, or leaving it to its output's user as in ResNet), and on inputs far from
    zero."""
    check_convolution_with_batchnorm(LARGE_WINOGRAD_CASE, ms.PYNATIVE_MODE, False, blocked=True,
                                     batch=LARGE_WINOGRAD_BATCH, residual=residual, offset=offset,
                                     relu_gradient_by_users=users)


@pytest.mark.parametrize("case", BLOCKED_CASES, ids=lambda c: f"{c[2]}x{c[2]}s{c[3]}p{c[4]}_{c[0]}to{c[1]}_h{c[5]}")
@pytest.mark.parametrize("mode", [pytest.param(ms.GRAPH_MODE, marks=pytest.mark.slow), ms.PYNATIVE_MODE],
                         ids=["graph", "pynative"])
@pytest.mark.parametrize("users", [False, True], ids=["", "gradient_by_user"])
def test_convolution_with_batchnorm_add_relu_equals_conv2d_batchnorm2d_add_relu(case, mode, users):
    """A residual block's end on channel blocks, relu(bn(conv(x)) + identity) in one native call, gives nn.Conv2d +
    nn.BatchNorm2d + add + nn.ReLU's output, moving statistics and gradients, the identity's too; also where it
    leaves its ReLU's gradient to its output's user (ReluOutputGradient), as in ResNet. These outputs are small:
    oneDNN's BatchNorm, then AddRelu's pass (the large-maps case runs the native BatchNorm)."""
    check_convolution_with_batchnorm(case, mode, False, blocked=True, residual=True, relu_gradient_by_users=users)


def check_convolution_with_batchnorm(case, mode, deferred: bool, blocked: bool, relu: bool = False,
                                     batch: int = 4, residual: bool = False, offset: float = 0.0,
                                     relu_gradient_by_users: bool = False) -> None:
    ms.set_context(mode=mode)
    ci, co, k, s, p, h = case
    plain, native = conv_pair(ci, co, k, s, p)
    assert native.batchnorm_op is not None
    if deferred:
        undeferred = native.batchnorm_op
        native.defer_input_gradient()
        assert native.batchnorm_op is not undeferred
    rng = np.random.default_rng(4)
    norms = [nn.BatchNorm2d(co, eps=1e-5, momentum=0.9) for _ in range(2)]
    for name in ("gamma", "beta", "moving_mean", "moving_variance"):
        values = ms.Tensor(rng.uniform(0.5, 1.5, co).astype(np.float32))
        for bn in norms:
            getattr(bn, name).set_data(values.copy())
    x = rng.standard_normal((batch, ci, h, h)).astype(np.float32) + np.float32(offset)
    out_h = (h + 2 * p - k) // s + 1
    upstream = rng.standard_normal((batch, co, out_h, out_h)).astype(np.float32)
    identity = None
    if residual:
        identity = rng.standard_normal(upstream.shape).astype(np.float32)
        # Where bn(conv(x)) + identity is within rounding of zero, the ReLU's decision (and so the gradient there) is
        # the rounding's: a large case has a few such numbers among a million. The gradient is taken where it is
        # not (upstream 0 there), with the sums from a BatchNorm of its own, so that the two compared keep their
        # moving statistics.
        probe = nn.BatchNorm2d(co, eps=1e-5, momentum=0.9)
        for name in ("gamma", "beta", "moving_mean", "moving_variance"):
            getattr(probe, name).set_data(getattr(norms[0], name).value().copy())
        probe.set_train(True)
        sums = probe(plain(ms.Tensor(x))).asnumpy() + identity
        upstream[np.abs(sums) < 1e-4] = 0.0
    expected, expected_start = conv_batchnorm_results(plain, norms[0], x, upstream, relu=relu, identity=identity)
    actual, actual_start = conv_batchnorm_results(native, norms[1], x, upstream, blocked, relu, identity,
                                                  relu_gradient_by_users)
    for before, after in zip(expected_start, actual_start):
        assert rel_diff(after, before) < 1e-5
    names = ["y", "moving_mean", "moving_variance", "dx", "dw", "dgamma", "dbeta", "d_identity"]
    for name, want, got in zip(names, expected, actual):
        assert got.shape == want.shape, name
        # out_h 1 at batch 4: 4 values a channel, so BatchNorm's outputs lose more digits to cancellation.
        assert rel_diff(got, want) < 1e-4, name


@pytest.mark.parametrize("batch", [20, 33])
@pytest.mark.parametrize("case, blocked", [(CASES[5], False), (CASES[6], False), (CASES[8], False),
                                           (BLOCKED_CASES[1], True)],
                         ids=["one_pixel_3x3", "one_pixel_1x1", "gathered", "small_map"])
def test_convolution_with_batchnorm_products_past_one_row_block_and_panel(case, blocked, batch):
    """The matrix products of the one-pixel, gathered and small-map convolutions with a batch of more rows than
    one block (6) and one panel (16) of the native kernel on AVX2: a second panel partly filled (20), and a last
    block of one row (33); the input gradient in a call of its own, as at a network's first convolution."""
    check_convolution_with_batchnorm(case, ms.PYNATIVE_MODE, True, blocked=blocked, batch=batch)


@pytest.mark.parametrize("size", [(8, 8), (7, 10), (56, 56)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("mode", [ms.GRAPH_MODE, ms.PYNATIVE_MODE], ids=["graph", "pynative"])
def test_relu_max_pool_equals_torch(size, mode):
    """The native ReLU + max pool of the training stem on channel blocks gives torch's ReLU then MaxPool2d(3, 2,
    padding=1), forward and gradient, on inputs with many ties and zeros (small integers): the gradient goes to the
    window's first maximum, as torch's, and none goes where the ReLU's output is zero."""
    import torch
    from src.onednn_conv import ChannelBlocks, ReluMaxPool
    ms.set_context(mode=mode)
    rng = np.random.default_rng(6)
    x = rng.integers(-3, 4, (2, 16) + size).astype(np.float32)
    pooled = ((size[0] - 1) // 2 + 1, (size[1] - 1) // 2 + 1)
    upstream = rng.standard_normal((2, 16) + pooled).astype(np.float32)
    to_blocks, pool, from_blocks = ChannelBlocks(True), ReluMaxPool(), ChannelBlocks(False)

    def objective(images):
        return (from_blocks(pool(to_blocks(images))) * ms.Tensor(upstream)).sum()
    y = from_blocks(pool(to_blocks(ms.Tensor(x)))).asnumpy()
    dx = ms.grad(objective)(ms.Tensor(x)).asnumpy()
    images = torch.tensor(x, requires_grad=True)
    expected = torch.nn.functional.max_pool2d(torch.relu(images), 3, 2, 1)
    (expected * torch.tensor(upstream)).sum().backward()
    np.testing.assert_array_equal(y, expected.detach().numpy())
    np.testing.assert_allclose(dx, images.grad.numpy(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mode", [pytest.param(ms.GRAPH_MODE, marks=pytest.mark.slow), ms.PYNATIVE_MODE],
                         ids=["graph", "pynative"])
def test_add_relu_equals_torch(mode):
    """The native residual addition + ReLU gives torch's relu(a + b), forward and the gradient of both inputs, on
    small integers (sums of exactly zero, whose gradient is zero as in torch), with NaN kept (and its gradient
    passed on, as torch's); a size that is not a multiple of the pool's chunks or of a vector."""
    import torch
    from src.onednn_conv import _add_relu_op
    ms.set_context(mode=mode)
    rng = np.random.default_rng(7)
    a, b = (rng.integers(-3, 4, (3, 16, 37, 29)).astype(np.float32) for _ in range(2))
    a[0, 0, 0, :2] = np.nan
    upstream = rng.standard_normal(a.shape).astype(np.float32)
    add_relu = _add_relu_op()

    def objective(first, second):
        return (add_relu(first, second) * ms.Tensor(upstream)).sum()
    y = add_relu(ms.Tensor(a), ms.Tensor(b)).asnumpy()
    da, db = ms.grad(objective, grad_position=(0, 1))(ms.Tensor(a), ms.Tensor(b))
    first, second = torch.tensor(a, requires_grad=True), torch.tensor(b, requires_grad=True)
    expected = torch.relu(first + second)
    (expected * torch.tensor(upstream)).sum().backward()
    np.testing.assert_array_equal(y, expected.detach().numpy())
    assert np.isnan(y[0, 0, 0, :2]).all()
    np.testing.assert_array_equal(da.asnumpy(), first.grad.numpy())
    np.testing.assert_array_equal(db.asnumpy(), second.grad.numpy())


@pytest.mark.parametrize("mode", [pytest.param(ms.GRAPH_MODE, marks=pytest.mark.slow), ms.PYNATIVE_MODE],
                         ids=["graph", "pynative"])
def test_relu_output_cells_apply_the_relu_gradient_for_the_outputs_users(mode):
    """ReluOutputFanout hands a ReLU's output x to its two users unchanged and gives x the ReLU's gradient of the sum
    of theirs in one native pass: 0 where x <= 0, else their sum in float32, NaN's passed on as torch's ReLU does
    (the op that made x then leaves that gradient out); ReluOutputGradient does so for a single user. A size that is
    not a multiple of the pool's chunks or of a vector."""
    from src.onednn_conv import ReluOutputFanout, ReluOutputGradient
    ms.set_context(mode=mode)
    rng = np.random.default_rng(11)
    x = np.maximum(rng.integers(-3, 4, (3, 16, 37, 29)), 0).astype(np.float32)  # zeros among the positives
    x[0, 0, 0, :2] = np.nan
    first, second = (rng.standard_normal(x.shape).astype(np.float32) for _ in range(2))

    class TwoUsers(nn.Cell):
        def __init__(self):
            super().__init__()
            self.fanout, self.gradient = ReluOutputFanout(), ReluOutputGradient()

        def construct(self, x, da, db):
            to_first, to_second = self.fanout(x)
            return (to_first * da).sum() + (self.gradient(to_second) * db).sum(), to_first, to_second

    net = TwoUsers()
    _, to_first, to_second = net(ms.Tensor(x), ms.Tensor(first), ms.Tensor(second))
    np.testing.assert_array_equal(to_first.asnumpy(), x)
    np.testing.assert_array_equal(to_second.asnumpy(), x)
    def objective(x, da, db):
        return net(x, da, db)[0]
    dx = ms.grad(objective, grad_position=0)(ms.Tensor(x), ms.Tensor(first), ms.Tensor(second))
    # The second user's gradient passes ReluOutputGradient (masked), then the fanout masks the sum: the same mask.
    expected = np.where(x <= 0, np.float32(0), first + second)
    np.testing.assert_array_equal(dx.asnumpy(), expected)
    assert (expected[0, 0, 0, :2] == (first + second)[0, 0, 0, :2]).all() and (x == 0).any()


def test_batchnorm_fusion_falls_back_where_it_cannot_run():
    """In inference mode, and for channels that don't fill whole blocks (of 8 or 16), conv_bn runs the two cells."""
    ms.set_context(mode=ms.GRAPH_MODE)
    rng = np.random.default_rng(5)
    x = ms.Tensor(rng.standard_normal((2, 8, 6, 6)).astype(np.float32))
    odd = BlockedConv2d(8, 12, 3, pad_mode="pad", padding=1, has_bias=False)
    assert odd.blocked_op is not None and odd.batchnorm_op is None
    bn = nn.BatchNorm2d(12)
    bn.set_train(True)
    np.testing.assert_array_equal(conv_bn(odd, bn, x).asnumpy(), bn(odd(x)).asnumpy())
    conv = BlockedConv2d(8, 16, 3, pad_mode="pad", padding=1, has_bias=False)
    bn = nn.BatchNorm2d(16)
    bn.moving_mean.set_data(ms.Tensor(rng.normal(size=16).astype(np.float32)))
    bn.set_train(False)
    np.testing.assert_array_equal(conv_bn(conv, bn, x).asnumpy(), bn(conv(x)).asnumpy())


def test_channel_block_follows_the_isa_in_effect():
    """16-channel blocks where oneDNN runs AVX-512 code, else 8: its jit kernels exist only for their ISA's block
    (with 16-channel blocks under an AVX2 cap, BatchNorm and fused inference ran reference kernels)."""
    capped = os.environ.get("ONEDNN_MAX_CPU_ISA", "ALL").upper() not in ("ALL", "")
    assert channel_block() == native_channel_block("AVX2" if capped else None)


# A fresh process without MindSpore: the library's two-thread pool runs AddRelu (checked against NumPy), then the
# process idles; prints the CPU seconds all its threads used in the idle second.
IDLE_POOL_SCRIPT = """
import ctypes, sys, time
import numpy as np
library = ctypes.CDLL(sys.argv[1])
assert library.onednn_conv_set_threads(2) == 2
shape = (8, 64, 32, 32)  # several of the pool's chunks, so that both threads take a share
a = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
arrays = [a, -a[::-1].copy(), np.empty_like(a)]
params = (ctypes.c_void_p * 3)(*[array.ctypes.data for array in arrays])
dims = [(ctypes.c_int64 * 4)(*shape) for _ in arrays]
shapes = (ctypes.POINTER(ctypes.c_int64) * 3)(*[ctypes.cast(d, ctypes.POINTER(ctypes.c_int64)) for d in dims])
for _ in range(100):
    assert library.AddRelu(3, params, (ctypes.c_int * 3)(4, 4, 4), shapes, (ctypes.c_char_p * 3)(*[b"float32"] * 3),
                           None, None) == 0
np.testing.assert_array_equal(arrays[2], np.maximum(arrays[0] + arrays[1], 0))
time.sleep(0.1)
start = time.process_time()
time.sleep(1.0)
print("IDLE-CPU", time.process_time() - start)
"""


def test_pool_workers_sleep_when_the_calls_stop():
    """The native pool's workers spin for the next call only briefly (MindSpore's gaps between calls), then sleep:
    an idle training or evaluation process must not keep a core busy."""
    from src.onednn_conv import usable_library
    process = subprocess.run([sys.executable, "-c", IDLE_POOL_SCRIPT, usable_library()], capture_output=True,
                             text=True, timeout=120)
    assert process.returncode == 0, process.stderr[-3000:]
    idle_cpu = float(process.stdout.split("IDLE-CPU")[1])
    assert idle_cpu < 0.1, f"{idle_cpu:.3f} CPU seconds in one idle second"


# The in-process tests run under conftest's AVX2 cap, so on 8-channel blocks; these are the numerics tests to rerun
# uncapped, where an AVX-512 CPU takes 16-channel blocks and other kernels.
UNCAPPED_TESTS = ["tests/test_onednn_conv.py", "tests/test_fused_inference.py", "tests/test_native_optimizer.py", "-k",
                  "equal or computes or refresh or keep_their_own or channel_block_follows or follows_the_mindspore "
                  "or vector_width or relu_output_cells"]


@pytest.mark.skipif(not cpu_has_avx512(), reason="no AVX-512: the in-process tests cover the 8-channel blocks")
@pytest.mark.slow
def test_numerics_tests_pass_uncapped_on_16_channel_blocks():
    process = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *UNCAPPED_TESTS],
                             cwd=REPO, env=script_env({"ONEDNN_MAX_CPU_ISA": "ALL"}), capture_output=True, text=True,
                             timeout=600)
    assert process.returncode == 0, process.stdout[-3000:]
    summary = process.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "failed" not in summary and "skipped" not in summary, summary


BLOCKED_ACTIVATIONS_SCRIPT = """
import sys, numpy as np, mindspore as ms
from mindspore import nn
from src.resnet import build_resnet
ms.set_context(mode=ms.GRAPH_MODE)
ms.set_seed(1)
net = build_resnet("resnet50", 10, conv_implementation="onednn_blocked", blocked_activations=sys.argv[1] == "1")
loss = nn.WithLossCell(net, nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean"))
step = nn.TrainOneStepCell(loss, nn.SGD(net.trainable_params(), 0.01))
step.set_train(True)
images, labels = ms.Tensor(np.ones((2, 3, 32, 32), np.float32)), ms.Tensor(np.array([1, 2], np.int32))
step(images, labels)
print("MEASURED-STEP", flush=True)
step(images, labels)
"""


def training_steps_log(isa: Optional[str] = None, blocked: str = "1") -> Tuple[List[List[str]], List[List[str]]]:
    """oneDNN's exec lines of BLOCKED_ACTIVATIONS_SCRIPT's two steps, split at its marker: (the first step's, which
    compiles, the measured step's)."""
    first, measured = run_with_onednn_log(["-c", BLOCKED_ACTIVATIONS_SCRIPT, blocked], isa).split("MEASURED-STEP", 1)
    return onednn_exec_fields(first), onednn_exec_fields(measured)


@pytest.fixture(scope="module")
def default_training_log() -> Tuple[List[List[str]], List[List[str]]]:
    """training_steps_log() uncapped, with blocked activations (the default): one run read by two tests."""
    return training_steps_log()


@pytest.mark.slow
def test_training_keeps_activations_in_channel_blocks(default_training_log):
    """A training step of a network whose convolutions all run their BatchNorm natively reorders activations only
    into and out of layer1..layer4 (and around the stem), not around every convolution; weights are still
    reordered for each call."""
    def activation_reorders(log: List[List[str]]) -> List[str]:
        reorders = [fields for fields in log if fields[5] == "reorder"]
        assert reorders  # the weights still are
        # Batch 2: activations. Not the NHWC copies of x and dy that with AVX-512 the 1x1 layers' weight gradients on
        # 2x2 maps make for their matrix product (two a layer, inside the call).
        return [fields[-2] for fields in reorders
                if fields[-2].startswith("2x") and "dst:f32::blocked:acdb:" not in fields[8]]

    kept = activation_reorders(default_training_log[1])
    around_every_convolution = activation_reorders(training_steps_log(blocked="0")[1])
    # The stem writes channel blocks and pools them: none of its 64-channel activations is reordered.
    assert not any(problem.startswith("2x64x") for problem in kept), kept
    # With 16-channel blocks: 19 measured before the stem wrote channel blocks, 4 of them the stem's. With 8: 8
    # measured (26 before the stride-2 data gradients stayed on channel blocks).
    assert len(kept) <= 16, kept
    assert len(around_every_convolution) >= 200, len(around_every_convolution)  # measured 269 (16-channel blocks)


@pytest.mark.slow
def test_training_copies_the_1x1_weights_for_their_input_gradients_itself(default_training_log):
    """The 1x1 layers' input gradients read the weights as tiles of runs of input channels (AVX-512's data-gradient
    kernels, and under AVX2 the forward convolution with the kernels transposed): the native library copies them
    there itself, not through oneDNN's reorders (25 of them in this step under AVX2 before it did)."""
    # Reorders of 1x1 weights, and of activations on 1x1 maps (layer4's at 32x32), which the checks below tell apart.
    on_1x1 = [fields[8] for fields in default_training_log[1] if fields[5] == "reorder" and fields[-2].endswith("x1x1")]
    # The forward kernels' weights still go through oneDNN's reorders (plain OIHW into ABcd8b8a or ABcd16b16a): the
    # log has 1x1 weight reorders at all.
    assert any(layouts.startswith("src:f32::blocked:abcd::") and " dst:f32::blocked:AB" in layouts
               for layouts in on_1x1), on_1x1
    transposed = [layouts for layouts in on_1x1
                  if layouts.startswith("src:f32::blocked:bacd::") or "dst:f32::blocked:BAcd16a16b:" in layouts]
    assert transposed == []


@pytest.mark.slow
@pytest.mark.parametrize("stem", ["cifar", "imagenet"])
def test_blocked_activations_train_to_the_same_weights(stem):
    """With the CIFAR stem, keeping the activations in channel blocks changes where numbers are in memory, not what
    is computed: the same weights after two steps. With the ImageNet stem the blocked step also runs other kernels
    (the stem's ReLU and max pool in one call, layer3's 2x2 maps as matrix products), which round differently: the
    same weights within float32 rounding after one step. (A second step turns such differences into percents here:
    ResNet-18 at batch 4 has 16 and 4 numbers per BatchNorm channel in layer3 and layer4.)"""
    steps, tolerance = (2, 1e-6) if stem == "cifar" else (1, 1e-4)

    def train(blocked: bool):
        ms.set_seed(1)
        from src.resnet import build_resnet
        net = build_resnet("resnet18", 10, conv_implementation="onednn_blocked", stem=stem,
                           blocked_activations=blocked)
        loss = nn.WithLossCell(net, nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean"))
        step = nn.TrainOneStepCell(loss, nn.Momentum(net.trainable_params(), 0.1, 0.9))
        step.set_train(True)
        rng = np.random.default_rng(0)
        for _ in range(steps):
            step(ms.Tensor(rng.standard_normal((4, 3, 32, 32)).astype(np.float32)),
                 ms.Tensor(rng.integers(0, 10, 4).astype(np.int32)))
        return {p.name: p.asnumpy() for p in net.get_parameters()}

    kept, plain = train(True), train(False)
    assert kept.keys() == plain.keys()
    worst = max(rel_diff(kept[name], plain[name]) for name in kept if np.abs(plain[name]).max() > 0)
    assert worst <= tolerance, worst
