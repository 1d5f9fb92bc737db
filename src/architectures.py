"""The one list of ResNet depths this project builds: name -> (block kind, blocks in layer1..layer4).

Plain data without MindSpore, so that the config's choices, convert_pth.py, benchmark.py (whose PyTorch and
numpy workers must stay free of MindSpore) and the weight-name inference read it without loading a framework;
src/resnet.py builds its networks from it.
"""
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

BASIC, BOTTLENECK = "basic", "bottleneck"  # two 3x3 convolutions (ResNet-18/34); 1x1 -> 3x3 -> 1x1 (50/101/152)

ARCHITECTURES: Dict[str, Tuple[str, Tuple[int, int, int, int]]] = {
    "resnet18": (BASIC, (2, 2, 2, 2)),
    "resnet34": (BASIC, (3, 4, 6, 3)),
    "resnet50": (BOTTLENECK, (3, 4, 6, 3)),
    "resnet101": (BOTTLENECK, (3, 4, 23, 3)),
    "resnet152": (BOTTLENECK, (3, 8, 36, 3)),
}
MODEL_NAMES: Tuple[str, ...] = tuple(ARCHITECTURES)

# The stem (what runs before layer1): imagenet = torchvision's 7x7 stride-2 convolution and 3x3 stride-2 max pool
# (the input shrinks 4x before layer1); cifar = one 3x3 stride-1 convolution and no max pool, as the CIFAR ResNets
# of kuangliu/pytorch-cifar (the input keeps its size until layer2). Both have 64 channels, BatchNorm and ReLU.
IMAGENET, CIFAR = "imagenet", "cifar"
STEMS: Tuple[str, ...] = (IMAGENET, CIFAR)
# conv1's kernel size in each stem: conv1.weight has shape (64, 3, k, k), which names the stem of a set of weights.
STEM_KERNEL = {IMAGENET: 7, CIFAR: 3}


def has_basic_blocks(model_name: str) -> bool:
    """Whether model_name is built from BasicBlocks (True for a name not in the list, like ResNet-18)."""
    return ARCHITECTURES.get(model_name, (BASIC,))[0] == BASIC


def stem_of_conv1(shape) -> Optional[str]:
    """The stem whose conv1.weight has this shape ((64, 3, 7, 7): imagenet, (64, 3, 3, 3): cifar); None otherwise."""
    shape = tuple(int(d) for d in shape)
    for stem, kernel in STEM_KERNEL.items():
        if len(shape) == 4 and shape[1] == 3 and shape[2:] == (kernel, kernel):
            return stem
    return None


# Semantics: how a network with these parameters computes, after the zoo whose checkpoints it reproduces. Same
# parameter names and shapes in all three; they differ in padding and BatchNorm eps only.
# - torch: torchvision's ResNet (this project's own): symmetric padding, BatchNorm eps 1e-5.
# - mindcv: mindcv's ResNet (mindcv/models/resnet.py): as torch, but its stem max pool is pad_mode 'same'.
# - models_zoo: the MindSpore models zoo's (official/cv/ResNet/src/resnet.py). ResNet-18/34 (res_base): as torch,
#   but the block BatchNorms (bn1d, bn2d) have eps 1e-4. ResNet-50/101/152: the 7x7 stem conv, the max pool and the
#   stride-2 3x3 convs pad 'same', every BatchNorm has eps 1e-4.
# 'same' pads a kernel k at stride s with max((ceil(n/s) - 1) * s + k - n, 0) zeros, the smaller half first (top,
# left): at stride 2 and an even size that is asymmetric (3x3: 0 before, 1 after; 7x7: 2 before, 3 after).
TORCH, MINDCV, MODELS_ZOO = "torch", "mindcv", "models_zoo"
SEMANTICS: Tuple[str, ...] = (TORCH, MINDCV, MODELS_ZOO)


@dataclass(frozen=True)
class Variant:
    """What a semantics means for one block kind."""
    stem_conv_same: bool = False  # the imagenet stem's 7x7 stride-2 conv pads 'same' (else 3 on every side)
    max_pool_same: bool = False  # the imagenet stem's max pool pads 'same' (else 1 on every side)
    stride2_conv_same: bool = False  # the stride-2 3x3 block convolutions pad 'same' (else 1 on every side)
    stem_bn_eps: float = 1e-5  # bn1
    block_bn_eps: float = 1e-5  # the BatchNorms inside the blocks (bn1..bn3)
    shortcut_bn_eps: float = 1e-5  # downsample.1

    @property
    def same_padding(self) -> bool:
        return self.stem_conv_same or self.max_pool_same or self.stride2_conv_same


def variant_of(semantics: str, model_name: str) -> Variant:
    """The Variant of semantics for model_name's block kind (ValueError for an unknown semantics)."""
    if semantics not in SEMANTICS:
        raise ValueError(f"unknown semantics {semantics!r}; choose one of {', '.join(SEMANTICS)}")
    if semantics == MINDCV:
        return Variant(max_pool_same=True)
    if semantics == MODELS_ZOO:
        if has_basic_blocks(model_name):  # res_base=True: _bn(64, res_base) and the shortcut's _bn(c, res_base)
            return Variant(block_bn_eps=1e-4)
        return Variant(stem_conv_same=True, max_pool_same=True, stride2_conv_same=True, stem_bn_eps=1e-4,
                       block_bn_eps=1e-4, shortcut_bn_eps=1e-4)
    return Variant()
