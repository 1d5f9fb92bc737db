"""ResNet-18/34/50/101/152 for MindSpore, laid out like torchvision's resnet.

Cells carry torchvision's module names (conv1, bn1, layer1.0.conv2, layer2.0.downsample.0, fc), so a
PyTorch state_dict maps onto this network by renaming the BatchNorm fields only
(weight->gamma, bias->beta, running_mean->moving_mean, running_var->moving_variance).

Two stems: torchvision's ("imagenet": 7x7 stride-2 conv1 and a max pool) and a CIFAR one ("cifar": 3x3 stride-1
conv1, no max pool, as kuangliu/pytorch-cifar). They share parameter names; conv1.weight's shape tells them apart.

Three semantics (src/architectures.py SEMANTICS), with the same parameter names: torch (torchvision's, this project's
own), mindcv (its stem max pool pads 'same') and models_zoo (the MindSpore models zoo's: BatchNorm eps 1e-4, and for
ResNet-50/101/152 'same' padding of the stem conv, max pool and stride-2 3x3 convs), so that a checkpoint of either
zoo gives its home network's outputs. 'same' padding is an explicit zero pad (SamePad) before a 'valid' convolution
or pool: it exports to ONNX and the native blocked convolutions run the 'valid' convolution.
"""
import math
from typing import Callable, Dict, List, Optional, Type, Union

from mindspore import dtype as mstype, lazy_inline, nn, ops
from mindspore.common import initializer as init

from src.architectures import (ARCHITECTURES as LAYOUTS, BASIC, BOTTLENECK, CIFAR, IMAGENET, SEMANTICS, STEMS,
                                TORCH, Variant, variant_of)

# torch.nn.BatchNorm2d defaults: momentum 0.1 (MindSpore counts it the other way round), eps 1e-5.
BN_MOMENTUM = 0.9
BN_EPS = 1e-5


ConvClass = Type[nn.Conv2d]  # nn.Conv2d or a subclass with other kernels (src.onednn_conv.BlockedConv2d)


def conv3x3(in_planes: int, out_planes: int, stride: int = 1, conv: ConvClass = nn.Conv2d,
            padded: bool = True) -> nn.Conv2d:
    # pad_mode='pad' with explicit padding: MindSpore's default 'same' pads asymmetrically at stride 2.
    # padded=False: 'valid', for a convolution whose input a SamePad cell pads.
    if not padded:
        return conv(in_planes, out_planes, kernel_size=3, stride=stride, pad_mode="valid", has_bias=False)
    return conv(in_planes, out_planes, kernel_size=3, stride=stride, pad_mode="pad", padding=1, has_bias=False)


def conv1x1(in_planes: int, out_planes: int, stride: int = 1, conv: ConvClass = nn.Conv2d) -> nn.Conv2d:
    return conv(in_planes, out_planes, kernel_size=1, stride=stride, pad_mode="valid", has_bias=False)


def batch_norm(channels: int, eps: float = BN_EPS) -> nn.BatchNorm2d:
    return nn.BatchNorm2d(channels, eps=eps, momentum=BN_MOMENTUM)


def _same_padding(size: int, kernel: int, stride: int):
    """(before, after): the zeros MindSpore's pad_mode 'same' adds along a dimension of this size."""
    total = max((-(-size // stride) - 1) * stride + kernel - size, 0)
    return total // 2, total - total // 2


def _zeros_around(x, axis: int, before: int, after: int):
    """x with before and after zero rows (axis 2) or columns (axis 3), by concatenation."""
    parts = []
    if before > 0:
        parts.append(ops.zeros_like(x[:, :, :before, :] if axis == 2 else x[:, :, :, :before]))
    parts.append(x)
    if after > 0:
        parts.append(ops.zeros_like(x[:, :, :after, :] if axis == 2 else x[:, :, :, :after]))
    return ops.concat(parts, axis) if len(parts) > 1 else x


class SamePad(nn.Cell):
    """The zeros MindSpore's pad_mode 'same' puts around an (N, C, H, W) input of a kernel x kernel convolution or
    pool at stride: max((ceil(n / stride) - 1) * stride + kernel - n, 0) along H and W, the smaller half first. A
    'valid' convolution of the result is the 'same' convolution; so is a 'valid' max pool of a post-ReLU (>= 0)
    input. H and W are static (also with a dynamic batch); the sizes come from them at compile time."""

    def __init__(self, kernel: int, stride: int) -> None:
        super().__init__()
        self.kernel = kernel
        self.stride = stride

    def construct(self, x):
        top, bottom = _same_padding(x.shape[2], self.kernel, self.stride)
        left, right = _same_padding(x.shape[3], self.kernel, self.stride)
        return _zeros_around(_zeros_around(x, 2, top, bottom), 3, left, right)


def conv_bn(conv: nn.Conv2d, bn: nn.BatchNorm2d, x, blocked: bool = False, blocked_output: Optional[bool] = None):
    """bn(conv(x)); a convolution that can run its BatchNorm itself (BlockedConv2d.with_batchnorm) does. blocked: x
    and the result are in channel blocks (a training step of a network whose convolutions all do); blocked_output,
    where given, says so for the result alone."""
    if hasattr(conv, "with_batchnorm"):
        return conv.with_batchnorm(x, bn, blocked, blocked if blocked_output is None else blocked_output)
    return bn(conv(x))


def shortcut(downsample: nn.SequentialCell, x, after, blocked: bool = False):
    """A block's downsampled identity, bn(conv(x)). In a training step on channel blocks it runs once `after` (the
    input of the block's last convolution) exists: left free, MindSpore's runtime ran it at varying points, and the
    step's peak memory at 224x224 came out 3.8 or 4.25 GB from one run to the next."""
    if blocked:
        x = ops.depend(x, after)
    return conv_bn(downsample[0], downsample[1], x, blocked)


def conv_bn_add_relu(conv: nn.Conv2d, bn: nn.BatchNorm2d, relu: nn.Cell, x, identity, blocked: bool = False,
                     relu_gradient_by_users: bool = False):
    """relu(bn(conv(x)) + identity), a residual block's end; on channel blocks (a training step, see conv_bn) a
    convolution that can run its BatchNorm itself runs the addition and ReLU in the same call, and with
    relu_gradient_by_users leaves the ReLU's gradient to the result's users (the ResNet blocks: the next block's
    input_users, or ResNet's output_relu_gradient after the last)."""
    if blocked and hasattr(conv, "with_batchnorm_add_relu"):
        return conv.with_batchnorm_add_relu(x, bn, identity, relu_gradient_by_users)
    return relu(conv_bn(conv, bn, x, blocked) + identity)


def block_input_users(conv: ConvClass) -> Optional[nn.Cell]:
    """The cell that hands a residual block's input to its two users in a training step on channel blocks, their
    gradients summed with the ReLU's in one pass (BlockedConv2d.relu_output_fanout_cell); None for other
    convolutions."""
    return conv.relu_output_fanout_cell() if hasattr(conv, "relu_output_fanout_cell") else None


def conv_bn_relu(conv: nn.Conv2d, bn: nn.BatchNorm2d, relu: nn.Cell, x, blocked: bool = False):
    """relu(bn(conv(x))); a convolution that can run its BatchNorm itself runs the ReLU in the same call."""
    if hasattr(conv, "with_batchnorm"):
        return conv.with_batchnorm(x, bn, blocked, blocked, True)
    return relu(bn(conv(x)))


class BasicBlock(nn.Cell):
    """Two 3x3 convolutions (ResNet-18/34)."""
    expansion = 1

    # lazy_inline: MindSpore compiles blocks built with the same arguments once, as one graph that each of them
    # calls with its own parameters, and inlines it at the front end, before a backend sees the graph (MindSpore
    # documents the decorator for Ascend; it runs and is tested here on the CPU). ResNet-50's training step at
    # 32x32 compiled in 5.8 s instead of 8.7 and held 190 MB less; ResNet-152's in 10 s instead of 29, with 900 MB
    # less (docs/performance.md). The blocks share the graph's constants, the first block's: what differs between
    # them must be a parameter or an input.
    @lazy_inline(policy="front")
    def __init__(self, inplanes: int, planes: int, stride: int = 1,
                 downsample: Optional[nn.SequentialCell] = None, conv: ConvClass = nn.Conv2d,
                 variant: Variant = Variant()) -> None:
        super().__init__()
        self.pad1 = SamePad(3, stride) if variant.stride2_conv_same and stride != 1 else None
        self.conv1 = conv3x3(inplanes, planes, stride, conv, padded=self.pad1 is None)
        self.bn1 = batch_norm(planes, variant.block_bn_eps)
        self.relu = nn.ReLU()
        self.conv2 = conv3x3(planes, planes, conv=conv)
        self.bn2 = batch_norm(planes, variant.block_bn_eps)
        self.downsample = downsample
        self.input_users = block_input_users(conv)

    def last_bn(self) -> nn.BatchNorm2d:
        return self.bn2

    def construct(self, x, blocked: bool = False):
        # blocked: x and the result are in channel blocks (ResNet's training step, see conv_bn).
        identity = x
        if blocked:
            x, identity = self.input_users(x)
        out = x
        if self.pad1 is not None:
            out = self.pad1(out)
        out = conv_bn_relu(self.conv1, self.bn1, self.relu, out, blocked)
        if self.downsample is not None:
            identity = shortcut(self.downsample, identity, out, blocked)
        return conv_bn_add_relu(self.conv2, self.bn2, self.relu, out, identity, blocked, relu_gradient_by_users=True)


class Bottleneck(nn.Cell):
    """1x1 -> 3x3 -> 1x1 with the stride on the 3x3 convolution (torchvision's "ResNet V1.5")."""
    expansion = 4

    @lazy_inline(policy="front")  # as BasicBlock's
    def __init__(self, inplanes: int, planes: int, stride: int = 1,
                 downsample: Optional[nn.SequentialCell] = None, conv: ConvClass = nn.Conv2d,
                 variant: Variant = Variant()) -> None:
        super().__init__()
        self.conv1 = conv1x1(inplanes, planes, conv=conv)
        self.bn1 = batch_norm(planes, variant.block_bn_eps)
        self.pad2 = SamePad(3, stride) if variant.stride2_conv_same and stride != 1 else None
        self.conv2 = conv3x3(planes, planes, stride, conv, padded=self.pad2 is None)
        self.bn2 = batch_norm(planes, variant.block_bn_eps)
        self.conv3 = conv1x1(planes, planes * self.expansion, conv=conv)
        self.bn3 = batch_norm(planes * self.expansion, variant.block_bn_eps)
        self.relu = nn.ReLU()
        self.downsample = downsample
        self.input_users = block_input_users(conv)

    def last_bn(self) -> nn.BatchNorm2d:
        return self.bn3

    def construct(self, x, blocked: bool = False):
        # blocked: x and the result are in channel blocks (ResNet's training step, see conv_bn).
        identity = x
        if blocked:
            x, identity = self.input_users(x)
        out = conv_bn_relu(self.conv1, self.bn1, self.relu, x, blocked)
        if self.pad2 is not None:
            out = self.pad2(out)
        out = conv_bn_relu(self.conv2, self.bn2, self.relu, out, blocked)
        if self.downsample is not None:
            identity = shortcut(self.downsample, identity, out, blocked)
        return conv_bn_add_relu(self.conv3, self.bn3, self.relu, out, identity, blocked, relu_gradient_by_users=True)


Block = Union[Type[BasicBlock], Type[Bottleneck]]


class ZeroPad1(nn.Cell):
    """One row and column of zeros on each side of an (N, C, H, W) tensor, by concatenation: MindSpore's CPU Pad
    kernel (nn.Pad) is slow for this small tensor and shows up in a 32x32 training step's profile, a concatenation
    is cheap. Works with a dynamic batch size and exports to ONNX."""

    def construct(self, x):
        rows = ops.zeros_like(x[:, :, :1, :])
        x = ops.concat((rows, x, rows), 2)
        columns = ops.zeros_like(x[:, :, :, :1])
        return ops.concat((columns, x, columns), 3)


class ResNet(nn.Cell):
    """ResNet backbone plus a linear classifier over the globally averaged features."""

    def __init__(self, block: Block, layers: List[int], num_classes: int = 1000,
                 zero_init_residual: bool = False, conv: ConvClass = nn.Conv2d, stem: str = IMAGENET,
                 semantics: str = TORCH, variant: Optional[Variant] = None, blocked_activations: bool = True) -> None:
        super().__init__()
        if stem not in STEMS:
            raise ValueError(f"unknown stem {stem!r}; choose one of {', '.join(STEMS)}")
        if semantics not in SEMANTICS:
            raise ValueError(f"unknown semantics {semantics!r}; choose one of {', '.join(SEMANTICS)}")
        self.stem = stem
        self.semantics = semantics  # src/architectures.py SEMANTICS; variant says what it means for this network
        self.variant = variant or Variant()
        variant = self.variant
        # Whether any layer pads 'same' (asymmetric at stride 2): the fused inference network does not run those.
        self.same_padding = variant.stride2_conv_same or (stem == IMAGENET and variant.same_padding)
        self.stem_pad = None
        self.inplanes = 64
        if stem == CIFAR:
            # kuangliu/pytorch-cifar's stem: a 3x3 stride-1 convolution and no max pool (torchvision's network
            # with conv1 = Conv2d(3, 64, 3, 1, 1, bias=False) and maxpool = Identity()).
            self.conv1 = conv3x3(3, 64, conv=conv)
        elif variant.stem_conv_same:
            self.stem_pad = SamePad(7, 2)
            self.conv1 = conv(3, 64, kernel_size=7, stride=2, pad_mode="valid", has_bias=False)
        else:
            self.conv1 = conv(3, 64, kernel_size=7, stride=2, pad_mode="pad", padding=3, has_bias=False)
        if hasattr(self.conv1, "defer_input_gradient"):
            self.conv1.defer_input_gradient()  # the images' gradient: computed only if someone asks for it
        self.bn1 = batch_norm(64, variant.stem_bn_eps)
        self.relu = nn.ReLU()
        if stem == CIFAR:
            self.maxpool = nn.Identity()  # no parameters: the checkpoint names are the imagenet stem's
        else:
            # torch's MaxPool2d(3, 2, padding=1) as an explicit zero pad and a 'valid' pool: the input is
            # post-ReLU (>= 0), so zero padding gives the same maxima as torch's -inf padding, and unlike
            # MaxPool2d(pad_mode='pad') this form exports to ONNX.
            # mindcv's and the models zoo's ResNet-50+ pool pads 'same' instead (SamePad: 0 before, 1 after at an
            # even size), zeros for the same reason.
            pad = SamePad(3, 2) if variant.max_pool_same else ZeroPad1()
            self.maxpool = nn.SequentialCell([pad, nn.MaxPool2d(kernel_size=3, stride=2, pad_mode="valid")])
        self.layer1 = self._make_layer(block, 64, layers[0], 1, conv, variant)
        self.layer2 = self._make_layer(block, 128, layers[1], 2, conv, variant)
        self.layer3 = self._make_layer(block, 256, layers[2], 2, conv, variant)
        self.layer4 = self._make_layer(block, 512, layers[3], 2, conv, variant)
        self.fc = nn.Dense(512 * block.expansion, num_classes)
        self.num_classes = num_classes
        self._initialize(zero_init_residual)
        self.to_blocks = self.from_blocks = self.output_relu_gradient = None
        layers = (self.layer1, self.layer2, self.layer3, self.layer4)
        convs = [cell for layer in layers for _, cell in layer.cells_and_names() if isinstance(cell, nn.Conv2d)]
        if (blocked_activations and hasattr(conv, "channel_block_cells") and not variant.stride2_conv_same
                and all(cell.runs_batchnorm_itself() for cell in convs)):
            # Training keeps layer1..layer4's activations in channel blocks: one reorder in and one out per step,
            # instead of one around every convolution (SamePad's concatenations would need the plain layout).
            self.to_blocks, self.from_blocks = conv.channel_block_cells()
            # The blocks leave their output's ReLU gradient to its users (conv_bn_add_relu): layer4's last to this.
            self.output_relu_gradient = conv.relu_output_gradient_cell()
        # Whether training's conv1 writes channel blocks, its ReLU and torch's max pool (stem_pool, one native call)
        # running on them, so that layer1's input needs no reorder.
        self.stem_blocked, self.stem_pool = False, None
        if self.to_blocks is not None and self.conv1.runs_batchnorm_itself():
            if stem == CIFAR:
                self.stem_blocked = True
            elif not variant.max_pool_same and hasattr(conv, "relu_max_pool_cell"):
                self.stem_blocked, self.stem_pool = True, conv.relu_max_pool_cell()

    def _make_layer(self, block: Block, planes: int, blocks: int, stride: int, conv: ConvClass,
                    variant: Variant) -> nn.SequentialCell:
        downsample = None
        if stride != 1 or self.inplanes != planes * block.expansion:
            # A 1x1 'same' convolution pads nothing at any stride: 'valid' in every semantics.
            downsample = nn.SequentialCell([conv1x1(self.inplanes, planes * block.expansion, stride, conv),
                                            batch_norm(planes * block.expansion, variant.shortcut_bn_eps)])
        cells = [block(self.inplanes, planes, stride, downsample, conv, variant)]
        self.inplanes = planes * block.expansion
        cells += [block(self.inplanes, planes, conv=conv, variant=variant) for _ in range(1, blocks)]
        return nn.SequentialCell(cells)

    def _initialize(self, zero_init_residual: bool) -> None:
        """The migration guide's initialisation (torchvision's, with a zero Dense bias)."""
        for _, cell in self.cells_and_names():
            if isinstance(cell, nn.Conv2d):
                cell.weight.set_data(init.initializer(
                    init.HeNormal(negative_slope=0, mode="fan_out", nonlinearity="relu"),
                    cell.weight.shape, cell.weight.dtype))
            elif isinstance(cell, nn.BatchNorm2d):
                cell.gamma.set_data(init.initializer("ones", cell.gamma.shape, cell.gamma.dtype))
                cell.beta.set_data(init.initializer("zeros", cell.beta.shape, cell.beta.dtype))
            elif isinstance(cell, nn.Dense):
                cell.weight.set_data(init.initializer(init.HeUniform(negative_slope=math.sqrt(5)),
                                                      cell.weight.shape, cell.weight.dtype))
                cell.bias.set_data(init.initializer("zeros", cell.bias.shape, cell.bias.dtype))
        if zero_init_residual:
            # Each residual branch starts as zero, so every block starts as the identity (Goyal et al. 2017).
            for _, cell in self.cells_and_names():
                if isinstance(cell, (BasicBlock, Bottleneck)):
                    gamma = cell.last_bn().gamma
                    gamma.set_data(init.initializer("zeros", gamma.shape, gamma.dtype))

    def construct(self, x):
        if self.stem_pad is not None:
            x = self.stem_pad(x)
        blocked = self.to_blocks is not None and self.training and x.dtype == mstype.float32
        if blocked and self.stem_blocked:
            x = conv_bn(self.conv1, self.bn1, x, False, True)
            x = self.relu(x) if self.stem_pool is None else self.stem_pool(x)
        else:
            x = self.maxpool(self.relu(conv_bn(self.conv1, self.bn1, x)))
            if blocked:
                x = self.to_blocks(x)
        if blocked:
            for layer in (self.layer1, self.layer2, self.layer3, self.layer4):
                for block in layer:  # each block told its input is blocked: SequentialCell passes one argument
                    x = block(x, True)
            x = self.from_blocks(self.output_relu_gradient(x))
        else:
            x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        # Global average pooling: a mean over H and W equals AdaptiveAvgPool2d((1, 1)) and is cheaper.
        x = x.mean(axis=(2, 3))
        return self.fc(x)


# src/architectures.py's list with the block classes: name -> (block class, blocks in layer1..layer4).
ARCHITECTURES: Dict[str, tuple] = {name: ({BASIC: BasicBlock, BOTTLENECK: Bottleneck}[kind], list(layers))
                                   for name, (kind, layers) in LAYOUTS.items()}


def build_resnet(model_name: str, num_classes: int = 1000, zero_init_residual: bool = False,
                 conv_implementation: str = "mindspore", stem: str = IMAGENET, semantics: str = TORCH,
                 blocked_activations: bool = True) -> ResNet:
    """Builds one of ARCHITECTURES by name, its convolutions from MindSpore's nn.Conv2d ("mindspore") or
    oneDNN's blocked-layout kernels ("onednn_blocked", CPU; see src/onednn_conv.py). Both have the same
    parameters, so checkpoints are the same. stem: "imagenet" (torchvision's 7x7 stride-2 conv1 and max pool) or
    "cifar" (a 3x3 stride-1 conv1, no max pool); the parameter names are the same, conv1.weight's shape differs.
    semantics: "torch" (this project's), "mindcv" or "models_zoo": computes as that zoo's ResNet does (padding,
    BatchNorm eps; src/architectures.py variant_of), with the same parameter names. blocked_activations: with
    onednn_blocked, a training step keeps layer1..layer4's activations in channel blocks where it can (False:
    reordered to the plain layout around every convolution, for comparisons; the results are the same up to
    float32 rounding, where the blocked step runs other kernels: the stem's pool, layer3's 2x2 maps at 32x32)."""
    if model_name not in ARCHITECTURES:
        raise ValueError(f"unknown model_name {model_name!r}; choose one of {', '.join(ARCHITECTURES)}")
    if stem not in STEMS:
        raise ValueError(f"unknown stem {stem!r}; choose one of {', '.join(STEMS)}")
    block, layers = ARCHITECTURES[model_name]
    variant = variant_of(semantics, model_name)  # ValueError for an unknown semantics
    conv = nn.Conv2d
    if conv_implementation == "onednn_blocked":
        from src.onednn_conv import BlockedConv2d  # only then: it needs the built native library
        conv = BlockedConv2d
    return ResNet(block, layers, num_classes=num_classes, zero_init_residual=zero_init_residual, conv=conv,
                  stem=stem, semantics=semantics, variant=variant, blocked_activations=blocked_activations)


def _factory(model_name: str) -> Callable[..., ResNet]:
    def make(num_classes: int = 1000, zero_init_residual: bool = False, stem: str = IMAGENET) -> ResNet:
        return build_resnet(model_name, num_classes, zero_init_residual, stem=stem)
    make.__name__ = model_name
    make.__doc__ = f"{model_name} as in torchvision (num_classes, zero_init_residual, stem)."
    return make


resnet18 = _factory("resnet18")
resnet34 = _factory("resnet34")
resnet50 = _factory("resnet50")
resnet101 = _factory("resnet101")
resnet152 = _factory("resnet152")


def count_trainable_parameters(net: nn.Cell) -> int:
    """Number of trainable scalars: what torchvision counts with sum(p.numel() for p in parameters())."""
    return sum(int(p.size) for p in net.trainable_params())


__all__ = ["ResNet", "BasicBlock", "Bottleneck", "ARCHITECTURES", "build_resnet", "resnet18", "resnet34",
           "resnet50", "resnet101", "resnet152", "count_trainable_parameters"]
