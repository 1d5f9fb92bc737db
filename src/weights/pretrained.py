"""Weights to start training from (train.py --pretrained), and the SHA-256 pin of --resume.

--pretrained takes:
- a file: this project's .ckpt, a PyTorch/torchvision .pth, a models-zoo or mindcv ResNet .ckpt;
- a name from the registry file pretrained_weights.yaml (torchvision_imagenet), looked up by model_name;
- an http(s) URL.
Downloads go into pretrained_cache_dir through src.download: written under a temporary name, checked, then
renamed into place; a file that fails its check is removed and the run stops with one line. The hash is
--checkpoint_sha256 when given, else the registry's prefix, else (like torch.hub) the hex digits in a file name
of the form NAME-<hex>.EXT. A cached file is checked again before each use. Loading goes through
src.weights.loading.load_weights_report; when the file's head does not fit class_num, fc keeps its fresh
initialisation.

Semantics: training always builds this project's network (torch semantics: symmetric padding, BatchNorm eps 1e-5),
also from a models-zoo or mindcv checkpoint, whose home network pads some layers 'same' and (models zoo) uses eps
1e-4. The weights are converted (a zoo checkpoint's moving variances take the eps difference) and the log says what
still differs; fine-tuning adapts the weights to the one-pixel shift. Why not train in the home semantics: every
checkpoint train.py writes then computes one way (eval.py, export.py and predict.py know it from the format alone,
nothing extra to record), and training keeps the native blocked convolutions and fused evaluation at every layer
(docs/checkpoints.md).
"""
import difflib
import logging
import os
import re
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import yaml

from src.download import download, shown_digest
from src.errors import UserError
from src.weights.files import file_sha256, is_torch_file, normalise_sha256, verify_sha256
from src.weights.loading import LoadReport, load_weights_report
from src.weights.names import FORMAT_TITLES, HOME_SEMANTICS

REGISTRY_PATH = Path(__file__).resolve().parents[2] / "pretrained_weights.yaml"
HASH_IN_FILE_NAME = re.compile(r"-([0-9a-f]{8,64})\.")  # torch.hub's convention, at least 8 hex digits
URL_SCHEMES = ("http://", "https://")


@dataclass(frozen=True)
class RegistryEntry:
    name: str  # the registry name, e.g. torchvision_imagenet
    model_name: str
    url: str
    sha256_prefix: str
    num_classes: int
    description: str


def read_registry(path: Path = REGISTRY_PATH) -> Dict[str, Dict[str, RegistryEntry]]:
    """name -> model_name -> RegistryEntry, from the registry yaml. Raises UserError for a broken file."""
    try:
        with open(path, encoding="utf-8") as handle:
            raw = yaml.safe_load(handle)
    except OSError as exc:
        raise UserError(f"registry file {path} cannot be read ({exc.strerror}); restore it from the "
                        "repository") from None
    except yaml.YAMLError as exc:
        raise UserError(f"registry file {path} is not valid yaml ({' '.join(str(exc).split())}); restore it from "
                        "the repository") from None
    registry: Dict[str, Dict[str, RegistryEntry]] = {}
    try:
        for name, source in raw.items():
            registry[str(name)] = {
                str(model): RegistryEntry(name=str(name), model_name=str(model), url=str(item["url"]),
                                          sha256_prefix=normalise_sha256(str(item["sha256_prefix"]),
                                                                         f"{name}.{model}.sha256_prefix"),
                                          num_classes=int(source.get("num_classes", 0)),
                                          description=str(source.get("description", "")))
                for model, item in source["models"].items()}
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        raise UserError(f"registry file {path} is malformed ({type(exc).__name__}: {exc}); each name needs "
                        "models: {model_name: {url, sha256_prefix}}") from None
    return registry


def hash_in_file_name(name: str) -> str:
    """The SHA-256 prefix a file name carries as NAME-<8+ hex digits>.EXT ('' if none)."""
    match = HASH_IN_FILE_NAME.search(name)
    return match.group(1) if match else ""


def download_weights(url: str, destination: Path, expected: str, logger: logging.Logger) -> str:
    """Downloads url to destination (src.download), kept only if its SHA-256 starts with expected (any file when
    expected is ''). Returns the SHA-256. Raises UserError, leaving no file behind."""
    return download(url, destination, "sha256", expected, logger, allow_prefix=True,
                    fix_unreachable="check the URL and the network, or download the file yourself into "
                                    f"{destination.parent} (it is checked there) or anywhere and pass "
                                    "--pretrained FILE",
                    expected_file="not the published one",
                    fix_mismatch="try again, or check the URL and --checkpoint_sha256")


def cache_path(url: str, cache_dir: str) -> Path:
    name = Path(urllib.parse.urlparse(url).path).name
    if not name:
        raise UserError(f"--pretrained URL {url} names no file (nothing after the last '/'); give the URL of the "
                        "weights file itself")
    return Path(cache_dir).expanduser() / name


def fetch(url: str, cache_dir: str, expected: str, logger: logging.Logger) -> Path:
    """The cached copy of url (checked again) or a fresh, checked download of it."""
    destination = cache_path(url, cache_dir)
    if destination.is_file():
        digest = file_sha256(destination)
        if expected and not digest.startswith(expected):
            raise UserError(f"cached {destination} has SHA-256 {digest}, expected {shown_digest(expected)}: it is "
                            f"damaged or another file; delete it so that {url} is downloaded again")
        logger.info("pretrained: using cached %s (SHA-256 %s%s)", destination, digest,
                    ", verified" if expected else "; nothing to check it against")
        return destination
    try:
        destination.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot create pretrained_cache_dir {destination.parent} ({exc.strerror}); set "
                        "--pretrained_cache_dir to a writable folder") from None
    logger.info("pretrained: downloading %s to %s", url, destination)
    digest = download_weights(url, destination, expected, logger)
    if expected:
        logger.info("pretrained: SHA-256 %s verified (expected %s)", digest, shown_digest(expected))
    else:
        logger.info("pretrained: %s had no hash to check (no --checkpoint_sha256, no hash in its name); its SHA-256 "
                    "is %s: pass --checkpoint_sha256 %s to pin it", url, digest, digest)
    return destination


def _agreeing(first: str, second: str, what: str) -> str:
    """The longer of two SHA-256 prefixes that must describe the same file."""
    if first and second and not (first.startswith(second) or second.startswith(first)):
        raise UserError(f"checkpoint_sha256 {first} contradicts {what} {second}: drop --checkpoint_sha256 or correct "
                        "it")
    return max(first, second, key=len)


def resolve_pretrained(value: str, model_name: str, cache_dir: str, sha256: str, logger: logging.Logger,
                       registry_path: Path = REGISTRY_PATH) -> Tuple[str, str]:
    """(local file, SHA-256 still to check when loading it) for a --pretrained value. Downloads are checked
    here, so for them the second item is ''. Raises UserError for a value that is none of the accepted kinds."""
    value = value.strip()
    pin = normalise_sha256(sha256)
    if value.lower().startswith(URL_SCHEMES):
        name_hash = hash_in_file_name(cache_path(value, cache_dir).name)
        expected = pin or name_hash  # the pin wins: a name's hex digits may not be a SHA-256
        return str(fetch(value, cache_dir, expected, logger)), ""
    registry = read_registry(registry_path)
    if value in registry:
        models = registry[value]
        if model_name not in models:
            raise UserError(f"{value} in {registry_path} has no weights for {model_name} (it has "
                            f"{', '.join(models)}): pass another --model_name or --pretrained")
        entry = models[model_name]
        expected = _agreeing(pin, entry.sha256_prefix, f"the registry's prefix for {value} {model_name}")
        logger.info("pretrained: %s %s: %s (%s)", value, model_name, entry.url, entry.description)
        return str(fetch(entry.url, cache_dir, expected, logger)), ""
    file = Path(value).expanduser()
    if file.is_file():
        return str(file), pin
    names = ", ".join(registry)
    if "/" in value or os.sep in value or file.suffix:
        raise UserError(f"--pretrained file {value} does not exist; pass an existing .ckpt or .pth file, an http(s) "
                        f"URL or one of: {names}")
    close = difflib.get_close_matches(value, list(registry), n=1, cutoff=0.5)
    hint = f"; did you mean {close[0]}?" if close else ""
    raise UserError(f"unknown --pretrained value {value!r}: not an existing file, an http(s) URL or a name from "
                    f"{registry_path.name} ({names}){hint}")


def load_pretrained(net, config: Any, logger: logging.Logger,
                    registry_path: Path = REGISTRY_PATH) -> Optional[LoadReport]:
    """Called by the trainer right after the network is built.

    With --resume: checks the resume file against checkpoint_sha256 (the weights come from it, --pretrained is not
    loaded). Otherwise loads --pretrained (if set) into net; when its fc does not fit class_num, fc stays freshly
    initialised and the log says so.
    """
    pin = normalise_sha256(config.checkpoint_sha256)
    if config.resume:
        resume = Path(config.resume)
        if resume.is_file():  # a missing file is reported by the resume itself
            if is_torch_file(resume):
                raise UserError(f"--resume {resume} is a PyTorch file: --resume takes a checkpoint written by "
                                f"train.py; to start from its weights pass --pretrained {resume}")
            if pin:
                digest = verify_sha256(resume, pin)
                logger.info("resume: %s has SHA-256 %s (matches checkpoint_sha256)", resume, digest)
        if config.pretrained:
            logger.info("resume: --pretrained %s is not loaded: the weights come from %s", config.pretrained, resume)
        return None
    if not config.pretrained:
        if pin:
            raise UserError("checkpoint_sha256 is set but train.py reads no checkpoint: pass --pretrained FILE or "
                            "--resume FILE, or drop --checkpoint_sha256")
        return None
    path, still_to_check = resolve_pretrained(config.pretrained, config.model_name, config.pretrained_cache_dir,
                                              pin, logger, registry_path)
    report = load_weights_report(net, path, config.model_name, logger, sha256=still_to_check, allow_new_head=True)
    log_training_semantics(report, getattr(net, "semantics", "torch"), logger)
    return report


def log_training_semantics(report: LoadReport, semantics: str, logger: logging.Logger) -> None:
    """Says which semantics (src/architectures.py SEMANTICS) the run trains with, and that a foreign checkpoint's
    home network computes otherwise."""
    home = HOME_SEMANTICS[report.fmt]
    if home == semantics:
        logger.info("pretrained: training with %s semantics, those of %s's home network", semantics, report.path)
        return
    logger.info("pretrained: training with this project's %s semantics, not the %s semantics of %s (a %s): the "
                "weights are converted, the network starts close to but not exactly at the home network's outputs "
                "(see the notes above) and fine-tuning adapts them; the checkpoints this run writes are this "
                "project's and compute with %s semantics", semantics, home, report.path, FORMAT_TITLES[report.fmt],
                semantics)
