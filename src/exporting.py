"""Export of a trained network to MINDIR, ONNX or AIR, written atomically, with an optional check that the
exported model computes what the network computes.

The file is exported under a temporary name in output_path (src.atomic_file), verified there when asked, and
only then renamed to its final name, so a failed or half-written export never sits under the final name.
"""
import logging
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from src.atomic_file import atomic_write
from src.errors import UserError

SUFFIXES: Dict[str, str] = {"MINDIR": ".mindir", "ONNX": ".onnx", "AIR": ".air"}

# Pass when max|exported - network| <= VERIFY_ATOL + VERIFY_RTOL * max|network|. Float32 reordering noise
# is far below this: MINDIR through MindSpore reproduces the network exactly (0.0), onnxruntime differs by
# about 1e-6 here and 1.5e-5 at most in the platform notes. A real export fault (training-mode BatchNorm,
# wrong or missing weights, a dropped layer) moves the logits by about their own size, i.e. >= 1e-1.
VERIFY_ATOL = 1e-4
VERIFY_RTOL = 1e-4


@dataclass(frozen=True)
class Difference:
    """How far the exported model's outputs are from the network's on one input batch."""
    batch_size: int
    max_abs: float
    max_reference: float  # max |network output|: the scale the relative difference is taken against

    @property
    def relative(self) -> float:
        if self.max_reference > 0:
            return self.max_abs / self.max_reference
        return 0.0 if self.max_abs == 0 else float("inf")

    @property
    def tolerance(self) -> float:
        return VERIFY_ATOL + VERIFY_RTOL * self.max_reference

    @property
    def ok(self) -> bool:
        return bool(np.isfinite(self.max_abs)) and self.max_abs <= self.tolerance

    def describe(self) -> str:
        return (f"batch {self.batch_size}: max abs difference {self.max_abs:.3e}, relative {self.relative:.3e} "
                f"(tolerance {VERIFY_ATOL:.0e} + {VERIFY_RTOL:.0e} x max|output| = {self.tolerance:.3e})")


def compare_outputs(reference: np.ndarray, exported: np.ndarray) -> Difference:
    """Difference of exported against reference (same shape), computed in float64."""
    if reference.shape != exported.shape:
        return Difference(len(reference), float("inf"), float(np.max(np.abs(reference))))
    reference = reference.astype(np.float64)
    return Difference(len(reference), float(np.max(np.abs(exported.astype(np.float64) - reference))),
                      float(np.max(np.abs(reference))))


def check_export_request(file_format: str, dynamic_batch: bool, verify: bool, checkpoint_path: str) -> None:
    """Refuses, before any work, requests that cannot succeed whatever the device (UserError)."""
    if not checkpoint_path:
        raise UserError("no checkpoint given: pass --checkpoint_path FILE (a .ckpt written by train.py)")
    if dynamic_batch and file_format != "MINDIR":
        raise UserError(f"--dynamic_batch works with --file_format MINDIR only: MindSpore exports {file_format} "
                        "with a fixed batch (pass --batch_size B, or export MINDIR)")
    if verify and file_format == "ONNX" and not onnxruntime_available():
        raise UserError("--verify of an ONNX export needs onnxruntime, which is not installed: "
                        "pip install onnxruntime, or export without --verify")
    if verify and file_format == "AIR":
        raise UserError("--verify cannot run an AIR file (it runs through Ascend's ATC/ACL tools, not MindSpore); "
                        "export without --verify")


def check_device(file_format: str, device_target: str) -> None:
    """AIR is Ascend's format: MindSpore refuses it on other backends (one line instead of its C++ trace)."""
    if file_format == "AIR" and device_target != "Ascend":
        raise UserError(f"--file_format AIR needs the Ascend backend, this run uses {device_target}: "
                        "export MINDIR or ONNX here, or run on an Ascend machine")


def onnxruntime_available() -> bool:
    try:
        import onnxruntime  # noqa: F401
    except ImportError:
        return False
    return True


def export_path(output_path: str, file_name: str, model_name: str, file_format: str) -> Path:
    """output_path/<file_name or model_name>.<suffix>; a file_name that already ends in the suffix keeps it."""
    suffix = SUFFIXES[file_format]
    name = file_name or model_name
    if name.lower().endswith(suffix):
        name = name[: -len(suffix)]
    if not name or name.endswith(("/", os.sep)):
        raise UserError(f"--file_name {file_name!r} names no file: give a name without a trailing separator")
    return Path(output_path) / f"{name}{suffix}"


def input_shape(batch_size: int, image_size: Tuple[int, int], dynamic_batch: bool) -> List[Optional[int]]:
    return [None if dynamic_batch else batch_size, 3, int(image_size[0]), int(image_size[1])]


def export_to(net, shape: Sequence[Optional[int]], stem: Path, file_format: str) -> Path:
    """Runs ms.export of net (already in eval mode) for inputs of shape; returns the file it wrote.

    MindSpore appends the suffix itself to file_name, so stem has none.
    """
    import mindspore as ms
    if None in shape:
        example = ms.Tensor(shape=list(shape), dtype=ms.float32)  # a dynamic dimension: shape only
    else:
        example = ms.Tensor(np.zeros(shape, np.float32))
    ms.export(net, example, file_name=str(stem), file_format=file_format)
    written = stem.with_name(stem.name + SUFFIXES[file_format])
    if not written.is_file():
        raise RuntimeError(f"ms.export reported success but wrote no {written}")
    return written


def exported_runner(path: Path, file_format: str) -> Callable[[np.ndarray], np.ndarray]:
    """A function running the exported file on a float32 NCHW batch: MINDIR through MindSpore's GraphCell,
    ONNX through onnxruntime (so the check covers the runtime people deploy ONNX with)."""
    if file_format == "MINDIR":
        import mindspore as ms
        from mindspore import nn
        graph = nn.GraphCell(ms.load(str(path)))
        return lambda batch: graph(ms.Tensor(batch)).asnumpy()
    if file_format == "ONNX":
        import onnxruntime
        session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        name = session.get_inputs()[0].name
        return lambda batch: session.run(None, {name: batch})[0]
    raise ValueError(f"cannot run {file_format} files here")


def verify_batch_sizes(batch_size: int, dynamic_batch: bool) -> List[int]:
    """The exported batch; with a dynamic batch also a second size, to show that the dimension really is free."""
    if not dynamic_batch:
        return [batch_size]
    return [batch_size, 1] if batch_size > 1 else [1, 2]


def verify_export(net, path: Path, file_format: str, image_size: Tuple[int, int], batch_sizes: Sequence[int],
                  seed: int = 1, runner: Optional[Callable[[np.ndarray], np.ndarray]] = None) -> List[Difference]:
    """Feeds the same random batches (normalised-image scale) to net and to the exported file; one
    Difference per batch size."""
    import mindspore as ms
    net.set_train(False)
    run = runner or exported_runner(path, file_format)
    rng = np.random.default_rng(seed)
    differences = []
    for size in batch_sizes:
        batch = rng.standard_normal((size, 3, int(image_size[0]), int(image_size[1]))).astype(np.float32)
        reference = net(ms.Tensor(batch)).asnumpy()
        differences.append(compare_outputs(reference, np.asarray(run(batch))))
    return differences


# MindSpore makes exported files mode 0400 (owner read only). An export is made readable for everyone the umask
# allows (still read-only) so that a serving process under another user can load it; the rename replaces an
# older, read-only export without needing write permission on it.
EXPORT_MODE = 0o444


@dataclass
class ExportResult:
    path: Optional[Path]  # None when verification failed and nothing was published
    shape: List[Optional[int]]
    differences: List[Difference]


class _NotPublished(Exception):
    """Verification failed: the export must not get its final name."""


def export_network(net, final: Path, file_format: str, batch_size: int, image_size: Tuple[int, int],
                   dynamic_batch: bool = False, verify: bool = False, seed: int = 1,
                   runner_factory: Optional[Callable[[Path, str], Callable]] = None) -> ExportResult:
    """Exports net to final (atomically, src.atomic_file); with verify, checks the written file first and
    publishes it only when every difference is within tolerance."""
    net.set_train(False)  # BatchNorm with moving statistics: exporting the training graph is a classic mistake
    shape = input_shape(batch_size, image_size, dynamic_batch)
    differences: List[Difference] = []
    final.parent.mkdir(parents=True, exist_ok=True)
    try:
        with atomic_write(final, EXPORT_MODE) as temp:
            # ms.export names its output itself and, for ONNX, chmods the folder it writes in to 0700: it writes
            # into a private folder next to the temporary file (same file system), and the file moves from there.
            staging_dir = temp.with_name(temp.name + ".d")
            shutil.rmtree(staging_dir, ignore_errors=True)  # left by a killed process that had this PID
            staging_dir.mkdir(mode=0o700)
            try:
                os.replace(export_to(net, shape, staging_dir / final.stem, file_format), temp)
            finally:
                shutil.rmtree(staging_dir, ignore_errors=True)
            if verify:
                differences = verify_export(net, temp, file_format, image_size,
                                            verify_batch_sizes(batch_size, dynamic_batch), seed,
                                            runner=(runner_factory or exported_runner)(temp, file_format))
                if not all(d.ok for d in differences):
                    raise _NotPublished()
    except _NotPublished:
        return ExportResult(None, shape, differences)
    return ExportResult(final, shape, differences)


def _finite(value: float) -> Optional[float]:
    """value, or None for inf/NaN (which strict JSON cannot hold)."""
    return value if np.isfinite(value) else None


def _size_text(path: Path) -> str:
    return f"{path.stat().st_size / 1e6:.1f} MB"


def run_export(config, env, logger: logging.Logger) -> Tuple[int, Dict]:
    """export.py's work after init_env: (exit code, summary). Exit code 1 when verification fails."""
    from src.resnet import build_resnet
    from src.weights.loading import (checkpoint_semantics, load_weights_report, read_weight_file,
                                     settings_from_checkpoint)

    check_device(config.file_format, env.device_target)
    final = export_path(config.output_path, config.file_name, config.model_name, config.file_format)
    # The stem and input size the checkpoint records apply unless set.
    read = read_weight_file(config.checkpoint_path, config.checkpoint_sha256)
    config = settings_from_checkpoint(config, read[0], config.checkpoint_path, logger)
    image_size = (config.image_height, config.image_width)
    # A models-zoo or mindcv checkpoint exports its home network (padding, BatchNorm eps).
    semantics = checkpoint_semantics(read, config.checkpoint_path, logger)
    net = build_resnet(config.model_name, config.class_num, stem=config.stem, semantics=semantics)
    load_weights_report(net, config.checkpoint_path, config.model_name, logger, read=read, use_ema=config.use_ema)
    logger.info("exporting %s (%s, %s stem, %d classes) as %s, input %s", config.checkpoint_path, config.model_name,
                config.stem, config.class_num, config.file_format,
                input_shape(config.batch_size, image_size, config.dynamic_batch))
    result = export_network(net, final, config.file_format, config.batch_size, image_size, config.dynamic_batch,
                            config.verify, config.seed)
    summary = {
        "file": str(result.path) if result.path else None, "file_format": config.file_format,
        "input_shape": result.shape, "checkpoint": str(config.checkpoint_path), "model_name": config.model_name,
        "stem": config.stem, "semantics": semantics, "class_num": config.class_num,
        "verify": [{"batch_size": d.batch_size, "max_abs_diff": _finite(d.max_abs), "max_rel_diff": _finite(d.relative),
                    "tolerance": d.tolerance, "ok": d.ok} for d in result.differences],
    }
    for difference in result.differences:
        print(f"verify {config.file_format} {difference.describe()}: {'ok' if difference.ok else 'FAILED'}",
              flush=True)
    if result.path is None:
        worst = max(result.differences, key=lambda d: d.max_abs / d.tolerance)
        print(f"error: verify failed: the exported {config.file_format} differs from the network ({worst.describe()});"
              f" {final} was not written", file=sys.stderr, flush=True)
        return 1, summary
    print(f"wrote {result.path} ({config.file_format}, input {result.shape}, {_size_text(result.path)})", flush=True)
    return 0, summary
