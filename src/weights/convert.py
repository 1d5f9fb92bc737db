"""The checked conversion of whole files behind convert_pth.py: a PyTorch/torchvision ResNet .pth <-> this
project's .ckpt, and --verify against torchvision.

Every tensor must map onto a parameter of the architecture with the same shape, and every parameter must be
present; anything else is refused with the unmatched names before any file is written. torch's
num_batches_tracked has no MindSpore counterpart: the .ckpt keeps its values in one side entry so that
.pth -> .ckpt -> .pth gives the same tensors back. Outputs are written under a temporary name in the destination
folder and renamed into place, after the optional check against torchvision (--verify).

MindSpore, torch and torchvision are imported inside the functions that use them, so that convert_pth.py
refuses bad options without loading a framework.
"""
import json
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import numpy as np

from src.architectures import CIFAR, IMAGENET, MODEL_NAMES, stem_of_conv1
from src.errors import UserError
from src.weights.files import (TorchStateDict, load_torch_state_dict, read_checkpoint, save_checkpoint_atomic,
                               save_torch_state_dict_atomic)
from src.weights.names import (MS_TO_TORCH_BN, TORCH_TO_MS_BN, architecture_of, is_batchnorm_module,
                               mindspore_to_torch_name, torch_to_mindspore_name)

# torchvision's order of a BatchNorm's state_dict entries (MindSpore lists moving statistics first).
TORCH_BN_ORDER = ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")
# Top-level modules of the network: a .ckpt entry starting with anything else is training state
# (optimizer moments, global_step, epoch_num, ...), not a weight.
NETWORK_MODULES = frozenset({"conv1", "bn1", "layer1", "layer2", "layer3", "layer4", "fc"})
HEAD = ("fc.weight", "fc.bias")
# A .ckpt entry (a JSON string {BatchNorm module: count}) carrying torch's num_batches_tracked through a
# conversion. A string is a scalar, so the project's loaders set it aside as training state.
NUM_BATCHES_TRACKED_ENTRY = "torch_num_batches_tracked"
# --verify's default bound on max|logits_ms - logits_torch| / max|logits_torch|. Measured by the parity tests
# (docs/checkpoints.md, "Converting PyTorch weights"): float32 rounding gives at most 8e-7 at 224x224 and 2e-6
# at 64x64 for ResNet-18..152, while a mapping error moves the logits by 1e-2 or more (swapped BatchNorm fields
# 0.5-1.8, a flipped 3x3 kernel 2e-2) and even BatchNorm eps 1e-4 instead of 1e-5 by 5e-4. 1e-5 sits 5x above
# the noise and 50x below the smallest of these.
DEFAULT_TOLERANCE = 1e-5
LISTED_NAMES = 8  # unmatched names shown in the one-line error (all of them are in the exception's lists)


# ------------------------------------------------------------------------------------ checked conversion

@lru_cache(maxsize=None)
def expected_parameters(model_name: str, num_classes: int,
                        stem: str = IMAGENET) -> Tuple[Tuple[str, Tuple[int, ...]], ...]:
    """(MindSpore name, shape) of every parameter of build_resnet(model_name, num_classes, stem=stem), in network
    order."""
    from mindspore.nn.utils import no_init_parameters
    from src.resnet import build_resnet
    with no_init_parameters():  # names and shapes only: skip drawing 60M random numbers for resnet152
        net = build_resnet(model_name, num_classes, stem=stem)
    return tuple((param.name, tuple(int(d) for d in param.shape)) for param in net.get_parameters())


@dataclass
class Conversion:
    """A checked conversion: the weights to write, in the output's names and order."""
    model_name: str
    num_classes: int  # the head's class count (with --drop_head: the class count the new head is for)
    has_head: bool  # False: fc was left out (--drop_head)
    weights: Dict[str, np.ndarray]
    num_batches_tracked: Dict[str, int]  # BatchNorm module -> torch's counter
    notes: List[str] = field(default_factory=list)
    ignored: List[str] = field(default_factory=list)  # input entries set aside (training state)
    stem: str = IMAGENET  # src/architectures.py STEMS: what conv1.weight's shape shows


def _some(names: List[str], limit: int = LISTED_NAMES) -> str:
    more = f" (+{len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


class MismatchError(UserError):
    """The file does not fit the architecture; unexpected/missing/mismatched hold every offending name."""

    def __init__(self, message: str, unexpected: List[str], missing: List[str], mismatched: List[str]) -> None:
        super().__init__(message)
        self.unexpected, self.missing, self.mismatched = unexpected, missing, mismatched


def _stem_of(shapes: Mapping[str, Tuple[int, ...]]) -> str:
    """The stem conv1.weight's shape shows: cifar for a 3x3 kernel, else imagenet (torchvision's 7x7; any other
    shape is then listed as a mismatch against it)."""
    conv1 = shapes.get("conv1.weight")
    return CIFAR if conv1 is not None and stem_of_conv1(conv1) == CIFAR else IMAGENET


def _classes_of(shapes: Mapping[str, Tuple[int, ...]]) -> Optional[int]:
    fc = shapes.get("fc.weight")
    return int(fc[0]) if fc is not None and len(fc) == 2 else None


def _pick_architecture(ms_shapes: Mapping[str, Tuple[int, ...]], path: str, model_name: Optional[str],
                       how_to_name: str) -> Tuple[str, str]:
    """(architecture, how to name it in messages): model_name if given and consistent with the names, else the
    architecture the block counts show, else the closest one by shared names."""
    found = architecture_of(ms_shapes)
    if model_name is not None:
        if model_name not in MODEL_NAMES:
            raise UserError(f"unknown model_name {model_name!r}: choose one of {', '.join(MODEL_NAMES)}")
        if found is not None and found != model_name:
            raise UserError(f"{path} holds {found} weights, not {model_name}: pass {how_to_name} {found} or "
                            "leave it out to take the file's architecture")
        return model_name, model_name
    if found is not None:
        return found, found
    # No architecture fits the block counts: compare against the closest one so the error lists what differs.
    overlap = {name: len(set(ms_shapes) & {n for n, _ in expected_parameters(name, 10)}) for name in MODEL_NAMES}
    best = max(MODEL_NAMES, key=lambda name: overlap[name])
    if overlap[best] == 0:
        raise UserError(f"{path} is not a ResNet state_dict with torchvision's names (it holds "
                        f"{_some(sorted(ms_shapes), 4)}); convert a torchvision-style ResNet-18..152")
    return best, f"{best} (the closest architecture; --model_name picks another)"


def check_names_and_shapes(have: Mapping[str, Tuple[int, ...]], want: Mapping[str, Tuple[int, ...]], path: str,
                           model_name: str, show: Callable[[str], str] = lambda name: name) -> None:
    """Raises MismatchError listing every name of have not in want, of want not in have, and every shape that
    differs; show() turns a name into the one the user knows (torch names for a .pth)."""
    unexpected = [show(name) for name in have if name not in want]
    missing = [show(name) for name in want if name not in have]
    mismatched = [f"{show(name)} {tuple(have[name])} vs {tuple(shape)}" for name, shape in want.items()
                  if name in have and tuple(have[name]) != tuple(shape)]
    if not (unexpected or missing or mismatched):
        return
    parts = []
    if unexpected:
        parts.append(f"{len(unexpected)} in the file but not in {model_name}: {_some(unexpected)}")
    if missing:
        parts.append(f"{len(missing)} of {model_name} missing from the file: {_some(missing)}")
    if mismatched:
        parts.append(f"{len(mismatched)} with another shape (file vs {model_name}): {_some(mismatched)}")
    raise MismatchError(f"{path} does not fit {model_name}, nothing was written: {'; '.join(parts)}",
                        unexpected, missing, mismatched)


def torch_to_mindspore_weights(state: TorchStateDict, path: str, model_name: Optional[str] = None,
                               num_classes: Optional[int] = None, drop_head: bool = False) -> Conversion:
    """Maps a torch state_dict onto build_resnet(model_name, num_classes) by name, checking every shape.

    model_name and num_classes are taken from the file when None. drop_head leaves fc out (fine-tuning to
    another class count); without it a num_classes that disagrees with the file's fc is refused.
    """
    arrays = state.arrays
    counters = {name.rpartition(".")[0]: int(np.asarray(value).reshape(-1)[0]) if np.asarray(value).size else 0
                for name, value in arrays.items()
                if name.endswith(".num_batches_tracked") and is_batchnorm_module(name.rpartition(".")[0])}
    renamed: Dict[str, np.ndarray] = {}
    torch_name: Dict[str, str] = {}
    for name, value in arrays.items():
        ms_name = torch_to_mindspore_name(name)
        if ms_name is None:
            continue
        if ms_name in renamed:  # e.g. bn1.weight next to bn1.gamma: keeping either would hide the other
            raise UserError(f"{path} holds both {torch_name[ms_name]} and {name}, which are the same parameter "
                            f"({ms_name}); save the state_dict of one model")
        renamed[ms_name], torch_name[ms_name] = value, name
    shapes = {name: tuple(value.shape) for name, value in renamed.items()}
    model_name, label = _pick_architecture(shapes, path, model_name, "--model_name")
    file_classes = _classes_of(shapes)
    notes = list(state.notes)
    if not drop_head and not any(name in shapes for name in HEAD):
        raise UserError(f"{path} has no fc head (fc.weight, fc.bias): pass --drop_head to convert the backbone only")
    if drop_head:
        for name in HEAD:
            if renamed.pop(name, None) is not None:
                shapes.pop(name)
        notes.append("left fc.weight and fc.bias out (--drop_head): the network's head starts freshly "
                     "initialised when these weights are loaded for fine-tuning" +
                     (f" (the file's head had {file_classes} classes)" if file_classes else ""))
        classes = num_classes or file_classes or 1000
    else:
        if num_classes is not None and file_classes is not None and num_classes != file_classes:
            raise UserError(f"{path} has a {file_classes}-class head (fc.weight {shapes['fc.weight']}), "
                            f"--num_classes is {num_classes}: pass --drop_head to leave the head out for "
                            f"fine-tuning, or --num_classes {file_classes}")
        classes = num_classes or file_classes or 1000
    stem = _stem_of(shapes)
    want = dict(expected_parameters(model_name, classes, stem))
    if drop_head:
        for name in HEAD:
            want.pop(name)
    check_names_and_shapes(shapes, want, path, label,
                           show=lambda name: torch_name.get(name, mindspore_to_torch_name(name)))
    weights = {}
    cast = set()
    for name in want:  # network order
        value = renamed[name]
        if value.dtype != np.float32:  # the network is float32; fp16/bf16 widen exactly, float64 is rounded
            cast.add(str(value.dtype))
            value = value.astype(np.float32)
        weights[name] = value
    if cast:
        notes.append(f"converted {', '.join(sorted(cast))} tensors to float32 (the network's type)")
    if stem == CIFAR:
        notes.append("conv1.weight is 3x3: the cifar stem (3x3 stride-1 conv1, no max pool); load it with --stem cifar "
                     "(eval.py, export.py and predict.py see it from the weights)")
    return Conversion(model_name, classes, not drop_head, weights, counters, notes, stem=stem)


def mindspore_to_torch_weights(entries: Mapping[str, Any], path: str, model_name: Optional[str] = None,
                               num_classes: Optional[int] = None) -> Conversion:
    """Maps a MindSpore checkpoint's network weights onto torchvision's state_dict names and order.

    Training state next to the weights (optimizer moments, counters, resume fields) is set aside. Every
    parameter of the architecture must be present with its shape; num_batches_tracked comes from the entry
    a .pth conversion left, else 0.
    """
    network, ignored = {}, []
    for name, value in entries.items():
        if name.split(".")[0] in NETWORK_MODULES and hasattr(value, "shape"):
            network[name] = value
        elif name != NUM_BATCHES_TRACKED_ENTRY:
            ignored.append(name)
    shapes = {name: tuple(int(d) for d in value.shape) for name, value in network.items()}
    model_name, label = _pick_architecture(shapes, path, model_name, "--model_name")
    file_classes = _classes_of(shapes)
    if num_classes is not None and file_classes is not None and num_classes != file_classes:
        raise UserError(f"{path} has a {file_classes}-class head, --num_classes is {num_classes}: pass "
                        f"--num_classes {file_classes} or leave it out")
    if "fc.weight" not in shapes and "fc.bias" not in shapes:
        raise UserError(f"{path} has no fc head (converted with --drop_head?): torchvision's "
                        "load_state_dict(strict=True) needs one; convert a checkpoint with its head")
    classes = file_classes or num_classes or 1000
    stem = _stem_of(shapes)
    want = dict(expected_parameters(model_name, classes, stem))
    check_names_and_shapes(shapes, want, path, label)
    counters: Dict[str, int] = {}
    if NUM_BATCHES_TRACKED_ENTRY in entries:
        try:
            counters = {str(k): int(v) for k, v in json.loads(str(entries[NUM_BATCHES_TRACKED_ENTRY])).items()}
        except (ValueError, TypeError, AttributeError):
            raise UserError(f"{path}: entry {NUM_BATCHES_TRACKED_ENTRY} is not the JSON object a .pth conversion "
                            "writes; the file is damaged") from None
    arrays = {name: (value.asnumpy() if hasattr(value, "asnumpy") else np.asarray(value))
              for name, value in network.items()}
    weights: Dict[str, np.ndarray] = {}
    for name in want:  # network order; within a BatchNorm, torchvision's order
        module, _, field_name = name.rpartition(".")
        if not (is_batchnorm_module(module) and field_name in MS_TO_TORCH_BN):
            weights[name] = arrays[name]
            continue
        if f"{module}.weight" in weights:
            continue  # this BatchNorm is done
        for torch_field in TORCH_BN_ORDER:
            if torch_field == "num_batches_tracked":
                weights[f"{module}.num_batches_tracked"] = np.array(counters.get(module, 0), np.int64)
            else:
                weights[f"{module}.{torch_field}"] = arrays[f"{module}.{TORCH_TO_MS_BN[torch_field]}"]
    notes = []
    if ignored:
        notes.append(f"set aside {len(ignored)} entries that are training state, not weights: {_some(ignored, 4)}")
    if not counters:
        notes.append("num_batches_tracked set to 0 (torchvision's BatchNorm uses it only when momentum=None)")
    if stem == CIFAR:
        notes.append("conv1.weight is 3x3: the cifar stem; in torchvision build the model with conv1 = "
                     "nn.Conv2d(3, 64, 3, 1, 1, bias=False) and maxpool = nn.Identity() before load_state_dict")
    return Conversion(model_name, classes, True, weights, counters, notes, ignored, stem=stem)


# ------------------------------------------------------------------------------------------------ writing

def _write_ckpt(conversion: Conversion, path: Path, check: Optional[Callable[[Path], None]]) -> None:
    import mindspore as ms
    items = [{"name": name, "data": ms.Tensor(value)} for name, value in conversion.weights.items()]
    extra = {NUM_BATCHES_TRACKED_ENTRY: json.dumps(conversion.num_batches_tracked)} \
        if conversion.num_batches_tracked else None
    save_checkpoint_atomic(items, str(path), append_dict=extra, check=check)


def _check_output(source: str, target: str, option: str, suffix: Optional[str] = None) -> Path:
    """The output path, after refusing one that is the input, a folder, or (for .ckpt) lacks the suffix that
    MindSpore would otherwise append."""
    final = Path(target)
    if final.resolve() == Path(source).resolve():
        raise UserError(f"{option} {target} is the same file as the input; pick another output name")
    if final.is_dir():
        raise UserError(f"{option} {target} is a folder; give a file name")
    if suffix and final.suffix != suffix:
        raise UserError(f"{option} {target} must end in {suffix} (MindSpore would add it and write another name)")
    return final


def _written(path: Path, write: Callable[[], None]) -> None:
    """Runs write() (the atomic write, the check before its rename included), turning a failure of the file
    system (permissions, full disk) into one line."""
    try:
        write()
    except OSError as exc:
        raise UserError(f"cannot write {path}: {exc.strerror or exc}; check the folder and free space") from None


# Callable run on the written-but-not-yet-renamed output: (pth path, ckpt path, conversion) -> None.
# It raises to stop the output from getting its final name.
Check = Callable[[str, str, Conversion], None]


def convert_pth_to_ckpt(pth_path: str, ckpt_path: str, model_name: Optional[str] = None,
                        num_classes: Optional[int] = None, drop_head: bool = False,
                        check: Optional[Check] = None) -> Conversion:
    """Converts a torchvision-style ResNet .pth to this project's .ckpt (CRC-checked, written atomically).

    check (e.g. verify_against_torchvision) runs on the written file before it gets its final name.
    """
    final = _check_output(pth_path, ckpt_path, "--ckpt_path", ".ckpt")
    state = load_torch_state_dict(pth_path)
    conversion = torch_to_mindspore_weights(state, pth_path, model_name, num_classes, drop_head)
    checked = None if check is None else (lambda written: check(pth_path, str(written), conversion))
    _written(final, lambda: _write_ckpt(conversion, final, checked))
    return conversion


def convert_ckpt_to_pth(ckpt_path: str, pth_path: str, model_name: Optional[str] = None,
                        num_classes: Optional[int] = None, check: Optional[Check] = None) -> Conversion:
    """Converts this project's .ckpt (also one written by train.py) to a .pth that torchvision's
    load_state_dict(strict=True) accepts, written atomically; check runs before the final rename."""
    final = _check_output(ckpt_path, pth_path, "--pth_path")
    try:
        import torch  # noqa: F401
    except ImportError:
        raise UserError(f"writing {pth_path} needs PyTorch: pip install torch (requirements-dev.txt)") from None
    entries = read_checkpoint(ckpt_path)
    conversion = mindspore_to_torch_weights(entries, ckpt_path, model_name, num_classes)
    checked = None if check is None else (lambda written: check(str(written), ckpt_path, conversion))
    _written(final, lambda: save_torch_state_dict_atomic(conversion.weights, str(final), checked))
    return conversion


# ------------------------------------------------------------------------------------------------ --verify

@dataclass
class Comparison:
    """Eval-mode logits of torchvision's network with the .pth and of ours with the .ckpt, on one batch."""
    max_abs: float
    max_rel: float  # max_abs / max|torch logits|
    scale: float  # max|torch logits|
    tolerance: float
    batch_size: int
    image_size: int

    @property
    def ok(self) -> bool:
        return self.max_rel <= self.tolerance

    def describe(self) -> str:
        return (f"max abs logit difference {self.max_abs:.3g}, max relative {self.max_rel:.3g} (of max |logit| "
                f"{self.scale:.3g}; tolerance {self.tolerance:g}) on a random batch of {self.batch_size} at "
                f"{self.image_size}x{self.image_size}")


class VerificationFailed(Exception):
    """--verify measured a difference above the tolerance (not a UserError: the script exits with 1)."""

    def __init__(self, comparison: Comparison) -> None:
        super().__init__(comparison.describe())
        self.comparison = comparison


def torchvision_available() -> bool:
    try:
        import torchvision  # noqa: F401
    except Exception:  # noqa: BLE001 - ImportError, or a torchvision built for another torch failing at import
        return False
    return True


# --verify's default input size per stem: the imagenet stem's usual 224, the cifar stem's 32 (CIFAR's images; at 224
# it would compute 49 times as much).
VERIFY_IMAGE_SIZE = {IMAGENET: 224, CIFAR: 32}


def torchvision_resnet(model_name: str, num_classes: int, stem: str = IMAGENET):
    """torchvision's network of model_name (random weights); for the cifar stem with conv1 = nn.Conv2d(3, 64, 3, 1,
    1, bias=False) and maxpool = nn.Identity(), the network src/resnet.py builds with stem="cifar"."""
    import torch
    import torchvision
    net = getattr(torchvision.models, model_name)(num_classes=num_classes)
    if stem == CIFAR:
        net.conv1 = torch.nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
        net.maxpool = torch.nn.Identity()
    return net


def compare_with_torchvision(pth_path: str, ckpt_path: str, model_name: str, num_classes: int,
                             head_from_torch: bool = False, image_size: int = 224, batch_size: int = 2,
                             seed: int = 0, tolerance: float = DEFAULT_TOLERANCE, stem: str = IMAGENET) -> Comparison:
    """Loads pth_path into torchvision's network and ckpt_path into ours and compares eval-mode logits.

    head_from_torch: the .ckpt has no fc (--drop_head); both networks then use torchvision's freshly
    initialised num_classes head, so the comparison covers every converted weight. stem: cifar builds both
    networks with the cifar stem (torchvision's with a 3x3 stride-1 conv1 and no max pool: torchvision_resnet).
    """
    import torch
    import mindspore as ms
    from mindspore.nn.utils import no_init_parameters
    from src.resnet import build_resnet
    from src.utils import apply_cpu_speed_setting
    apply_cpu_speed_setting()  # before MindSpore's first convolution (oneDNN reads it once)

    torch.manual_seed(seed)
    tv_net = torchvision_resnet(model_name, num_classes, stem)
    state = {name: torch.from_numpy(np.array(value)) for name, value in load_torch_state_dict(pth_path).arrays.items()}
    for module, bn in tv_net.named_modules():  # older files have no num_batches_tracked; it has no effect here
        if isinstance(bn, torch.nn.BatchNorm2d):
            state.setdefault(f"{module}.num_batches_tracked", torch.zeros((), dtype=torch.long))
    if head_from_torch:
        state = {name: value for name, value in state.items() if name not in HEAD}
        result = tv_net.load_state_dict(state, strict=False)
        if set(result.missing_keys) - set(HEAD) or result.unexpected_keys:
            raise UserError(f"{pth_path} does not fit torchvision's {model_name} ({stem} stem): {result}")
    else:
        tv_net.load_state_dict(state, strict=True)
    tv_net.eval()

    entries = read_checkpoint(ckpt_path)
    with no_init_parameters():  # every parameter is set below
        net = build_resnet(model_name, num_classes, stem=stem)
    params = {}
    for param in net.get_parameters():
        if head_from_torch and param.name in HEAD:
            value = getattr(tv_net.fc, param.name.split(".")[1]).detach().numpy()
        else:
            value = entries[param.name]
            value = value.asnumpy() if hasattr(value, "asnumpy") else np.asarray(value)
        params[param.name] = ms.Parameter(ms.Tensor(value), name=param.name)
    not_loaded, _ = ms.load_param_into_net(net, params, strict_load=True)
    if not_loaded:
        raise RuntimeError(f"parameters not loaded from {ckpt_path}: {not_loaded[:4]}")
    net.set_train(False)

    images = np.random.default_rng(seed).standard_normal((batch_size, 3, image_size, image_size)).astype(np.float32)
    with torch.no_grad():
        expected = tv_net(torch.from_numpy(images)).numpy().astype(np.float64)
    actual = net(ms.Tensor(images)).asnumpy().astype(np.float64)
    max_abs = float(np.abs(actual - expected).max())
    scale = float(np.abs(expected).max())
    return Comparison(max_abs, max_abs / max(scale, 1e-30), scale, tolerance, batch_size, image_size)


def verify_against_torchvision(tolerance: float = DEFAULT_TOLERANCE, image_size: Optional[int] = None,
                               batch_size: int = 2, report: Optional[Callable[[Comparison], None]] = None) -> Check:
    """A check for convert_*: compare_with_torchvision on the new file, with the stem its conv1 shows; raises
    VerificationFailed above tolerance (the output then keeps no final name). report gets the comparison either
    way. image_size None: VERIFY_IMAGE_SIZE of the stem."""
    def check(pth_path: str, ckpt_path: str, conversion: Conversion) -> None:
        comparison = compare_with_torchvision(
            pth_path, ckpt_path, conversion.model_name, conversion.num_classes,
            head_from_torch=not conversion.has_head, image_size=image_size or VERIFY_IMAGE_SIZE[conversion.stem],
            batch_size=batch_size, tolerance=tolerance, stem=conversion.stem)
        if report is not None:
            report(comparison)
        if not comparison.ok:
            raise VerificationFailed(comparison)
    return check
