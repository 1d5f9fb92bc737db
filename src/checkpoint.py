"""Checkpoint files: atomic, CRC-checked writes; reads that fail in one clear line; weight loading that
checks the architecture and class count before touching the network."""
import os
import re
import shutil
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import mindspore as ms
from mindspore import nn

from src.errors import UserError
from src.resnet import ARCHITECTURES, Bottleneck

PARTIAL_DIR = ".partial"  # half-written files live here, never under their final name


def save_checkpoint_atomic(source: Any, path: str, append_dict: Optional[Dict[str, Any]] = None) -> Path:
    """Saves source (a Cell or a list of {'name', 'data'}) to path via a temporary file and one rename.

    The file carries a CRC so that damage is detected on load.
    """
    final = Path(path)
    staging_dir = final.parent / PARTIAL_DIR
    staging_dir.mkdir(parents=True, exist_ok=True)
    staging = staging_dir / final.name
    staging.unlink(missing_ok=True)
    ms.save_checkpoint(source, str(staging), append_dict=append_dict, crc_check=True)
    os.replace(staging, final)
    return final


def link_or_copy_atomic(source: Path, destination: Path) -> None:
    """Makes destination a copy of source (a hard link where possible), replacing it in one rename."""
    staging = destination.parent / PARTIAL_DIR / destination.name
    staging.parent.mkdir(parents=True, exist_ok=True)
    staging.unlink(missing_ok=True)
    try:
        os.link(source, staging)
    except OSError:
        shutil.copyfile(source, staging)
    os.replace(staging, destination)
    # Renaming a hard link onto another link of the same file is a no-op that leaves the staging name.
    staging.unlink(missing_ok=True)


def read_checkpoint(path: str) -> Dict[str, Any]:
    """All entries of a MindSpore checkpoint (Parameters and appended values). Raises UserError."""
    file = Path(path)
    if not path:
        raise UserError("no checkpoint given: pass --checkpoint_path FILE.ckpt")
    if not file.is_file():
        raise UserError(f"checkpoint {file} does not exist")
    if file.stat().st_size == 0:
        raise UserError(f"checkpoint {file} is empty (0 bytes): the write was interrupted; use another checkpoint")
    try:
        entries = ms.load_checkpoint(str(file), crc_check=True)
    except (ValueError, RuntimeError, TypeError):
        raise UserError(f"checkpoint {file} is damaged or not a MindSpore checkpoint (it does not parse or its CRC "
                        "does not match); use another copy or a .ckpt written by train.py") from None
    if not entries:
        raise UserError(f"checkpoint {file} holds no parameters; use a .ckpt written by train.py")
    return entries


def describe_weights(entries: Dict[str, Any]) -> Tuple[Optional[str], Optional[int]]:
    """(architecture, class count) a set of ResNet weights belongs to, as far as the names tell."""
    blocks: Dict[int, int] = {}
    bottleneck = False
    for name in entries:
        match = re.match(r"layer([1-4])\.(\d+)\.(conv\d)\.weight$", name)
        if match:
            layer, index = int(match.group(1)), int(match.group(2))
            blocks[layer] = max(blocks.get(layer, 0), index + 1)
            bottleneck = bottleneck or match.group(3) == "conv3"
    architecture = None
    for model_name, (block, layers) in ARCHITECTURES.items():
        if [blocks.get(i, 0) for i in range(1, 5)] == layers and (block is Bottleneck) == bottleneck:
            architecture = model_name
    fc = entries.get("fc.weight")
    class_num = int(fc.shape[0]) if fc is not None and len(fc.shape) == 2 else None
    return architecture, class_num


def network_weights(entries: Dict[str, Any], net: nn.Cell, path: str, model_name: str) -> Dict[str, Any]:
    """The entries that are net's parameters, after checking the checkpoint fits net (else UserError).

    Optimizer moments and other training state in the file are ignored.
    """
    wanted = {param.name: param for param in net.get_parameters()}
    missing = [name for name in wanted if name not in entries]
    mismatched = [f"{name} {tuple(entries[name].shape)} vs {tuple(param.shape)}" for name, param in wanted.items()
                  if name in entries and tuple(entries[name].shape) != tuple(param.shape)]
    if missing or mismatched:
        found_arch, found_classes = describe_weights(entries)
        expected_classes = int(wanted["fc.weight"].shape[0]) if "fc.weight" in wanted else None
        if found_arch and found_arch != model_name:
            raise UserError(f"checkpoint {path} holds {found_arch} weights, not {model_name}: "
                            f"pass --model_name {found_arch} or another checkpoint")
        if found_classes is not None and found_classes != expected_classes:
            raise UserError(f"checkpoint {path} has a {found_classes}-class head, the network {expected_classes} "
                            f"classes: pass --class_num {found_classes} or another checkpoint")
        detail = _list_some(missing, "missing") + _list_some(mismatched, "shape mismatch")
        raise UserError(f"checkpoint {path} does not fit {model_name}: {'; '.join(detail)}")
    return {name: entries[name] for name in wanted}


def _list_some(items: List[str], label: str, limit: int = 3) -> List[str]:
    if not items:
        return []
    more = f" (+{len(items) - limit} more)" if len(items) > limit else ""
    return [f"{len(items)} {label}: {', '.join(items[:limit])}{more}"]


def load_weights(net: nn.Cell, path: str, model_name: str) -> Dict[str, Any]:
    """Loads a checkpoint's network weights into net; returns all of the file's entries."""
    entries = read_checkpoint(path)
    weights = network_weights(entries, net, path, model_name)
    ms.load_param_into_net(net, weights, strict_load=True)
    return entries
