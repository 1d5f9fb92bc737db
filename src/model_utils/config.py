"""Configuration: default_config.yaml, overlaid by an optional --config_path yaml, overlaid by --key value.

Nothing here runs at import time: scripts call load_config(argv) and pass the result on explicitly.
Each key's type is the type of its value in default_config.yaml; values are checked against the rules
in VALUE_RULES, and an unknown key is refused with the closest known keys.
"""
import difflib
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import yaml

from src.architectures import MODEL_NAMES, STEMS
from src.augmentation import AUTO_AUGMENT, RANDAUGMENT_BINS
from src.errors import UserError

DEFAULT_CONFIG_PATH = Path(__file__).resolve().parents[2] / "default_config.yaml"

CHOICES: Dict[str, Tuple[str, ...]] = {
    "device_target": ("Auto", "Ascend", "GPU", "CPU"),
    "context_mode": ("graph", "pynative"),
    "conv_implementation": ("auto", "onednn_blocked", "mindspore"),
    "model_name": MODEL_NAMES,
    "stem": STEMS,
    "optimizer": ("adam", "momentum"),
    "lr_schedule": ("constant", "cosine", "step", "poly", "onecycle"),
    "amp_level": ("auto", "O0", "O1", "O2", "O3"),
    "loss_scale_type": ("fixed", "dynamic"),
    "auto_augment": AUTO_AUGMENT,
    "file_format": ("MINDIR", "ONNX", "AIR"),
}

# key -> (test, what the value must be)
VALUE_RULES: Dict[str, Tuple[Callable[[Any], bool], str]] = {
    "train_num_samples": (lambda v: v >= 0, "0 (all) or a positive count"),
    "eval_num_samples": (lambda v: v >= 0, "0 (all) or a positive count"),
    "num_parallel_workers": (lambda v: v >= 1, "at least 1"),
    "image_height": (lambda v: v >= 32, "at least 32"),
    "image_width": (lambda v: v >= 32, "at least 32"),
    "class_num": (lambda v: v >= 2, "at least 2"),
    "device_id": (lambda v: v >= 0, "0 or more"),
    "batch_size": (lambda v: v >= 1, "at least 1"),
    "epoch_size": (lambda v: v >= 1, "at least 1"),
    "lr": (lambda v: v > 0, "greater than 0"),
    "warmup_epochs": (lambda v: v >= 0, "0 or more"),
    "lr_min": (lambda v: v >= 0, "0 or more"),
    "lr_step_epochs": (lambda v: v >= 1, "at least 1"),
    "lr_gamma": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "lr_poly_power": (lambda v: v > 0, "greater than 0"),
    "onecycle_pct_start": (lambda v: 0 < v < 1, "in (0, 1)"),
    "momentum": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "weight_decay": (lambda v: v >= 0, "0 or more"),
    "label_smoothing": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "grad_clip_norm": (lambda v: v >= 0, "0 (off) or greater"),
    "ema_decay": (lambda v: 0 <= v < 1, "in [0, 1) (0: no EMA)"),
    "loss_scale": (lambda v: v >= 1, "at least 1"),
    "sink_size": (lambda v: v == -1 or v >= 1, "-1 (the whole epoch) or at least 1"),
    "save_checkpoint_steps": (lambda v: v >= 0, "0 (epoch ends only) or a positive count"),
    "eval_interval": (lambda v: v >= 1, "at least 1"),
    "keep_checkpoint_max": (lambda v: v >= 1, "at least 1"),
    "log_interval": (lambda v: v >= 1, "at least 1"),
    "randaugment_num_ops": (lambda v: v >= 1, "at least 1"),
    "randaugment_magnitude": (lambda v: 0 <= v < RANDAUGMENT_BINS, f"from 0 to {RANDAUGMENT_BINS - 1}"),
    "random_erasing": (lambda v: 0 <= v <= 1, "a probability in [0, 1]"),
    "mixup_alpha": (lambda v: v >= 0, "0 (off) or more"),
    "cutmix_alpha": (lambda v: v >= 0, "0 (off) or more"),
    "mixup_switch_prob": (lambda v: 0 <= v <= 1, "a probability in [0, 1]"),
    "top_k": (lambda v: v >= 1, "at least 1"),
}


class Config:
    """Attribute access to the checked configuration values (config.lr, config.batch_size, ...).

    It also knows which keys the user set (on the command line or in the --config_path file) as opposed to
    default_config.yaml's values: is_set(key), where_set(key)."""

    def __init__(self, values: Dict[str, Any], descriptions: Dict[str, str],
                 explicit: Optional[Dict[str, str]] = None) -> None:
        object.__setattr__(self, "_values", dict(values))
        object.__setattr__(self, "_descriptions", dict(descriptions))
        object.__setattr__(self, "_explicit", dict(explicit or {}))  # key -> where the user set it

    def __getattr__(self, key: str) -> Any:
        try:
            return self._values[key]
        except KeyError:
            raise AttributeError(f"no config key {key!r}") from None

    def __setattr__(self, key: str, value: Any) -> None:
        raise AttributeError("Config is read-only; use replace(key=value) for a changed copy")

    def replace(self, **changes: Any) -> "Config":
        """A copy with some keys changed (checked like command-line values)."""
        values = dict(self._values)
        for key, value in changes.items():
            _check_known(key, values, "replace()")
            values[key] = _coerce(key, value, values[key], "replace()")
        _check_values(values)
        return Config(values, self._descriptions, self._explicit)  # a replaced value is the program's, not the user's

    def is_set(self, key: str) -> bool:
        """Whether the user set key (on the command line or in the --config_path file); False for a default."""
        return key in self._explicit

    def where_set(self, key: str) -> str:
        """Where the user set key: 'on the command line' or 'in FILE' ('' when it is the default)."""
        return self._explicit.get(key, "")

    @property
    def explicit_keys(self) -> frozenset:
        """The keys the user set (command line or --config_path file)."""
        return frozenset(self._explicit)

    def to_dict(self) -> Dict[str, Any]:
        return dict(self._values)

    def __repr__(self) -> str:
        return f"Config({self._values!r})"


def _read_yaml(path: Path) -> List[Any]:
    if not path.is_file():
        raise UserError(f"config file {path} does not exist; pass --config_path with an existing yaml file")
    try:
        with open(path, encoding="utf-8") as handle:
            documents = list(yaml.safe_load_all(handle))
    except yaml.YAMLError as exc:
        reason = " ".join(str(exc).split())
        raise UserError(f"config file {path} is not valid yaml: {reason}") from None
    if not documents or not isinstance(documents[0], dict):
        raise UserError(f"config file {path} must hold a mapping of key: value pairs")
    return documents


def _check_known(key: str, known: Dict[str, Any], source: str) -> None:
    if key not in known:
        close = difflib.get_close_matches(key, list(known), n=3, cutoff=0.6)
        hint = f"; did you mean {' or '.join(close)}?" if close else "; see --help for the keys"
        raise UserError(f"unknown config key '{key}' ({source}){hint}")


def _type_name(default: Any) -> str:
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}[type(default)]


def _coerce(key: str, value: Any, default: Any, source: str) -> Any:
    """Converts value (a command-line string or a yaml scalar) to the type of the key's default."""
    expected = type(default)
    bad = UserError(f"config key '{key}' ({source}) must be {_type_name(default)}, got {value!r}")
    if isinstance(value, str) and expected is not str:
        text = value.strip()
        if expected is bool:
            if text.lower() not in ("true", "false"):
                raise bad
            return text.lower() == "true"
        try:
            return expected(text) if expected is float else int(text, 10)
        except ValueError:
            raise bad from None
    if expected is bool:
        if not isinstance(value, bool):
            raise bad
        return value
    if expected is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad
        return value
    if expected is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad
        return float(value)
    if value is None:
        return ""
    if not isinstance(value, (str, int, float)) or isinstance(value, bool):
        raise bad
    return str(value)


def _check_values(values: Dict[str, Any]) -> None:
    for key, allowed in CHOICES.items():
        if values[key] not in allowed:
            lowered = {a.lower(): a for a in allowed}
            hint = f"; did you mean {lowered[values[key].lower()]}?" if values[key].lower() in lowered else ""
            raise UserError(f"config key '{key}' must be one of {', '.join(allowed)}, got {values[key]!r}{hint}")
    for key, (test, wanted) in VALUE_RULES.items():
        if not test(values[key]):
            raise UserError(f"config key '{key}' must be {wanted}, got {values[key]!r}")
    if values["nesterov"] and values["optimizer"] != "momentum":
        raise UserError(f"config key 'nesterov' needs optimizer momentum, got optimizer {values['optimizer']!r}: "
                        "set --optimizer momentum or --nesterov false")
    if values["nesterov"] and not values["momentum"] > 0:
        raise UserError(f"config key 'nesterov' needs a momentum above 0, got momentum {values['momentum']!r}: "
                        "set --momentum 0.9 or --nesterov false")
    if values["lr_schedule"] == "onecycle" and values["warmup_epochs"]:
        raise UserError("config key 'warmup_epochs' must be 0 with lr_schedule onecycle, which rises on its own "
                        "(onecycle_pct_start)")
    if values["warmup_epochs"] > values["epoch_size"]:
        raise UserError(f"config key 'warmup_epochs' ({values['warmup_epochs']}) must not exceed "
                        f"'epoch_size' ({values['epoch_size']})")


def _split_argv(argv: Sequence[str], bool_keys: Sequence[str],
                allow_positional: bool) -> Tuple[List[Tuple[str, str]], List[str]]:
    """(--key value / --key=value pairs in order, positional arguments).

    A bool key alone (--verify) means true unless true/false follows.
    """
    pairs, positional = [], []
    index = 0
    while index < len(argv):
        token = argv[index]
        if not token.startswith("--") or token == "--":
            if not allow_positional:
                raise UserError(f"unexpected command-line argument {token!r}: options are --key value")
            positional.append(token)
            index += 1
            continue
        key, has_value, value = token[2:].partition("=")
        if not has_value:
            following = argv[index + 1] if index + 1 < len(argv) else None
            takes_following = following is not None and not following.startswith("--") and (
                not allow_positional or following.lower() in ("true", "false"))
            if key in bool_keys and not takes_following:
                value = "true"
            elif following is None or following.startswith("--"):
                raise UserError(f"command-line option --{key} needs a value")
            else:
                index += 1
                value = following
        pairs.append((key, value))
        index += 1
    return pairs, positional


def format_help(defaults: Dict[str, Any], descriptions: Dict[str, str], prog: str) -> str:
    """The --help text: usage, then every key with its description, choices and default."""
    lines = [f"usage: {prog} [--config_path FILE] [--key value ...]", "",
             "Any key below can be set on the command line (a bool key alone means true); --config_path "
             "overlays a yaml file of keys.", ""]
    width = max(len(key) for key in defaults) + 2
    for key, default in defaults.items():
        choices = f" [{'|'.join(CHOICES[key])}]" if key in CHOICES else ""
        lines.append(f"  --{key.ljust(width)} {descriptions.get(key, '')}{choices} (default: {default!r})")
    return "\n".join(lines)


def load_config(argv: Optional[Sequence[str]] = None, default_path: Path = DEFAULT_CONFIG_PATH,
                prog: str = "train.py", positional: str = "") -> Config:
    """Builds the configuration from default_path, --config_path and the --key value pairs of argv.

    positional: when set (e.g. "images"), arguments that are not options are allowed and returned as
    config.arguments; otherwise they are refused.
    Raises UserError for an unknown key, an unparseable or out-of-range value, or a missing file.
    `-h`/`--help` prints the keys and exits 0.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    documents = _read_yaml(Path(default_path))
    defaults: Dict[str, Any] = documents[0]
    descriptions: Dict[str, str] = documents[1] if len(documents) > 1 and isinstance(documents[1], dict) else {}
    if "-h" in argv or "--help" in argv:
        print(format_help(defaults, descriptions, prog))
        raise SystemExit(0)

    values = dict(defaults)
    explicit: Dict[str, str] = {}
    bool_keys = [key for key, value in defaults.items() if isinstance(value, bool)]
    pairs, arguments = _split_argv(argv, bool_keys, allow_positional=bool(positional))
    config_paths = [value for key, value in pairs if key == "config_path"]
    if len(config_paths) > 1:
        raise UserError("--config_path was given more than once")
    if config_paths:
        overlay_path = Path(config_paths[0])
        overlay = _read_yaml(overlay_path)[0]
        for key, value in overlay.items():
            _check_known(str(key), defaults, f"in {overlay_path}")
            values[key] = _coerce(key, value, defaults[key], f"in {overlay_path}")
            explicit[key] = f"in {overlay_path}"
    for key, value in pairs:
        if key == "config_path":
            continue
        _check_known(key, defaults, "on the command line")
        values[key] = _coerce(key, value, defaults[key], "on the command line")
        explicit[key] = "on the command line"
    _check_values(values)
    values["config_path"] = str(config_paths[0]) if config_paths else ""
    values["arguments"] = tuple(arguments)
    return Config(values, descriptions, explicit)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """python -m src.model_utils.config KEY [--config_path FILE] [--key value ...]: prints KEY's checked value.

    For the shell launchers: they learn output_path the way train.py will, and bad keys fail before launch.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith("-"):
        raise UserError("usage: python -m src.model_utils.config KEY [--config_path FILE] [--key value ...]")
    config = load_config(argv[1:], prog="config")
    _check_known(argv[0], config.to_dict(), "asked for")
    print(getattr(config, argv[0]))
    return 0


if __name__ == "__main__":
    from src.errors import run_cli
    run_cli(main)
