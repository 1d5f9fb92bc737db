"""The fused inference network (src/fused_inference.py): the ResNet's inference-mode output from one native call
per layer, refreshed when the weights change, and what oneDNN really runs for it."""
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import mindspore as ms
from mindspore import nn

from conftest import REPO, avx2_capped_case, native_channel_block, onednn_exec_log, rel_diff
from src.fused_inference import FusedResNet, fold_batchnorm, inference_network
from src.onednn_conv import native_thread_count
from src.resnet import build_resnet


def randomise_statistics(net: nn.Cell, rng: np.random.Generator) -> None:
    """BatchNorm parameters and running statistics far from their initial 1/0, so that folding them matters."""
    for _, cell in net.cells_and_names():
        if isinstance(cell, nn.BatchNorm2d):
            c = cell.gamma.shape[0]
            cell.gamma.set_data(ms.Tensor(rng.uniform(0.5, 1.5, c).astype(np.float32)))
            cell.beta.set_data(ms.Tensor(rng.normal(0.0, 0.2, c).astype(np.float32)))
            cell.moving_mean.set_data(ms.Tensor(rng.normal(0.0, 0.2, c).astype(np.float32)))
            cell.moving_variance.set_data(ms.Tensor(rng.uniform(0.5, 2.0, c).astype(np.float32)))


def reference_logits(net_blocked: nn.Cell, model_name: str, images: np.ndarray) -> np.ndarray:
    """The same weights in a network with MindSpore's own Conv2d, in inference mode: the plain path."""
    plain = build_resnet(model_name, net_blocked.num_classes, conv_implementation="mindspore")
    ms.load_param_into_net(plain, {p.name: p for p in net_blocked.get_parameters()}, strict_load=True)
    plain.set_train(False)
    return plain(ms.Tensor(images)).asnumpy()


@pytest.mark.parametrize("model_name, batch, size, layout", [
    ("resnet50", 4, 32, "auto"), ("resnet18", 3, 40, "auto"), ("resnet18", 2, 40, "nhwc"),
    ("resnet18", 2, 72, "nhwc"), ("resnet18", 2, 32, "nhwc")])
@pytest.mark.slow
def test_fused_network_computes_the_resnet_inference(model_name, batch, size, layout):
    """Equal to the plain MindSpore network (nn.Conv2d, BatchNorm, ReLU, add) to float rounding, on either layout
    (auto is blocked for ResNets); 40 and 72 give odd map sizes (20, 10, 5, 3; 9, 5, 3) at the pool and the
    strided layers; at 32 layer4's one-pixel layers run as matrix products (3x3 kernels by their centre tap), and
    so do layer3's 3x3 layers on 2x2 maps (weights expanded per pair of pixels), blocked or NHWC."""
    rng = np.random.default_rng(0)
    net = build_resnet(model_name, 10, conv_implementation="onednn_blocked")
    randomise_statistics(net, rng)
    images = rng.standard_normal((batch, 3, size, size)).astype(np.float32)
    fused = inference_network(net, layout=layout)
    assert isinstance(fused, FusedResNet)
    logits = fused(ms.Tensor(images)).asnumpy()
    expected = reference_logits(net, model_name, images)
    assert logits.shape == expected.shape
    print(f"\n  {model_name} {size}x{size} {layout}: fused vs plain logits rel {rel_diff(logits, expected):.2g}")
    assert rel_diff(logits, expected) < 1e-5
    # A second batch size in the same network: another oneDNN plan, with its own packed weights.
    one = fused(ms.Tensor(images[:1])).asnumpy()
    assert rel_diff(one, expected[:1]) < 1e-5


@pytest.mark.parametrize("post", ["None", "Relu", "AddRelu"])
def test_one_pixel_products_equal_numpy_for_every_row_count_and_weights_version(post):
    """A layer on one-pixel maps is a matrix product (the native panels, whose row blocks of 6 (AVX2) or 12
    (AVX-512) and slices of 256 input channels leave remainders; with AVX-512, 64 output channels run as a pair of
    panels and 48 as single ones; 40 are not whole panels and run oneDNN's matmul): every batch size from 1 to 13, a
    3x3 kernel by its centre tap, the bias and post-op, and new weights under a new version replacing the packed
    ones."""
    from src.fused_inference import NHWC, _convolution_op, _layouts
    rng = np.random.default_rng(3)
    op, layouts = _convolution_op(post, 1, 1, NHWC, NHWC), _layouts(NHWC, NHWC)
    for out in (64, 48, 40):
        for version in (1, 2):
            weights = rng.standard_normal((out, 264, 3, 3)).astype(np.float32)
            bias = rng.standard_normal(out).astype(np.float32)
            key = ms.Tensor(np.array([10_000 + out, version], np.int64))
            for batch in range(1, 14):
                x = rng.standard_normal((batch, 1, 1, 264)).astype(np.float32)
                expected = x.reshape(batch, 264).astype(np.float64) @ weights[:, :, 1, 1].T.astype(np.float64) + bias
                inputs = [ms.Tensor(x), ms.Tensor(weights), key, layouts, ms.Tensor(bias)]
                if post == "AddRelu":
                    residual = rng.standard_normal((batch, 1, 1, out)).astype(np.float32)
                    expected += residual.reshape(batch, out)
                    inputs.append(ms.Tensor(residual))
                if post != "None":
                    expected = np.maximum(expected, 0.0)
                actual = op(*inputs).asnumpy().reshape(batch, out)
                assert rel_diff(actual, expected) < 1e-5, (out, version, batch)


def numpy_conv3x3(x: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """A 3x3 stride-1 convolution with padding 1 of NCHW x, in float64."""
    n, _, h, w = x.shape
    padded = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (1, 1), (1, 1)))
    out = np.zeros((n, weights.shape[0], h, w))
    for dy in range(3):
        for dx in range(3):
            out += np.einsum("nchw,oc->nohw", padded[:, :, dy:dy + h, dx:dx + w], weights[:, :, dy, dx])
    return out


@pytest.mark.parametrize("post", ["None", "Relu", "AddRelu"])
def test_3x3_layers_on_channel_blocks_equal_numpy_for_odd_maps_and_weights_versions(post):
    """3x3 stride-1 layers between channel blocks (Winograd: F(4x4, 3x3) where the map has 12 tiles of 4x4, as
    9x6 at batch 3 and 14x14 here, else F(2x2, 3x3) where it has 12 of 2x2, as 5x7; fewer run oneDNN's direct kernel;
    on AVX-512's 16-channel blocks F(4x4, 3x3) reads whole blocks and F(2x2, 3x3) two halves): odd map sizes cut the
    last tiles, the tiles go in chunks over the threads (larger ones where the transformed weights are large, as at
    512 channels), the bias and post-op come with the output, and new weights under a new version replace the packed
    ones."""
    from src.fused_inference import BLOCKED, _convolution_op, _layouts
    from src.onednn_conv import channel_block
    block = channel_block()

    def blocked(t: np.ndarray) -> np.ndarray:  # NCHW -> the same shape holding nChw<block>c
        n, c, h, w = t.shape
        return np.ascontiguousarray(t.reshape(n, c // block, block, h, w).transpose(0, 1, 3, 4, 2)).reshape(t.shape)

    def plain(t: np.ndarray) -> np.ndarray:
        n, c, h, w = t.shape
        return t.reshape(n, c // block, h, w, block).transpose(0, 1, 4, 2, 3).reshape(t.shape)

    rng = np.random.default_rng(4)
    op, layouts = _convolution_op(post, 1, 1, BLOCKED, BLOCKED), _layouts(BLOCKED, BLOCKED)
    for batch, in_channels, out_channels, height, width in ((1, 16, 32, 5, 7), (3, 48, 48, 9, 6), (2, 16, 32, 4, 4),
                                                            (2, 32, 16, 1, 3), (4, 16, 32, 14, 14),
                                                            (2, 512, 512, 14, 14)):
        for version in (1, 2):
            weights = rng.standard_normal((out_channels, in_channels, 3, 3)).astype(np.float32)
            bias = rng.standard_normal(out_channels).astype(np.float32)
            x = rng.standard_normal((batch, in_channels, height, width)).astype(np.float32)
            expected = numpy_conv3x3(x, weights) + bias[None, :, None, None]
            key = ms.Tensor(np.array([20_000 + 100 * in_channels + out_channels + height, version], np.int64))
            inputs = [ms.Tensor(blocked(x)), ms.Tensor(weights), key, layouts, ms.Tensor(bias)]
            if post == "AddRelu":
                residual = rng.standard_normal(expected.shape).astype(np.float32)
                expected += residual
                inputs.append(ms.Tensor(blocked(residual)))
            if post != "None":
                expected = np.maximum(expected, 0.0)
            actual = plain(op(*inputs).asnumpy())
            # F(4x4, 3x3)'s rounding grows with the sums: 4608 terms at 512 channels (1.4e-5 measured), 432 at 48.
            tolerance = 3e-5 if in_channels >= 512 else 1e-5
            assert rel_diff(actual, expected) < tolerance, (batch, in_channels, out_channels, height, width, version)


def test_refresh_takes_the_new_weights_and_statistics():
    """inference_network(net, reuse) refreshes the same FusedResNet; the native cache of packed weights must not
    serve the old weights after it."""
    rng = np.random.default_rng(1)
    net = build_resnet("resnet18", 10, conv_implementation="onednn_blocked")
    randomise_statistics(net, rng)
    images = rng.standard_normal((2, 3, 32, 32)).astype(np.float32)
    fused = inference_network(net)
    before = fused(ms.Tensor(images)).asnumpy()
    for param in net.get_parameters():
        if param.name.endswith("conv2.weight") or param.name.endswith("moving_mean"):
            param.set_data(ms.Tensor(param.asnumpy() * 1.5 + 0.01))
    refreshed = inference_network(net, reuse=fused)
    assert refreshed is fused
    after = fused(ms.Tensor(images)).asnumpy()
    assert rel_diff(after, before) > 1e-3  # the change shows
    assert rel_diff(after, reference_logits(net, "resnet18", images)) < 1e-5


@pytest.mark.slow
def test_two_fused_networks_keep_their_own_weights():
    """Same shapes, different weights, called alternately: each gives its own network's logits."""
    rng = np.random.default_rng(2)
    images = rng.standard_normal((2, 3, 32, 32)).astype(np.float32)
    nets = [build_resnet("resnet18", 10, conv_implementation="onednn_blocked") for _ in range(2)]
    for net in nets:
        randomise_statistics(net, rng)
    fused = [inference_network(net) for net in nets]
    expected = [reference_logits(net, "resnet18", images) for net in nets]
    assert rel_diff(expected[0], expected[1]) > 1e-3
    for _ in range(2):
        for network, reference in zip(fused, expected):
            assert rel_diff(network(ms.Tensor(images)).asnumpy(), reference) < 1e-5


def test_networks_that_cannot_be_fused_run_as_they_are():
    net = build_resnet("resnet18", 10, conv_implementation="mindspore")
    net.set_train(True)
    assert inference_network(net) is net
    assert not net.training  # but in inference mode


def test_an_unknown_layout_is_refused():
    net = build_resnet("resnet18", 10, conv_implementation="onednn_blocked")
    with pytest.raises(ValueError, match="layout 'nchw'"):
        FusedResNet(net, layout="nchw")


def test_fold_batchnorm_is_the_convolution_followed_by_batchnorm():
    rng = np.random.default_rng(3)
    conv = nn.Conv2d(8, 16, 3, pad_mode="pad", padding=1, has_bias=True)
    conv.bias.set_data(ms.Tensor(rng.normal(size=16).astype(np.float32)))
    bn = nn.BatchNorm2d(16, eps=1e-3)
    randomise_statistics(nn.SequentialCell([bn]), rng)
    bn.set_train(False)
    x = ms.Tensor(rng.standard_normal((2, 8, 6, 6)).astype(np.float32))
    weights, bias = fold_batchnorm(conv, bn)
    folded = nn.Conv2d(8, 16, 3, pad_mode="pad", padding=1, has_bias=True)
    folded.weight.set_data(ms.Tensor(weights))
    folded.bias.set_data(ms.Tensor(bias))
    assert rel_diff(folded(x).asnumpy(), bn(conv(x)).asnumpy()) < 1e-5


VERBOSE_SCRIPT = """
import numpy as np, mindspore as ms, sys
from src.utils import choose_convolutions
choose_convolutions("onednn_blocked", "CPU")
from src.resnet import build_resnet
from src.fused_inference import inference_network
ms.set_context(mode=ms.GRAPH_MODE)
fused = inference_network(build_resnet(sys.argv[1], 10, conv_implementation="onednn_blocked"), layout=sys.argv[3])
images = ms.Tensor(np.ones((2, 3, int(sys.argv[2]), int(sys.argv[2])), np.float32))
fused(images).asnumpy()
print("SECOND PASS", flush=True)
fused(images).asnumpy()
"""
# ReLUs: after the stem, every convolution inside a block but the last, and every residual addition. Matrix
# products: layer4's layers whose output map is one pixel (ResNet-50 at 32x32: 9 of its 53 layers), two of them
# (the stride-2 ones) from a 2x2 map whose pixels they gather first, and layer3's five 3x3 stride-1 layers on 2x2
# maps, with weights expanded per pair of pixels: 14, with 3 of the additions and 13 of the ReLUs. The native panels
# run them (AVX-512's in pairs), so oneDNN's log has none of them (only their 2 gathers).
PRODUCT_POST_OPS = 3, 13  # the 14 matrix products' additions and ReLUs
# On blocks (AVX2's or AVX-512's), layer1's three 3x3 layers (8x8 maps: 32 output tiles of 2x2 at batch 2) run
# natively too (Winograd), with their ReLUs; layer2's (4x4 maps: 8 tiles) stay oneDNN's.
WINOGRAD_LAYERS = 3
# On AVX2's 8-channel blocks, the 3x3 stride-2 layers into layer2 and layer3 (layer4's is a matrix product) run
# oneDNN's brgemm kernel on NHWC, their input and output reordered from and to the blocks.
NHWC_DETOUR_LAYERS = 2


# Separate additions: a stage's first block without a downsample layer (ResNet-18's layer1) adds the stage's input
# as a binary_add post-op; every other block's last layer adds onto the shortcut in place (a sum post-op).
@pytest.mark.parametrize("model_name, size, choice, isa, convolutions, product_post_ops, gathers, additions, "
                         "separate_additions, relus", [
    pytest.param("resnet50", 32, "auto", None, 39, PRODUCT_POST_OPS, 2, 16, 0, 49, id="resnet50-blocked"),
    avx2_capped_case("resnet50", 32, "auto", "AVX2", 39, PRODUCT_POST_OPS, 2, 16, 0, 49, id="resnet50-blocked-AVX2"),
    pytest.param("resnet18", 72, "nhwc", None, 20, (0, 0), 0, 8, 1, 17, id="resnet18-nhwc")])
@pytest.mark.slow
def test_oneDNN_log_one_call_per_layer_and_no_reorders_after_the_first_pass(model_name, size, choice, isa,
                                                                             convolutions, product_post_ops, gathers,
                                                                             additions, separate_additions, relus):
    """oneDNN's own log: one convolution a layer with BatchNorm folded (bias), ReLU and the residual additions as
    post-ops (in place, as a sum, but where the residual is a stage's input), none through GEMM or reference kernels,
    on the chosen layout (channel blocks of 16 with AVX-512,
    of 8 under an AVX2 cap; the stem reads the NCHW images there), and no oneDNN matrix product where a layer's
    output map is one pixel or a 2x2 map's pixel pairs: the native panels run those with the same bias and
    post-ops (and large enough 3x3 stride-1 layers on blocks run natively); the second pass reorders no weights,
    only the input pixels that a one-pixel output gathers from a larger map."""
    layout = "acdb" if choice == "nhwc" else f"aBcd{native_channel_block(isa)}b"  # oneDNN's names for NHWC, blocks
    additions, relus = additions - product_post_ops[0], relus - product_post_ops[1]  # the products' are native
    if choice != "nhwc":  # and on blocks, with AVX-512 too, so do Winograd's layers
        convolutions, relus = convolutions - WINOGRAD_LAYERS, relus - WINOGRAD_LAYERS
    detours = NHWC_DETOUR_LAYERS if choice != "nhwc" and native_channel_block(isa) == 8 else 0
    executed = onednn_exec_log(["-c", VERBOSE_SCRIPT, model_name, str(size), choice], isa, marker="SECOND PASS")
    kinds = [fields[5] for fields in executed]
    assert kinds.count("convolution") == convolutions and kinds.count("pooling") == 1
    reorders = [fields for fields in executed if fields[5] == "reorder"]
    assert len(reorders) == gathers + 2 * detours
    detour_reorders = [fields for fields in reorders if "blocked:acdb:" in fields[8]] if detours else []
    assert len(detour_reorders) == 2 * detours
    for fields in detour_reorders:  # a detour's input (8x8, 4x4) into NHWC, its output (4x4, 2x2) back into blocks
        assert re.fullmatch(r"2x(128x8x8|256x4x4|128x4x4|256x2x2)", fields[-2]), fields
        assert re.fullmatch(rf"src:f32::blocked:(acdb::f0 dst:f32::blocked:{layout}|{layout}::f0 dst:f32::blocked:acdb)"
                            "::f0", fields[8]), fields
    for fields in reorders:  # (batch 2, channels, rows, columns): pixels of a 2x2 input, not weights
        if fields not in detour_reorders:
            assert re.fullmatch(r"2x\d+x[12]x[12]", fields[-2]) and f"src:f32::blocked:{layout}:" in fields[8], fields
    assert "eltwise" not in kinds and "binary" not in kinds and "batch_normalization" not in kinds
    layers = [fields for fields in executed if fields[5] == "convolution"]
    # A layer's matrix product would carry the folded BatchNorm's bias; the classifier's (MindSpore's Dense) does not.
    assert not [fields for fields in executed if fields[5] == "matmul" and "bia:f32" in ",".join(fields)]
    for number, fields in enumerate(layers):
        line = ",".join(fields)
        assert fields[7] == "forward_inference", line
        assert "gemm" not in fields[6] and "ref" not in fields[6], line
        source = "abcd" if number == 0 and choice != "nhwc" else layout  # abcd: NCHW
        if detours and "kh3sh2" in fields[-2]:
            assert fields[6].startswith("brg_conv_fwd") and "src:f32::blocked:acdb:" in line, line
            detours -= 1
        else:
            assert f"src:f32::blocked:{source}:" in line and f"dst:f32::blocked:{layout}:" in line, line
        assert "bia:f32" in line, line
    assert detours == 0
    pooling = ",".join(executed[kinds.index("pooling")])
    assert f"src:f32::blocked:{layout}:" in pooling, pooling
    assert sum("binary_add" in ",".join(fields) for fields in layers) == separate_additions
    assert sum("post-ops:sum+" in ",".join(fields) for fields in layers) == additions - separate_additions
    assert sum("eltwise_relu" in ",".join(fields) for fields in layers) == relus


def test_native_thread_count_follows_the_user_setting(monkeypatch):
    monkeypatch.delenv("RESNET_LOCAL_WORKERS", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert native_thread_count() == 3
    monkeypatch.delenv("OMP_NUM_THREADS")
    cpus = len(os.sched_getaffinity(0))
    assert native_thread_count() == cpus
    monkeypatch.setenv("MS_ROLE", "MS_WORKER")
    monkeypatch.setenv("MS_WORKER_NUM", "2")  # msrun by hand: the job's workers, taken as one machine's
    assert native_thread_count() == max(1, cpus // 2)
    monkeypatch.setenv("RESNET_LOCAL_WORKERS", "1")  # the launcher: this node's one worker of the two
    assert native_thread_count() == cpus


THREADS_SCRIPT = """
import mindspore  # sets the process's C-level OMP_NUM_THREADS to 1 when it loads
from src.onednn_conv import native_thread_count, set_native_threads
print(set_native_threads(native_thread_count()))
"""


@pytest.mark.parametrize("threads", ["1", "2"])
@pytest.mark.slow
def test_the_native_pool_gets_the_users_thread_count_although_mindspore_overwrites_it(threads):
    env = dict(os.environ, OMP_NUM_THREADS=threads)
    process = subprocess.run([sys.executable, "-c", THREADS_SCRIPT], cwd=REPO, env=env, capture_output=True,
                             text=True, timeout=120)
    assert process.returncode == 0, process.stderr[-2000:]
    assert process.stdout.split()[-1] == threads


LATE_THREADS_SCRIPT = """
import numpy as np, mindspore as ms
from src.onednn_conv import BlockedConv2d, set_native_threads
print(set_native_threads(1))
BlockedConv2d(16, 16, 3, pad_mode="pad", padding=1)(ms.Tensor(np.ones((1, 16, 4, 4), np.float32))).asnumpy()
print(set_native_threads(2))  # the pool exists now: its size is what counts
"""


@pytest.mark.slow
def test_a_thread_count_set_after_the_pool_exists_reports_the_pools_size():
    process = subprocess.run([sys.executable, "-c", LATE_THREADS_SCRIPT], cwd=REPO, env=dict(os.environ),
                             capture_output=True, text=True, timeout=120)
    assert process.returncode == 0, process.stderr[-2000:]
    assert process.stdout.split()[-2:] == ["1", "1"]
