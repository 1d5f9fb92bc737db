"""ResNet inference with one oneDNN call per layer, a stage of residual blocks in one native call (CPU, when the
blocked convolutions are in use).

`inference_network(net)` rebuilds a trained ResNet for inference as a FusedResNet:
- each BatchNorm is folded into the convolution before it (its running statistics, as inference uses them):
  weights * gamma / sqrt(var + eps), bias beta - mean * gamma / sqrt(var + eps), computed in float64;
- ReLU and the residual addition run inside the convolution as oneDNN post-ops, the addition in place on the
  stage's running activation (FusedStage);
- either stem (src/resnet.py): conv1 with its BatchNorm and ReLU, then the imagenet stem's max pool natively (the
  cifar stem has none);
- the torch semantics and any other with symmetric padding (models_zoo ResNet-18/34: only BatchNorm eps differs,
  which the folding takes from each BatchNorm); a network that pads 'same' (mindcv, models_zoo ResNet-50+) runs
  unfused (why_not_fusable);
- activations stay in one layout from layer to layer, so nothing is reordered between layers: channel blocks
  (nChw16c, or nChw8c without AVX-512: oneDNN's direct jit kernels, and the native Winograd kernels for 3x3
  stride-1 layers), or NHWC (its brgemm kernels) when the channels don't fill whole blocks or when asked for
  (LAYOUT_CHOICES); the global average pool reads that layout;
- each layer's weights are reordered into the kernel's layout once per update instead of at every call.
It computes what the ResNet computes in inference mode, up to float rounding (tests/test_fused_inference.py).

A FusedResNet is a snapshot of the ResNet's weights: `load_from(net)` refreshes it (the trainer does before each
evaluation, which keeps its compiled graph). It is for inference only: train and save the ResNet.
"""
import functools
import itertools
from typing import List, Optional, Tuple

import numpy as np
import mindspore as ms
from mindspore import nn, ops

from src.onednn_conv import BlockedConv2d, channel_block, usable_library
from src.resnet import BasicBlock, Bottleneck, ResNet, ZeroPad1

# Activation layouts, numbered as native/onednn_conv.cc's Layout. MindSpore sees NHWC tensors as (N, H, W, C),
# NCHW and BLOCKED (nChw16c or nChw8c: the same floats in blocks of channel_block() channels) as (N, C, H, W).
NHWC, NCHW, BLOCKED = 0, 1, 2
# FusedResNet's layout choices. auto: BLOCKED when every layer's channels fill whole blocks, else NHWC: oneDNN's
# direct kernels on channel blocks beat its NHWC kernels at small inputs and are level at large ones (compare
# with python benchmark.py --modes eval --inference_network fused-blocked, then fused-nhwc).
LAYOUT_CHOICES = ("auto", "blocked", "nhwc")

# Layer numbers and weights versions: unique in the process, so the native cache of packed weights
# (keyed by both) never serves one layer's or one update's weights for another.
_layer_numbers = itertools.count(1)
_weights_versions = itertools.count(1)


def _image_dims(shape, layout: int) -> Tuple[int, int, int, int]:
    """(N, C, H, W) of a MindSpore shape of a tensor in layout."""
    return (shape[0], shape[3], shape[1], shape[2]) if layout == NHWC else tuple(shape)


def _shape_in(layout: int, n: int, c: int, h: int, w: int) -> Tuple[int, int, int, int]:
    return (n, h, w, c) if layout == NHWC else (n, c, h, w)


def _output_size(size: int, kernel: int, stride: int, padding: int) -> int:
    """A convolution's output rows (or columns) from its input's."""
    return (size + 2 * padding - kernel) // stride + 1


@functools.lru_cache(maxsize=None)
def _convolution_op(post: str, stride: int, padding: int, src_layout: int, dst_layout: int) -> ops.Custom:
    """The native convolution; its inputs include the layouts (as a tensor), which this op's shapes assume."""
    library = usable_library()

    def output_shape(x_shape, w_shape, *other_shapes):
        n, _, h, w = _image_dims(x_shape, src_layout)
        return _shape_in(dst_layout, n, w_shape[0], _output_size(h, w_shape[2], stride, padding),
                         _output_size(w, w_shape[3], stride, padding))

    def output_dtype(x_dtype, *other_dtypes):
        return x_dtype

    return ops.Custom(f"{library}:ConvInference{post}_s{stride}_p{padding}", output_shape, output_dtype,
                      func_type="aot")


@functools.lru_cache(maxsize=None)
def _stem_pool_op(layout: int) -> ops.Custom:
    library = usable_library()

    def output_shape(x_shape, layout_shape):  # kernel 3, stride 2, padding 1
        n, c, h, w = _image_dims(x_shape, layout)
        return _shape_in(layout, n, c, (h - 1) // 2 + 1, (w - 1) // 2 + 1)

    def output_dtype(x_dtype, layout_dtype):
        return x_dtype

    return ops.Custom(f"{library}:MaxPool_k3_s2_p1", output_shape, output_dtype, func_type="aot")


@functools.lru_cache(maxsize=None)
def _stage_op(layout: int, blocks: Tuple[Tuple[bool, Tuple[Tuple[int, int], ...]], ...]) -> ops.Custom:
    """A stage of residual blocks in one native call: x, the layout, the geometry tensor, then (weights, weights key,
    bias) for each layer, block by block (the main branch in order, then the downsample). blocks holds each block's
    (has_downsample, each layer's (stride, padding))."""
    library = usable_library()

    def output_shape(x_shape, layout_shape, geometry_shape, *layer_shapes):
        n, _, h, w = _image_dims(x_shape, layout)
        weights = layer_shapes[0::3]
        first = 0
        for has_downsample, geometry in blocks:
            main = len(geometry) - int(has_downsample)
            for (stride, padding), kernel in zip(geometry[:main], weights[first:first + main]):
                h, w = _output_size(h, kernel[2], stride, padding), _output_size(w, kernel[3], stride, padding)
            channels = weights[first + main - 1][0]
            first += len(geometry)
        return _shape_in(layout, n, channels, h, w)

    def output_dtype(x_dtype, *other_dtypes):
        return x_dtype

    return ops.Custom(f"{library}:StageInference", output_shape, output_dtype, func_type="aot")


def _geometry_numbers(blocks: Tuple[Tuple[bool, Tuple[Tuple[int, int], ...]], ...]) -> List[int]:
    """_stage_op's blocks as the native call reads them: the count of blocks, then for each block its count of
    layers, 1 with a downsample layer or else 0, and each layer's stride and padding."""
    numbers = [len(blocks)]
    for has_downsample, layers in blocks:
        numbers += [len(layers), int(has_downsample), *itertools.chain(*layers)]
    return numbers


def _layouts(*layouts: int) -> ms.Tensor:
    return ms.Tensor(np.array(layouts, np.int64))


def fold_batchnorm(conv: nn.Conv2d, bn: nn.BatchNorm2d) -> Tuple[np.ndarray, np.ndarray]:
    """(weights, bias) of the one convolution that computes bn(conv(x)) with bn's running statistics."""
    scale = bn.gamma.asnumpy().astype(np.float64) / np.sqrt(bn.moving_variance.asnumpy().astype(np.float64) + bn.eps)
    bias = bn.beta.asnumpy().astype(np.float64) - bn.moving_mean.asnumpy().astype(np.float64) * scale
    if conv.has_bias:
        bias += conv.bias.asnumpy().astype(np.float64) * scale
    weights = conv.weight.asnumpy().astype(np.float64) * scale[:, None, None, None]
    return weights.astype(np.float32), bias.astype(np.float32)


class FoldedLayer:
    """A convolution with its BatchNorm folded in: the weights, bias and weights key a native call reads (Parameters
    that the cell running the call holds), and the convolution's stride and padding."""

    def __init__(self, conv: BlockedConv2d, name: str) -> None:
        self.stride, self.padding = conv.blocked_stride, conv.blocked_padding
        self.weight = ms.Parameter(ms.Tensor(np.zeros(conv.weight.shape, np.float32)), name=f"{name}.weight",
                                   requires_grad=False)
        self.bias = ms.Parameter(ms.Tensor(np.zeros(conv.weight.shape[0], np.float32)), name=f"{name}.bias",
                                 requires_grad=False)
        self.layer = next(_layer_numbers)
        self.weights_key = ms.Parameter(ms.Tensor(np.array([self.layer, 0], np.int64)), name=f"{name}.weights_key",
                                        requires_grad=False)

    def load(self, conv: nn.Conv2d, bn: nn.BatchNorm2d, version: int) -> None:
        weights, bias = fold_batchnorm(conv, bn)
        self.weight.set_data(ms.Tensor(weights))
        self.bias.set_data(ms.Tensor(bias))
        self.weights_key.set_data(ms.Tensor(np.array([self.layer, version], np.int64)))


class FusedConv(nn.Cell):
    """A FoldedLayer in a native call of its own, with a post-op (None or Relu), from src_layout to dst_layout (the
    stem's conv1; a block's layers run in the block's call)."""

    def __init__(self, conv: BlockedConv2d, post: str, src_layout: int, dst_layout: int) -> None:
        super().__init__()
        self.folded = FoldedLayer(conv, "conv")
        self.weight, self.weights_key, self.bias = self.folded.weight, self.folded.weights_key, self.folded.bias
        self.op = _convolution_op(post, self.folded.stride, self.folded.padding, src_layout, dst_layout)
        self.layouts = _layouts(src_layout, dst_layout)

    def load(self, conv: nn.Conv2d, bn: nn.BatchNorm2d, version: int) -> None:
        self.folded.load(conv, bn, version)

    def construct(self, x):
        return self.op(x, self.weight, self.weights_key, self.layouts, self.bias)


def _block_pairs(block: nn.Cell) -> List[Tuple[nn.Conv2d, nn.BatchNorm2d]]:
    """(conv, bn) pairs of a block: its main branch's in order, then its downsample's if it has one."""
    pairs = [(block.conv1, block.bn1), (block.conv2, block.bn2)]
    if isinstance(block, Bottleneck):
        pairs.append((block.conv3, block.bn3))
    if block.downsample is not None:
        pairs.append((block.downsample[0], block.downsample[1]))
    return pairs


class FusedStage(nn.Cell):
    """A stage of residual blocks (one of ResNet's layer1-4): in each, ReLU convolutions, then the one that adds the
    shortcut (itself a convolution or the block's input); all activations in layout. The whole stage runs in one
    native call (_stage_op), which keeps the blocks' outputs in the stage's output tensor and adds each block's last
    convolution onto its shortcut there in place: a call per layer cost MindSpore's launch of each op, and a call per
    block a separate read of the residual. Its layers' Parameters are the stage's own, with no cell per layer: a
    graph cell's call walks every cell under it before each run (about 2 microseconds a cell)."""

    def __init__(self, blocks: nn.Cell, layout: int) -> None:
        super().__init__()
        folded_blocks = [[FoldedLayer(conv, f"block{index}.layer{number}")
                          for number, (conv, _) in enumerate(_block_pairs(block))]
                         for index, block in enumerate(blocks)]
        self.folded = [layer for layers in folded_blocks for layer in layers]
        self.weights = ms.ParameterTuple([layer.weight for layer in self.folded])
        self.weights_keys = ms.ParameterTuple([layer.weights_key for layer in self.folded])
        self.biases = ms.ParameterTuple([layer.bias for layer in self.folded])
        geometry = tuple((block.downsample is not None, tuple((layer.stride, layer.padding) for layer in layers))
                         for block, layers in zip(blocks, folded_blocks))
        self.op = _stage_op(layout, geometry)
        self.layout = _layouts(layout)
        self.geometry = ms.Tensor(np.array(_geometry_numbers(geometry), np.int64))

    def load(self, blocks: nn.Cell, version: int) -> None:
        pairs = [pair for block in blocks for pair in _block_pairs(block)]
        for folded, (conv, bn) in zip(self.folded, pairs):
            folded.load(conv, bn, version)

    def construct(self, x):
        layers = ()
        for i in range(len(self.weights)):  # a constant count: the graph unrolls it
            layers = layers + (self.weights[i], self.weights_keys[i], self.biases[i])
        return self.op(x, self.layout, self.geometry, *layers)


class FusedResNet(nn.Cell):
    """A ResNet's inference: NCHW images in, logits out, as ResNet.construct in inference mode.

    layout: the activations' layout, one of LAYOUT_CHOICES."""

    def __init__(self, net: ResNet, layout: str = "auto") -> None:
        super().__init__()
        if layout not in LAYOUT_CHOICES:
            raise ValueError(f"layout {layout!r} is not one of {', '.join(LAYOUT_CHOICES)}")
        # BLOCKED needs whole channel blocks after every layer (true of torchvision's ResNets).
        self.block = channel_block()
        blocked_usable = all(cell.out_channels % self.block == 0 for _, cell in net.cells_and_names()
                             if isinstance(cell, nn.Conv2d))
        if layout == "blocked" and not blocked_usable:
            raise ValueError(f"layout 'blocked' needs every convolution's output channels in multiples of "
                             f"{self.block}")
        self.runs_blocked = layout == "blocked" or (layout == "auto" and blocked_usable)
        activations = BLOCKED if self.runs_blocked else NHWC
        # The stem reads the NCHW images itself on the blocked layout; for NHWC construct transposes them.
        self.conv1 = FusedConv(net.conv1, "Relu", NCHW if self.runs_blocked else NHWC, activations)
        # The imagenet stem's 3x3 stride-2 max pool, natively; the cifar stem has none.
        self.has_maxpool = _stem_max_pool(net)
        if self.has_maxpool is None:
            raise ValueError(why_not_fusable(net))
        self.maxpool = _stem_pool_op(activations) if self.has_maxpool else None
        self.maxpool_layout = _layouts(activations)
        self.layers = nn.SequentialCell([FusedStage(layer, activations)
                                         for layer in (net.layer1, net.layer2, net.layer3, net.layer4)])
        self.fc = nn.Dense(net.fc.in_channels, net.fc.out_channels)
        self.load_from(net)
        self.set_train(False)

    def load_from(self, net: ResNet) -> None:
        """Takes net's current weights and BatchNorm statistics (net must have this network's architecture)."""
        version = next(_weights_versions)
        self.conv1.load(net.conv1, net.bn1, version)
        for fused, layer in zip(self.layers, (net.layer1, net.layer2, net.layer3, net.layer4)):
            fused.load(layer, version)
        self.fc.weight.set_data(net.fc.weight.value().copy())
        self.fc.bias.set_data(net.fc.bias.value().copy())

    def construct(self, x):
        n = x.shape[0]
        if not self.runs_blocked:  # a constant: the graph keeps one path
            x = ops.transpose(x, (0, 2, 3, 1))
        x = self.conv1(x)
        if self.has_maxpool:  # a constant, like runs_blocked
            x = self.maxpool(x, self.maxpool_layout)
        x = self.layers(x)
        _, c, h, w = _image_dims(x.shape, BLOCKED if self.runs_blocked else NHWC)
        if h * w == 1:  # one pixel: its features in either layout (MindSpore's mean over size-1 axes took ~0.4 ms)
            return self.fc(x.reshape(n, c))
        if self.runs_blocked:  # (N, C, H, W) holding N, C/block, H, W, block
            block = self.block
            return self.fc(x.reshape(n, c // block, h, w, block).mean(axis=(2, 3)).reshape(n, c))
        return self.fc(x.mean(axis=(1, 2)))


def _stem_max_pool(net: ResNet) -> Optional[bool]:
    """True when net's stem ends in ResNet's imagenet max pool (3x3, stride 2, padding 1: what the native MaxPool
    runs), False when it has none (the cifar stem's Identity), None for any other cell in its place."""
    pool = net.maxpool
    if isinstance(pool, nn.Identity):
        return False
    if isinstance(pool, nn.SequentialCell) and len(pool) == 2 and isinstance(pool[0], ZeroPad1) and \
            isinstance(pool[1], nn.MaxPool2d):
        return True
    return None


def why_not_fusable(net: nn.Cell) -> Optional[str]:
    """None when FusedResNet can run net's inference, else the reason."""
    if not isinstance(net, ResNet):
        return "not a ResNet"
    if getattr(net, "same_padding", False):
        return (f"it is built with {net.semantics} semantics, which pad 'same' (asymmetrically at stride 2) where the "
                "fused kernels pad symmetrically")
    if _stem_max_pool(net) is None:
        return "its stem's max pool is neither the imagenet stem's (3x3, stride 2, padding 1) nor absent"
    convs = [cell for _, cell in net.cells_and_names() if isinstance(cell, nn.Conv2d)]
    if not all(isinstance(conv, BlockedConv2d) and conv.blocked_op is not None for conv in convs):
        return "its convolutions are not all the native blocked ones"
    for _, cell in net.cells_and_names():
        if isinstance(cell, (BasicBlock, Bottleneck)) and cell.downsample is not None and len(cell.downsample) != 2:
            return "a downsample branch is not a convolution and a BatchNorm"
    return None


def inference_network(net: nn.Cell, reuse: Optional[nn.Cell] = None, layout: str = "auto") -> nn.Cell:
    """The cell to run net's inference with: a FusedResNet of it when fusable, else net in inference mode.

    reuse: the result of an earlier call for the same net; a FusedResNet is then refreshed with net's current
    weights instead of built again (its compiled graph is kept). layout: FusedResNet's (LAYOUT_CHOICES).
    """
    if why_not_fusable(net) is not None:
        net.set_train(False)
        return net
    if isinstance(reuse, FusedResNet):
        reuse.load_from(net)
        return reuse
    return FusedResNet(net, layout)
