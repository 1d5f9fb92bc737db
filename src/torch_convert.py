"""PyTorch/torchvision ResNet state_dicts <-> this project's MindSpore parameter names.

The networks share module names, so only BatchNorm fields are renamed:
weight->gamma, bias->beta, running_mean->moving_mean, running_var->moving_variance
(torch's num_batches_tracked has no MindSpore counterpart and is dropped).
"""
import re
from pathlib import Path
from typing import Dict, Mapping, Optional

import numpy as np

from src.errors import UserError

TORCH_TO_MS_BN = {"weight": "gamma", "bias": "beta", "running_mean": "moving_mean", "running_var": "moving_variance"}
MS_TO_TORCH_BN = {value: key for key, value in TORCH_TO_MS_BN.items()}
# BatchNorm modules in torchvision's ResNet: bn1/bn2/bn3 and the second cell of a downsample branch.
_BN_MODULE = re.compile(r"(^|\.)(bn\d+|downsample\.1)$")
WRAPPER_KEYS = ("state_dict", "model", "model_state_dict", "net")


def is_batchnorm_module(module: str) -> bool:
    return bool(_BN_MODULE.search(module))


def torch_to_mindspore_name(name: str) -> Optional[str]:
    """MindSpore name of a torch state_dict key; None for entries MindSpore has no place for."""
    module, _, field = name.rpartition(".")
    if not is_batchnorm_module(module):
        return name
    if field == "num_batches_tracked":
        return None
    return f"{module}.{TORCH_TO_MS_BN[field]}" if field in TORCH_TO_MS_BN else name


def mindspore_to_torch_name(name: str) -> str:
    module, _, field = name.rpartition(".")
    if is_batchnorm_module(module) and field in MS_TO_TORCH_BN:
        return f"{module}.{MS_TO_TORCH_BN[field]}"
    return name


def unwrap_state_dict(loaded: object, path: str) -> Dict[str, np.ndarray]:
    """The tensors of a loaded .pth: a bare state_dict or one wrapped in {'state_dict': ...} / {'model': ...},
    with DataParallel/DDP 'module.' prefixes removed. Raises UserError for anything else."""
    state = loaded
    for _ in range(2):  # e.g. {'model': {'state_dict': ...}}
        if isinstance(state, Mapping):
            inner = next((state[key] for key in WRAPPER_KEYS if isinstance(state.get(key), Mapping)), None)
            if inner is not None:
                state = inner
    if not isinstance(state, Mapping) or not state:
        raise UserError(f"{path} holds no state_dict (a mapping of parameter names to tensors)")
    arrays: Dict[str, np.ndarray] = {}
    for key, value in state.items():
        if not hasattr(value, "detach"):
            continue  # e.g. an epoch number or optimizer settings next to the weights
        name = key[len("module."):] if key.startswith("module.") else key
        arrays[name] = value.detach().cpu().numpy()
    if not arrays:
        raise UserError(f"{path} holds no tensors")
    return arrays


def read_torch_state_dict(path: str) -> Dict[str, np.ndarray]:
    """Reads a PyTorch .pth with torch.load(weights_only=True): nothing in the file is executed.

    Raises UserError for a missing file, a file that needs arbitrary unpickling, or a damaged one.
    """
    try:
        import torch
    except ImportError:
        raise UserError(f"reading {path} needs PyTorch: pip install torch (requirements-dev.txt)") from None
    if not Path(path).is_file():
        raise UserError(f"PyTorch checkpoint {path} does not exist")
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises UnpicklingError, RuntimeError, EOFError, ... for bad files
        text = " ".join(str(exc).split())
        if "weights_only" in text or "Unsupported global" in text:
            raise UserError(f"{path} needs arbitrary code to unpickle (it stores Python objects, not just tensors) "
                            "and was not loaded; re-save it with torch.save(model.state_dict(), path)") from None
        raise UserError(f"{path} is damaged or not a PyTorch checkpoint ({type(exc).__name__}); use another "
                        "copy") from None
    return unwrap_state_dict(loaded, path)


def torch_state_dict_to_mindspore(state: Mapping[str, np.ndarray]) -> Dict[str, np.ndarray]:
    """Renames a torchvision ResNet state_dict to this project's MindSpore names (num_batches_tracked dropped)."""
    converted = {}
    for name, value in state.items():
        ms_name = torch_to_mindspore_name(name)
        if ms_name is not None:
            converted[ms_name] = np.asarray(value)
    return converted


def mindspore_to_torch_state_dict(params: Mapping[str, np.ndarray]) -> Dict[str, np.ndarray]:
    """The reverse: names torchvision's load_state_dict(strict=True) accepts, with num_batches_tracked
    (zero) added for every BatchNorm."""
    state: Dict[str, np.ndarray] = {}
    for name, value in params.items():
        state[mindspore_to_torch_name(name)] = np.asarray(value)
        module, _, field = name.rpartition(".")
        if is_batchnorm_module(module) and field == "moving_variance":
            state[f"{module}.num_batches_tracked"] = np.zeros((), np.int64)
    return state
