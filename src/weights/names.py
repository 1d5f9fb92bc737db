"""Weight names: this project's parameter names (torchvision's module names with MindSpore's BatchNorm fields),
the foreign ResNet naming schemes mapped onto them, and what architecture a set of names shows. Pure name
handling: no file is read, no network is built and MindSpore is not imported here.

Schemes (each read from the network code that writes the checkpoints):
- ours:   this project (src/resnet.py): conv1, bn1, layerN.I.{conv,bn}K, layerN.I.downsample.{0,1}, fc.
- torch:  a PyTorch/torchvision state_dict: the same module names, BatchNorm fields weight/bias/running_mean/
          running_var (+ num_batches_tracked); renamed by torch_to_mindspore_name.
- zoo:    the MindSpore models zoo, official/cv/ResNet/src/resnet.py: the head is `end_point`, the shortcut
          branch `down_sample_layer`, and the BasicBlock (ResNet-18/34) BatchNorms `bn1d`/`bn2d`.
- mindcv: mindcv/models/resnet.py: the head is `classifier`, the shortcut branch `down_sample`.

Everything else is named alike in all four (conv1, bn1, layer1..layer4, conv1..conv3, bn1..bn3, and MindSpore's
gamma/beta/moving_mean/moving_variance in the three MindSpore schemes).

Training state written next to the weights (optimizer moments, EMA copies, step counters, learning rates, loss
scale, this project's resume fields) is recognised and set aside: see is_training_state.
"""
import re
from dataclasses import dataclass, field
from typing import Any, Collection, Dict, Iterable, List, Mapping, Optional, Tuple

from src.architectures import ARCHITECTURES, BOTTLENECK, MINDCV as MINDCV_SEMANTICS, MODELS_ZOO, TORCH as \
    TORCH_SEMANTICS, stem_of_conv1

# ------------------------------------------------------------------------------------ torch <-> MindSpore

# The networks share module names, so only BatchNorm fields are renamed (torch's num_batches_tracked has no
# MindSpore counterpart).
TORCH_TO_MS_BN = {"weight": "gamma", "bias": "beta", "running_mean": "moving_mean", "running_var": "moving_variance"}
MS_TO_TORCH_BN = {value: key for key, value in TORCH_TO_MS_BN.items()}
# BatchNorm modules in torchvision's ResNet: bn1/bn2/bn3 and the second cell of a downsample branch.
_BN_MODULE = re.compile(r"(^|\.)(bn\d+|downsample\.1)$")


def is_batchnorm_module(module: str) -> bool:
    return bool(_BN_MODULE.search(module))


def torch_to_mindspore_name(name: str) -> Optional[str]:
    """MindSpore name of a torch state_dict key; None for entries MindSpore has no place for."""
    module, _, field_name = name.rpartition(".")
    if not is_batchnorm_module(module):
        return name
    if field_name == "num_batches_tracked":
        return None
    return f"{module}.{TORCH_TO_MS_BN[field_name]}" if field_name in TORCH_TO_MS_BN else name


def mindspore_to_torch_name(name: str) -> str:
    module, _, field_name = name.rpartition(".")
    if is_batchnorm_module(module) and field_name in MS_TO_TORCH_BN:
        return f"{module}.{MS_TO_TORCH_BN[field_name]}"
    return name


# ------------------------------------------------------------------------------------------ naming schemes

OURS, TORCH, ZOO, MINDCV = "ours", "torch", "zoo", "mindcv"
FORMAT_TITLES = {
    OURS: "MindSpore checkpoint of this project",
    TORCH: "PyTorch/torchvision state_dict",
    ZOO: "MindSpore models-zoo ResNet checkpoint (official/cv/ResNet)",
    MINDCV: "mindcv ResNet checkpoint",
}

# The semantics (src/architectures.py SEMANTICS) of the network that writes each scheme: eval.py, export.py and
# predict.py build that network, so that a checkpoint gives its home zoo's outputs.
HOME_SEMANTICS = {OURS: TORCH_SEMANTICS, TORCH: TORCH_SEMANTICS, ZOO: MODELS_ZOO, MINDCV: MINDCV_SEMANTICS}

# Name components that differ from ours, per scheme (a component is a dot-separated part of a name).
_COMPONENT_RENAMES: Dict[str, Dict[str, str]] = {
    OURS: {},
    ZOO: {"end_point": "fc", "down_sample_layer": "downsample", "bn1d": "bn1", "bn2d": "bn2"},
    MINDCV: {"classifier": "fc", "down_sample": "downsample"},
}

# Scalars and schedules that trainers save next to the weights.
TRAINING_STATE_NAMES = frozenset({
    "global_step", "learning_rate", "momentum", "epoch_num", "step_num", "scale_sense", "loss_scale", "updates",
    "current_iterator_step", "last_overflow_iterator_step", "beta1_power", "beta2_power",
    # this project's resume fields and recorded settings (src/training_checkpoints.py)
    "step_in_epoch", "steps_per_epoch", "best_top1", "epoch_loss_sum", "model_name", "class_num",
    "stem", "image_height", "image_width",
})
# Prefixes of per-parameter optimizer / training copies: <prefix>.<parameter name>.
TRAINING_STATE_PREFIXES = frozenset({
    "moments", "moment1", "moment2", "adam_m", "adam_v", "accum", "vhat", "mean_grad", "mean_square", "ema",
    "grad_accumulation", "accu_grads",
})
# Prefixes a wrapper Cell without auto_prefix=False puts before every network parameter name.
_WRAPPER_PREFIX = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*\.)+$")


def to_our_name(name: str, fmt: str) -> Optional[str]:
    """The name a checkpoint entry of scheme fmt has in this project; None for entries with no place here
    (torch's num_batches_tracked)."""
    if fmt == TORCH:
        return torch_to_mindspore_name(name)
    renames = _COMPONENT_RENAMES[fmt]
    if not renames:
        return name
    return ".".join(renames.get(part, part) for part in name.split("."))


def detect_format(names: Iterable[str]) -> str:
    """The naming scheme of a set of MindSpore checkpoint names (ours when nothing foreign is seen)."""
    hits = {ZOO: 0, MINDCV: 0, TORCH: 0}
    for name in names:
        parts = set(name.split("."))
        if parts & set(_COMPONENT_RENAMES[ZOO]):
            hits[ZOO] += 1
        if parts & set(_COMPONENT_RENAMES[MINDCV]):
            hits[MINDCV] += 1
        if name.endswith((".running_mean", ".running_var", ".num_batches_tracked")):
            hits[TORCH] += 1
    best = max(hits, key=hits.get)
    return best if hits[best] else OURS


def find_wrapper_prefix(names: Collection[str]) -> str:
    """A prefix such as 'network.' that a wrapping Cell put before every network name ('' if none).

    Only when the file has no top-level conv1.weight, and only one candidate that is not training state.
    """
    if "conv1.weight" in names:
        return ""
    candidates = set()
    for name in names:
        if name.endswith(".conv1.weight") and not re.search(r"(^|\.)layer\d+\.", name):
            prefix = name[:-len("conv1.weight")]
            if _WRAPPER_PREFIX.match(prefix) and prefix.split(".")[0] not in TRAINING_STATE_PREFIXES:
                candidates.add(prefix)
    return candidates.pop() if len(candidates) == 1 else ""


def is_training_state(name: str, fmt: str, our_names: Collection[str],
                      network_modules: Optional[Collection[str]] = None) -> bool:
    """Whether a checkpoint entry is training state rather than a weight: a known scalar or schedule
    (global_step, learning_rate, epoch_num, ...), or a per-parameter copy <prefix>.<a parameter name>
    (optimizer moments, EMA weights, accumulated gradients). num_batches_tracked counts too."""
    if name in TRAINING_STATE_NAMES or name.endswith(".num_batches_tracked"):
        return True
    parts = name.split(".")
    if len(parts) < 2:
        return False
    if parts[0] in TRAINING_STATE_PREFIXES:
        return True
    # Another prefix: only if it is not a module of the network (layer4.2.conv1.weight is a weight of a deeper
    # network, not a copy of conv1.weight).
    if network_modules is None:
        network_modules = {our.split(".")[0] for our in our_names}
    if to_our_name(parts[0], fmt) in network_modules:
        return False
    for start in range(1, len(parts)):
        rest = to_our_name(".".join(parts[start:]), fmt)
        if rest is not None and rest in our_names:
            return True
    return False


def _size(value: Any) -> int:
    """Number of elements of a tensor or array (0 for a string or other non-tensor value)."""
    shape = getattr(value, "shape", None)
    if shape is None:
        return 0
    size = 1
    for dim in shape:
        size *= int(dim)
    return size


@dataclass
class NameMatch:
    """How the names of a checkpoint relate to a network's parameters."""
    fmt: str
    prefix: str = ""  # wrapper prefix removed from the names, if any
    mapping: Dict[str, str] = field(default_factory=dict)  # checkpoint name -> our parameter name
    training_state: List[str] = field(default_factory=list)  # set aside: optimizer moments, counters, ...
    unmatched: List[str] = field(default_factory=list)  # neither a parameter of the network nor training state
    missing: List[str] = field(default_factory=list)  # parameters of the network the checkpoint lacks

    def renamed(self, name: str) -> Optional[str]:
        """Our name for any checkpoint name (also one the network does not have)."""
        stripped = name[len(self.prefix):] if self.prefix and name.startswith(self.prefix) else name
        return to_our_name(stripped, self.fmt)


def match_names(names: Iterable[str], our_names: Collection[str], fmt: Optional[str] = None) -> NameMatch:
    """Maps checkpoint names onto our_names (a network's parameter names); fmt is detected when None.

    names may be a mapping name -> value: then values of at most one element (hyper-parameters and counters
    an optimizer saves, such as momentum) count as training state too.
    """
    scalars = set()
    if isinstance(names, Mapping):
        scalars = {name for name, value in names.items() if _size(value) <= 1}
    names = list(names)
    fmt = fmt or detect_format(names)
    match = NameMatch(fmt=fmt, prefix=find_wrapper_prefix(names) if fmt != TORCH else "")
    found = set()
    modules = {our.split(".")[0] for our in our_names}
    for name in names:
        ours = match.renamed(name)
        if ours is not None and ours in our_names and ours not in found:
            match.mapping[name] = ours
            found.add(ours)
        elif name in scalars or is_training_state(name, fmt, our_names, modules):
            match.training_state.append(name)
        else:
            match.unmatched.append(name)
    match.missing = [name for name in our_names if name not in found]
    return match


# ------------------------------------------------------------------------------------------ network differences

ZOO_BN_EPS = 1e-4  # models zoo _bn(): eps 1e-4, except its res_base BatchNorms (ResNet-18/34 stem and shortcut)


def zoo_bn_eps(our_name: str, basic_block: bool) -> Optional[float]:
    """The BatchNorm eps the models zoo's network used for the BN parameter our_name (None: not a BN).

    From official/cv/ResNet/src/resnet.py: _bn(channel) has eps 1e-4; _bn(channel, res_base=True) eps 1e-5. The
    ResNet-18/34 network (res_base=True) builds its stem bn1 and shortcut BN with res_base and its block bn1d/bn2d
    without; ResNet-50/101/152 build every BN without it.
    """
    module, _, fieldname = our_name.rpartition(".")
    if fieldname not in ("gamma", "beta", "moving_mean", "moving_variance"):
        return None
    if basic_block and (module == "bn1" or module.endswith("downsample.1")):
        return 1e-5
    return ZOO_BN_EPS


def known_differences(fmt: str, basic_block: bool, semantics: str = TORCH_SEMANTICS) -> List[str]:
    """One line per way the source network computes differently from a network of this semantics with the same
    weights, or, when the network has the file's home semantics, one line saying so."""
    if fmt in (ZOO, MINDCV) and semantics == HOME_SEMANTICS[fmt]:
        what = {ZOO: "the models zoo's", MINDCV: "mindcv's"}[fmt]
        how = ("its stem max pool pads 'same'" if fmt == MINDCV else
               "its block BatchNorms use eps 1e-4" if basic_block else
               "its stem conv, max pool and stride-2 3x3 convs pad 'same', its BatchNorms use eps 1e-4")
        return [f"the network is built with {semantics} semantics ({how}): it computes what {what} network "
                "computes with these weights"]
    if fmt == ZOO and basic_block:
        return ["the models zoo's ResNet-18/34 pads like this network (pad_mode 'pad', a zero pad + 'valid' max pool), "
                "but its block BatchNorms (bn1d, bn2d) use eps 1e-4 where this network uses 1e-5: their "
                "moving_variance is raised by 9e-5 so that inference gives the zoo network's outputs; in training "
                "mode batches are normalised with eps 1e-5"]
    if fmt == ZOO:
        return ["the models zoo's ResNet-50/101/152 uses BatchNorm eps 1e-4 (this network 1e-5): every "
                "moving_variance is raised by 9e-5 so that BatchNorm inference matches",
                "the models zoo's ResNet-50/101/152 pads with pad_mode 'same' (7x7 stem conv: 2 rows/columns "
                "top-left and 3 bottom-right; stride-2 3x3 convs and the max pool: 0 top-left, 1 bottom-right at "
                "even sizes) where this network pads symmetrically like torchvision: outputs DIFFER from the zoo "
                "network's (features shift by a pixel) until fine-tuning adapts the weights (eval.py, export.py and "
                "predict.py build the zoo's semantics instead and reproduce its outputs)"]
    if fmt == MINDCV:
        return ["mindcv's ResNet max pool uses pad_mode 'same' (0 top-left, 1 bottom-right at even sizes) where this "
                "network pads 1 on every side like torchvision: outputs DIFFER from mindcv's network (features after "
                "the stem shift by a pixel) until fine-tuning adapts the weights; convolutions and BatchNorm (eps "
                "1e-5) are the same (eval.py, export.py and predict.py build mindcv's semantics instead and reproduce "
                "its outputs)"]
    return []


# ------------------------------------------------------------------------------------------- architecture

_BLOCK_CONV = re.compile(r"layer([1-4])\.(\d+)\.(conv\d)\.weight$")


def architecture_of(names: Iterable[str]) -> Optional[str]:
    """The architecture (src/architectures.py) whose block counts and block kind a set of our names shows."""
    blocks: Dict[int, int] = {}
    bottleneck = False
    for name in names:
        match = _BLOCK_CONV.match(name)
        if match:
            layer, index = int(match.group(1)), int(match.group(2))
            blocks[layer] = max(blocks.get(layer, 0), index + 1)
            bottleneck = bottleneck or match.group(3) == "conv3"
    architecture = None
    for model_name, (kind, layers) in ARCHITECTURES.items():
        if tuple(blocks.get(i, 0) for i in range(1, 5)) == layers and (kind == BOTTLENECK) == bottleneck:
            architecture = model_name
    return architecture


def describe_weights(entries: Mapping[str, Any]) -> Tuple[Optional[str], Optional[int]]:
    """(architecture, class count) a set of ResNet weights belongs to, as far as the names (and fc.weight's
    shape) tell."""
    fc = entries.get("fc.weight")
    class_num = int(fc.shape[0]) if fc is not None and len(fc.shape) == 2 else None
    return architecture_of(entries), class_num



def conv1_weight(entries: Mapping[str, Any]) -> Any:
    """The stem's conv1.weight entry, also under a wrapper prefix (None when there is none)."""
    return entries.get(find_wrapper_prefix(entries) + "conv1.weight")


def stem_of_weights(entries: Mapping[str, Any]) -> Optional[str]:
    """The stem (src/architectures.py STEMS) that conv1.weight's shape shows: a 3x3 kernel is the cifar stem, a 7x7
    one imagenet's, in any naming scheme; None without a conv1 weight of either shape."""
    shape = getattr(conv1_weight(entries), "shape", None)
    return stem_of_conv1(shape) if shape is not None else None
