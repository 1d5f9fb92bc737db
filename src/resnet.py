"""ResNet-18/34/50/101/152 for MindSpore, laid out like torchvision's resnet.

Cells carry torchvision's module names (conv1, bn1, layer1.0.conv2, layer2.0.downsample.0, fc), so a
PyTorch state_dict maps onto this network by renaming the BatchNorm fields only
(weight->gamma, bias->beta, running_mean->moving_mean, running_var->moving_variance).

Two stems: torchvision's ("imagenet": 7x7 stride-2 conv1 and a max pool) and a CIFAR one ("cifar": 3x3 stride-1
conv1, no max pool, as kuangliu/pytorch-cifar). They share parameter names; conv1.weight's shape tells them apart.
"""
import math
from typing import Callable, Dict, List, Optional, Type, Union

from mindspore import nn, ops
from mindspore.common import initializer as init

from src.architectures import ARCHITECTURES as LAYOUTS, BASIC, BOTTLENECK, CIFAR, IMAGENET, STEMS

# torch.nn.BatchNorm2d defaults: momentum 0.1 (MindSpore counts it the other way round), eps 1e-5.
BN_MOMENTUM = 0.9
BN_EPS = 1e-5


ConvClass = Type[nn.Conv2d]  # nn.Conv2d or a subclass with other kernels (src.onednn_conv.BlockedConv2d)


def conv3x3(in_planes: int, out_planes: int, stride: int = 1, conv: ConvClass = nn.Conv2d) -> nn.Conv2d:
    # pad_mode='pad' with explicit padding: MindSpore's default 'same' pads asymmetrically at stride 2.
    return conv(in_planes, out_planes, kernel_size=3, stride=stride, pad_mode="pad", padding=1, has_bias=False)


def conv1x1(in_planes: int, out_planes: int, stride: int = 1, conv: ConvClass = nn.Conv2d) -> nn.Conv2d:
    return conv(in_planes, out_planes, kernel_size=1, stride=stride, pad_mode="valid", has_bias=False)


def batch_norm(channels: int) -> nn.BatchNorm2d:
    return nn.BatchNorm2d(channels, eps=BN_EPS, momentum=BN_MOMENTUM)


def conv_bn(conv: nn.Conv2d, bn: nn.BatchNorm2d, x):
    """bn(conv(x)); a convolution that can run its BatchNorm itself (BlockedConv2d.with_batchnorm) does."""
    if hasattr(conv, "with_batchnorm"):
        return conv.with_batchnorm(x, bn)
    return bn(conv(x))


class BasicBlock(nn.Cell):
    """Two 3x3 convolutions (ResNet-18/34)."""
    expansion = 1

    def __init__(self, inplanes: int, planes: int, stride: int = 1,
                 downsample: Optional[nn.SequentialCell] = None, conv: ConvClass = nn.Conv2d) -> None:
        super().__init__()
        self.conv1 = conv3x3(inplanes, planes, stride, conv)
        self.bn1 = batch_norm(planes)
        self.relu = nn.ReLU()
        self.conv2 = conv3x3(planes, planes, conv=conv)
        self.bn2 = batch_norm(planes)
        self.downsample = downsample

    def last_bn(self) -> nn.BatchNorm2d:
        return self.bn2

    def construct(self, x):
        identity = x
        out = self.relu(conv_bn(self.conv1, self.bn1, x))
        out = conv_bn(self.conv2, self.bn2, out)
        if self.downsample is not None:
            identity = conv_bn(self.downsample[0], self.downsample[1], x)
        return self.relu(out + identity)


class Bottleneck(nn.Cell):
    """1x1 -> 3x3 -> 1x1 with the stride on the 3x3 convolution (torchvision's "ResNet V1.5")."""
    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1,
                 downsample: Optional[nn.SequentialCell] = None, conv: ConvClass = nn.Conv2d) -> None:
        super().__init__()
        self.conv1 = conv1x1(inplanes, planes, conv=conv)
        self.bn1 = batch_norm(planes)
        self.conv2 = conv3x3(planes, planes, stride, conv)
        self.bn2 = batch_norm(planes)
        self.conv3 = conv1x1(planes, planes * self.expansion, conv=conv)
        self.bn3 = batch_norm(planes * self.expansion)
        self.relu = nn.ReLU()
        self.downsample = downsample

    def last_bn(self) -> nn.BatchNorm2d:
        return self.bn3

    def construct(self, x):
        identity = x
        out = self.relu(conv_bn(self.conv1, self.bn1, x))
        out = self.relu(conv_bn(self.conv2, self.bn2, out))
        out = conv_bn(self.conv3, self.bn3, out)
        if self.downsample is not None:
            identity = conv_bn(self.downsample[0], self.downsample[1], x)
        return self.relu(out + identity)


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
                 zero_init_residual: bool = False, conv: ConvClass = nn.Conv2d, stem: str = IMAGENET) -> None:
        super().__init__()
        if stem not in STEMS:
            raise ValueError(f"unknown stem {stem!r}; choose one of {', '.join(STEMS)}")
        self.stem = stem
        self.inplanes = 64
        if stem == CIFAR:
            # kuangliu/pytorch-cifar's stem: a 3x3 stride-1 convolution and no max pool (torchvision's network
            # with conv1 = Conv2d(3, 64, 3, 1, 1, bias=False) and maxpool = Identity()).
            self.conv1 = conv3x3(3, 64, conv=conv)
        else:
            self.conv1 = conv(3, 64, kernel_size=7, stride=2, pad_mode="pad", padding=3, has_bias=False)
        self.bn1 = batch_norm(64)
        self.relu = nn.ReLU()
        if stem == CIFAR:
            self.maxpool = nn.Identity()  # no parameters: the checkpoint names are the imagenet stem's
        else:
            # torch's MaxPool2d(3, 2, padding=1) as an explicit zero pad and a 'valid' pool: the input is
            # post-ReLU (>= 0), so zero padding gives the same maxima as torch's -inf padding, and unlike
            # MaxPool2d(pad_mode='pad') this form exports to ONNX.
            self.maxpool = nn.SequentialCell([ZeroPad1(), nn.MaxPool2d(kernel_size=3, stride=2, pad_mode="valid")])
        self.layer1 = self._make_layer(block, 64, layers[0], 1, conv)
        self.layer2 = self._make_layer(block, 128, layers[1], 2, conv)
        self.layer3 = self._make_layer(block, 256, layers[2], 2, conv)
        self.layer4 = self._make_layer(block, 512, layers[3], 2, conv)
        self.fc = nn.Dense(512 * block.expansion, num_classes)
        self.num_classes = num_classes
        self._initialize(zero_init_residual)

    def _make_layer(self, block: Block, planes: int, blocks: int, stride: int, conv: ConvClass) -> nn.SequentialCell:
        downsample = None
        if stride != 1 or self.inplanes != planes * block.expansion:
            downsample = nn.SequentialCell([conv1x1(self.inplanes, planes * block.expansion, stride, conv),
                                            batch_norm(planes * block.expansion)])
        cells = [block(self.inplanes, planes, stride, downsample, conv)]
        self.inplanes = planes * block.expansion
        cells += [block(self.inplanes, planes, conv=conv) for _ in range(1, blocks)]
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
        x = self.maxpool(self.relu(conv_bn(self.conv1, self.bn1, x)))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        # Global average pooling: a mean over H and W equals AdaptiveAvgPool2d((1, 1)) and is cheaper.
        x = x.mean(axis=(2, 3))
        return self.fc(x)


# src/architectures.py's list with the block classes: name -> (block class, blocks in layer1..layer4).
ARCHITECTURES: Dict[str, tuple] = {name: ({BASIC: BasicBlock, BOTTLENECK: Bottleneck}[kind], list(layers))
                                   for name, (kind, layers) in LAYOUTS.items()}


def build_resnet(model_name: str, num_classes: int = 1000, zero_init_residual: bool = False,
                 conv_implementation: str = "mindspore", stem: str = IMAGENET) -> ResNet:
    """Builds one of ARCHITECTURES by name, its convolutions from MindSpore's nn.Conv2d ("mindspore") or
    oneDNN's blocked-layout kernels ("onednn_blocked", CPU; see src/onednn_conv.py). Both have the same
    parameters, so checkpoints are the same. stem: "imagenet" (torchvision's 7x7 stride-2 conv1 and max pool) or
    "cifar" (a 3x3 stride-1 conv1, no max pool); the parameter names are the same, conv1.weight's shape differs."""
    if model_name not in ARCHITECTURES:
        raise ValueError(f"unknown model_name {model_name!r}; choose one of {', '.join(ARCHITECTURES)}")
    if stem not in STEMS:
        raise ValueError(f"unknown stem {stem!r}; choose one of {', '.join(STEMS)}")
    block, layers = ARCHITECTURES[model_name]
    conv = nn.Conv2d
    if conv_implementation == "onednn_blocked":
        from src.onednn_conv import BlockedConv2d  # only then: it needs the built native library
        conv = BlockedConv2d
    return ResNet(block, layers, num_classes=num_classes, zero_init_residual=zero_init_residual, conv=conv,
                  stem=stem)


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
