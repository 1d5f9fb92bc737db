"""The one list of ResNet depths this project builds: name -> (block kind, blocks in layer1..layer4).

Plain data without MindSpore, so that the config's choices, convert_pth.py, benchmark.py (whose PyTorch and
numpy workers must stay free of MindSpore) and the weight-name inference read it without loading a framework;
src/resnet.py builds its networks from it.
"""
from typing import Dict, Tuple

BASIC, BOTTLENECK = "basic", "bottleneck"  # two 3x3 convolutions (ResNet-18/34); 1x1 -> 3x3 -> 1x1 (50/101/152)

ARCHITECTURES: Dict[str, Tuple[str, Tuple[int, int, int, int]]] = {
    "resnet18": (BASIC, (2, 2, 2, 2)),
    "resnet34": (BASIC, (3, 4, 6, 3)),
    "resnet50": (BOTTLENECK, (3, 4, 6, 3)),
    "resnet101": (BOTTLENECK, (3, 4, 23, 3)),
    "resnet152": (BOTTLENECK, (3, 8, 36, 3)),
}
MODEL_NAMES: Tuple[str, ...] = tuple(ARCHITECTURES)


def has_basic_blocks(model_name: str) -> bool:
    """Whether model_name is built from BasicBlocks (True for a name not in the list, like ResNet-18)."""
    return ARCHITECTURES.get(model_name, (BASIC,))[0] == BASIC
