"""The one weight-loading path: this project's .ckpt, a PyTorch/torchvision .pth, a MindSpore models-zoo or a
mindcv ResNet checkpoint into a network, after checking the architecture and class count before touching it.
"""
import logging
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import mindspore as ms
from mindspore import nn

from src.architectures import TORCH as TORCH_SEMANTICS, has_basic_blocks
from src.ema import ema_entries_as_weights
from src.errors import UserError
from src.weights.files import check_file_given, is_torch_file, load_torch_state_dict, read_checkpoint, verify_sha256
from src.weights.names import (FORMAT_TITLES, HOME_SEMANTICS, OURS, TORCH, ZOO, NameMatch, conv1_weight,
                               describe_weights, detect_format, known_differences, match_names, stem_of_weights,
                               zoo_bn_eps)


def network_weights(entries: Dict[str, Any], net: nn.Cell, path: str, model_name: str,
                    skip: Sequence[str] = ()) -> Dict[str, Any]:
    """The entries that are net's parameters (by this project's names), after checking the checkpoint fits net
    (else UserError). Parameters named in skip are neither required nor returned.

    Optimizer moments and other training state in the file are ignored.
    """
    wanted = {param.name: param for param in net.get_parameters() if param.name not in skip}
    found_arch, found_classes = describe_weights(entries)
    if found_arch and found_arch != model_name:  # even when every wanted name is there (resnet34 -> resnet18)
        raise UserError(f"checkpoint {path} holds {found_arch} weights, not {model_name}: "
                        f"pass --model_name {found_arch} or another checkpoint")
    found_stem = stem_of_weights(entries)
    net_stem = stem_of_weights(wanted)
    if found_stem and net_stem and found_stem != net_stem:
        raise UserError(f"checkpoint {path} holds {found_stem}-stem weights (conv1.weight "
                        f"{_shape_text(conv1_weight(entries))}), the network has the {net_stem} stem: "
                        f"pass --stem {found_stem} or another checkpoint")
    missing = [name for name in wanted if name not in entries]
    mismatched = [f"{name} {tuple(entries[name].shape)} vs {tuple(param.shape)}" for name, param in wanted.items()
                  if name in entries and tuple(entries[name].shape) != tuple(param.shape)]
    if missing or mismatched:
        expected_classes = int(wanted["fc.weight"].shape[0]) if "fc.weight" in wanted else None
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


# ------------------------------------------------------------------------------------------- recorded settings

# Config keys train.py records in its checkpoints (src/training_checkpoints.py) that eval.py, export.py and
# predict.py take from the checkpoint when the user did not set them.
RECORDED_KEYS = ("stem", "image_height", "image_width")


def _shape_text(value: Any) -> str:
    return "x".join(str(int(d)) for d in value.shape)


def _scalar(value: Any) -> Any:
    """A recorded entry's value: a string as it is, a one-element tensor as a Python int."""
    if isinstance(value, str):
        return value
    array = value.asnumpy() if hasattr(value, "asnumpy") else np.asarray(value)
    return int(array.reshape(-1)[0]) if array.size == 1 else None


def recorded_settings(entries: Dict[str, Any]) -> Dict[str, Tuple[Any, str]]:
    """key -> (value, how the checkpoint shows it) for the RECORDED_KEYS a checkpoint tells: the entries train.py
    writes, and for the stem, in any format, conv1.weight's shape (which wins over an entry: it is what the weights
    need)."""
    found: Dict[str, Tuple[Any, str]] = {}
    for key in RECORDED_KEYS:
        if key in entries:
            value = _scalar(entries[key])
            if value is not None:
                found[key] = (value, f"records {key} {value}")
    stem = stem_of_weights(entries)
    if stem is not None:
        found["stem"] = (stem, f"has the {stem} stem (conv1.weight {_shape_text(conv1_weight(entries))})")
    return found


def settings_from_checkpoint(config, entries: Dict[str, Any], path: str,
                             logger: Optional[logging.Logger] = None):
    """config with the RECORDED_KEYS the checkpoint tells (recorded_settings) where the user did not set them.

    A value the user set (command line or --config_path file) that differs from the checkpoint's is refused with
    one line (UserError) naming the key, the checkpoint's value and what to do.
    """
    changes = {}
    for key, (value, shown) in recorded_settings(entries).items():
        current = getattr(config, key)
        if current == value:
            continue
        if config.is_set(key):
            where = config.where_set(key)
            drop = f"drop --{key}" if where == "on the command line" else f"remove {key} from the file"
            raise UserError(f"{key} {current} (set {where}) contradicts checkpoint {path}, which {shown}: {drop} to "
                            f"use the checkpoint's {value}, or pass a checkpoint made with {key} {current}")
        changes[key] = value
    if changes:
        (logger or logging.getLogger(DEFAULT_LOGGER)).info(
            "settings from checkpoint %s: %s", path, ", ".join(f"{key} {value}" for key, value in changes.items()))
        config = config.replace(**changes)
    return config


# ------------------------------------------------------------------------------------------------------ semantics


def checkpoint_semantics(read: Tuple[Dict[str, Any], Optional[str]], path: str,
                         logger: Optional[logging.Logger] = None) -> str:
    """The semantics (src/architectures.py SEMANTICS) of the network that wrote a checkpoint, from its format
    (names.HOME_SEMANTICS): eval.py, export.py and predict.py build the network with it, so that a models-zoo or
    mindcv checkpoint gives its home network's outputs. read: what read_weight_file returned. Logs a foreign one."""
    entries, fmt = read
    fmt = fmt or detect_format(entries)
    semantics = HOME_SEMANTICS[fmt]
    if semantics != TORCH_SEMANTICS:
        (logger or logging.getLogger(DEFAULT_LOGGER)).info(
            "network: %s is a %s: building the network with %s semantics to reproduce its home network", path,
            FORMAT_TITLES[fmt], semantics)
    return semantics


# ------------------------------------------------------------------------------------------------------ loading

DEFAULT_LOGGER = "resnet"  # src.utils.get_logger's logger


@dataclass
class LoadReport:
    """What load_weights_report did."""
    path: str
    fmt: str  # src.weights.names.OURS, TORCH, ZOO or MINDCV
    entries: Dict[str, Any]  # every entry of the file as read (original names)
    match: NameMatch
    loaded: List[str] = field(default_factory=list)  # our parameter names set from the file
    new_head: bool = False  # fc kept freshly initialised (allow_new_head and the file's head did not fit)
    notes: List[str] = field(default_factory=list)  # known differences between the source network and ours


def read_weight_file(path: str, sha256: str = "") -> Tuple[Dict[str, Any], Optional[str]]:
    """(entries, TORCH for a PyTorch file else None) of a checkpoint in any accepted format; UserError otherwise."""
    file = check_file_given(path)
    if file.stat().st_size and is_torch_file(file):
        verify_sha256(file, sha256)
        return load_torch_state_dict(str(file)).arrays, TORCH
    return read_checkpoint(path, sha256), None


def _array(value: Any) -> np.ndarray:
    return value.asnumpy() if hasattr(value, "asnumpy") else np.asarray(value)


def _head_to_reinitialise(renamed: Dict[str, Any], params: Dict[str, ms.Parameter]) -> Tuple[str, ...]:
    """fc's parameter names when the file's head does not fit the network (another class count, or none)."""
    head = tuple(name for name in params if name.startswith("fc."))
    fits = all(name in renamed and tuple(renamed[name].shape) == tuple(params[name].shape) for name in head)
    return () if fits else head


def load_weights_report(net: nn.Cell, path: str, model_name: str, logger: Optional[logging.Logger] = None,
                        sha256: str = "", allow_new_head: bool = False, use_ema: bool = False,
                        read: Optional[Tuple[Dict[str, Any], Optional[str]]] = None) -> LoadReport:
    """Loads the network weights of a checkpoint in any accepted format into net and says what it did.

    Formats: this project's .ckpt, a PyTorch/torchvision .pth (converted in memory), a MindSpore models-zoo
    ResNet or a mindcv ResNet .ckpt (detected by their names). Training state (optimizer moments, EMA copies,
    counters) is set aside. The file must hold model_name and every parameter of net, with net's shapes, else
    UserError and net is untouched. allow_new_head: when the file's fc does not fit net (another class count),
    fc keeps its fresh initialisation instead (fine-tuning). sha256 pins the file (a digest or a prefix).
    use_ema: load a train.py checkpoint's EMA weights (ema.*, src/ema.py) instead of its raw ones when it has them.
    read: what read_weight_file(path, sha256) returned, when the caller has read the file already (to learn the
    settings it records first: settings_from_checkpoint); it is not read again.
    """
    logger = logger or logging.getLogger(DEFAULT_LOGGER)
    entries, fmt = read if read is not None else read_weight_file(path, sha256)
    if use_ema and fmt is None:
        with_ema = ema_entries_as_weights(entries)  # entries itself when the file has no EMA of its weights
        if with_ema is not entries:
            logger.info("weights: %s holds an EMA of its weights: using it (--use_ema false for the raw weights)",
                        path)
            entries = with_ema
    params = {param.name: param for param in net.get_parameters()}
    match = match_names(entries, params, fmt)
    state = set(match.training_state)
    renamed: Dict[str, Any] = {}
    for name, value in entries.items():
        ours = match.renamed(name) if name not in state else None
        if ours is not None and ours not in renamed and hasattr(value, "shape"):
            renamed[ours] = value
    skip = _head_to_reinitialise(renamed, params) if allow_new_head else ()
    weights = network_weights(renamed, net, path, model_name, skip=skip)

    basic_block = has_basic_blocks(model_name)
    arrays = {name: _array(value) for name, value in weights.items()}
    if match.fmt == ZOO:
        # A BatchNorm with a smaller eps than the zoo's (a network of torch semantics) gets moving_variance raised
        # by the difference, so that its inference matches; one of models_zoo semantics has the zoo's eps itself.
        cells = dict(net.cells_and_names())
        for name, value in arrays.items():
            eps = zoo_bn_eps(name, basic_block)
            cell = cells.get(name.rpartition(".")[0])
            if name.endswith(".moving_variance") and eps is not None and isinstance(cell, nn.BatchNorm2d) and \
                    eps > cell.eps:
                arrays[name] = value + np.asarray(eps - cell.eps, value.dtype)
    not_loaded, _ = ms.load_param_into_net(
        net, {name: ms.Parameter(ms.Tensor(value, dtype=params[name].dtype), name=name)
              for name, value in arrays.items()}, strict_load=True)
    not_loaded = [name for name in not_loaded if name not in skip]
    if not_loaded:  # network_weights checked every name, so this would be a bug, not a user error
        raise RuntimeError(f"load_param_into_net left {not_loaded[:3]} unloaded from {path}")

    report = LoadReport(path=str(path), fmt=match.fmt, entries=entries, match=match, loaded=sorted(arrays),
                        new_head=bool(skip),
                        notes=known_differences(match.fmt, basic_block,
                                                getattr(net, "semantics", TORCH_SEMANTICS)))
    _log_report(report, renamed, params, logger)
    return report


def _log_report(report: LoadReport, renamed: Dict[str, Any], params: Dict[str, ms.Parameter],
                logger: logging.Logger) -> None:
    match = report.match
    converted = "" if match.fmt == OURS else ", names converted in memory"
    logger.info("weights: %s is a %s%s; %d parameters loaded", report.path, FORMAT_TITLES[match.fmt], converted,
                len(report.loaded))
    if match.prefix:
        logger.info("weights: removed the wrapper prefix '%s' from the names", match.prefix)
    if match.training_state:
        logger.info("weights: set aside %d entries that are training state, not weights (optimizer state, "
                    "counters%s): %s",
                    len(match.training_state),
                    ", EMA copies: the raw weights were loaded" if any(n.startswith("ema.") for n in
                                                                        match.training_state) else "",
                    _some(match.training_state))
    if match.unmatched:
        logger.info("weights: %d entries of %s are not parameters of this network and were not loaded: %s",
                    len(match.unmatched), report.path, _some(match.unmatched))
    if report.new_head:
        fc = renamed.get("fc.weight")
        if fc is not None and len(fc.shape) == 2:
            found = f"has a {int(fc.shape[0])}-class head"
        else:
            found = "has no usable fc head"
        logger.info("head: %s %s, this run has %d classes: fc.weight and fc.bias were NOT loaded and keep their "
                    "fresh initialisation (re-initialised head)", report.path, found,
                    int(params["fc.weight"].shape[0]))
    for note in report.notes:
        logger.info("weights: note: %s", note)


def _some(names: List[str], limit: int = 4) -> str:
    more = f", ... (+{len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more
