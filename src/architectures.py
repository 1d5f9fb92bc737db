"""The one list of ResNet depths this project builds: name -> (block kind, blocks in layer1..layer4).

Plain data without MindSpore, so that the config's choices, convert_pth.py, benchmark.py (whose PyTorch and
numpy workers must stay free of MindSpore) and the weight-name inference read it without loading a framework;
src/resnet.py builds its networks from it.
"""
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
