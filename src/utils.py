"""Run environment: device choice, CPU speed setting, seeds, graph/pynative mode, distributed set-up,
logging, and the one-line error handling shared by the top-level scripts."""
import contextlib
import logging
import os
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Tuple

import numpy as np
import mindspore as ms

from src.atomic_file import DiskFullError, disk_full_cause
from src.errors import UserError, run_cli  # noqa: F401  (run_cli: the scripts' entry wrapper)
from src.onednn_conv import native_thread_count, resolve_conv_implementation, set_native_threads
from src.train_step import amp_level_for

# oneDNN picks slow reference kernels for MindSpore's 3x3/7x7 convolutions (plain NCHW tensors) on AVX-512
# CPUs; capping it at AVX2 gives its far faster im2col+GEMM kernels (docs/performance.md). The
# project's blocked-layout convolutions (src/onednn_conv.py) need no cap: they get the AVX-512 kernels.
ONEDNN_ISA_VARIABLE = "ONEDNN_MAX_CPU_ISA"
ONEDNN_ISA_DEFAULT = "AVX2"
DEVICE_PREFERENCE = ("Ascend", "GPU", "CPU")


@dataclass(frozen=True)
class RunEnv:
    """What init_env set up: the device in use and this process's place in a distributed job."""
    device_target: str
    rank_id: int = 0
    group_size: int = 1
    conv_implementation: str = "mindspore"  # see src/onednn_conv.py

    @property
    def distributed(self) -> bool:
        return self.group_size > 1

    @property
    def is_main_rank(self) -> bool:
        return self.rank_id == 0


def apply_cpu_speed_setting(logger: Optional[logging.Logger] = None, conv_implementation: str = "mindspore") -> str:
    """Caps oneDNN's instruction set when MindSpore's own convolutions run, unless the user set
    ONEDNN_MAX_CPU_ISA; returns the value in force ("all" when uncapped).

    Must run before the first convolution (oneDNN reads it once).
    """
    user_value = os.environ.get(ONEDNN_ISA_VARIABLE)
    if user_value is None and conv_implementation == "mindspore":
        os.environ[ONEDNN_ISA_VARIABLE] = ONEDNN_ISA_DEFAULT
    value = os.environ.get(ONEDNN_ISA_VARIABLE, "all")
    if logger:
        origin = "set by the user" if user_value is not None else "project default"
        logger.info("%s=%s (%s), convolutions: %s", ONEDNN_ISA_VARIABLE, value, origin, conv_implementation)
    return value


def choose_convolutions(requested: str, device_target: str, logger: Optional[logging.Logger] = None,
                        amp_level: str = "O0") -> Tuple[str, str]:
    """Resolves conv_implementation for the device and the amp level in force (O0-O3) and applies the oneDNN
    setting it needs, before the first convolution: (implementation, ONEDNN_MAX_CPU_ISA in force)."""
    implementation, reason = resolve_conv_implementation(requested, device_target, amp_level)
    if logger and implementation != requested:
        logger.info("conv_implementation %s: using %s (%s)", requested, implementation, reason)
    if implementation == "onednn_blocked":
        threads = set_native_threads(native_thread_count())
        if logger:
            logger.info("native convolutions: %d threads", threads)
    return implementation, apply_cpu_speed_setting(logger, implementation)


@contextlib.contextmanager
def _quiet_stderr():
    """Silences file descriptor 2: probing an absent backend makes MindSpore's C++ print load failures."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w", encoding="utf-8") as devnull:
        os.dup2(devnull.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def device_usable(target: str) -> bool:
    """Whether the installed MindSpore can run on target (CPU always can)."""
    if target == "CPU":
        return True
    try:
        with _quiet_stderr():
            return bool(ms.hal.is_available(target))
    except (RuntimeError, ValueError):
        return False


def select_device(requested: str, logger: logging.Logger) -> str:
    """Auto picks Ascend, then GPU, then CPU; an explicit target that can't be used is refused."""
    if requested == "Auto":
        chosen = next(target for target in DEVICE_PREFERENCE if device_usable(target))
        logger.info("device_target Auto: using %s", chosen)
        return chosen
    if not device_usable(requested):
        usable = [target for target in DEVICE_PREFERENCE if device_usable(target)]
        raise UserError(f"device_target {requested} is not usable with this MindSpore {ms.__version__} install "
                        f"(usable here: {', '.join(usable)}); set --device_target {usable[0]} or Auto, or install "
                        f"MindSpore built for {requested}")
    return requested


SCHEDULER_RANK = -1  # msrun's scheduler process: it runs the script too, but only inside init()


def launched_distributed() -> bool:
    """True when started by msrun (as a worker or its scheduler) or by the Ascend rank-table route."""
    if os.environ.get("MS_ROLE") in ("MS_WORKER", "MS_SCHED"):
        return True
    return bool(os.environ.get("RANK_TABLE_FILE")) and int(os.environ.get("RANK_SIZE", "1")) > 1


def launcher_rank() -> int:
    """This process's rank as the launcher set it (0 when not distributed); valid before init().

    msrun's scheduler gets SCHEDULER_RANK: it writes no files, and its init() serves the workers and
    ends the process when they finish.
    """
    if os.environ.get("MS_ROLE") == "MS_SCHED":
        return SCHEDULER_RANK
    return int(os.environ.get("RANK_ID", "0")) if launched_distributed() else 0


def set_seeds(seed: int) -> None:
    """Seeds MindSpore (weights), NumPy, Python and the data pipeline."""
    ms.set_seed(seed)
    np.random.seed(seed)
    random.seed(seed)
    ms.dataset.config.set_seed(seed)


def set_execution_mode(graph: bool, device_target: str, training: bool) -> None:
    """MindSpore's graph or PyNative mode. Training graphs on the CPU get MindSpore's static memory planning
    (memory_optimize_level O1).

    Why: with the runtime's dynamic allocation, ResNet-50's training step at 224x224 grew its memory pool by about
    430 MB in some step, at random, and kept it (a peak of 3.7 or 4.1 GB from run to run); planned, it stayed at the
    lower in every run measured, no slower. Inference graphs compiled so ran 0.87x as fast at 224x224, so processes
    that only evaluate keep the default (train.py's evaluation at 32x32 ran level)."""
    if not graph:
        ms.set_context(mode=ms.PYNATIVE_MODE)
        return
    ms.set_context(mode=ms.GRAPH_MODE, memory_optimize_level="O1" if training and device_target == "CPU" else "O0")


def init_env(config, logger: logging.Logger, training: bool = False) -> RunEnv:
    """Sets up device, convolution kernels, the CPU speed setting, mode (set_execution_mode: training says whether
    this process trains), seeds and, under a launcher, data-parallel training."""
    device = select_device(config.device_target, logger)
    conv_implementation, _ = choose_convolutions(config.conv_implementation, device, logger,
                                                 amp_level_for(config.amp_level, device))
    set_seeds(config.seed)
    set_execution_mode(config.context_mode == "graph", device, training)
    if not launched_distributed():
        ms.set_device(device, config.device_id if device != "CPU" else None)
        return RunEnv(device_target=device, conv_implementation=conv_implementation)
    ms.set_device(device)  # the launcher hands out device ids
    from mindspore.communication import get_group_size, get_rank, init
    init()  # in msrun's scheduler process this serves the workers and never returns
    rank_id, group_size = get_rank(), get_group_size()
    ms.reset_auto_parallel_context()
    ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.DATA_PARALLEL, gradients_mean=True,
                                 device_num=group_size)
    logger.info("data-parallel training: rank %d of %d", rank_id, group_size)
    return RunEnv(device_target=device, rank_id=rank_id, group_size=group_size,
                  conv_implementation=conv_implementation)


class _LogFileHandler(logging.FileHandler):
    """A log file that, on a full disk, says so in one line (once) instead of logging's traceback per record.

    The run goes on: the terminal still gets every line, space may be freed before the next save, and a save
    that fails stops the run with its own one-line error (src.atomic_file)."""

    warned = False

    def handleError(self, record: logging.LogRecord) -> None:
        cause = disk_full_cause(sys.exc_info()[1])
        if cause is None:
            super().handleError(record)
            return
        if not self.warned:
            self.warned = True
            full = DiskFullError(Path(self.baseFilename), cause)
            print(f"warning: {full.problem}: {full.fix}; training goes on, but {Path(self.baseFilename).name} "
                  "misses its lines until then", file=sys.stderr, flush=True)


def get_logger(output_path: Optional[str] = None, log_name: str = "train.log", rank_id: int = 0) -> logging.Logger:
    """Logs to the terminal and, on rank 0, to output_path/log_name."""
    logger = logging.getLogger("resnet")
    logger.setLevel(logging.INFO)
    logger.propagate = False
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
        handler.close()
    prefix = "[scheduler] " if rank_id == SCHEDULER_RANK else (f"[rank {rank_id}] " if rank_id else "")
    formatter = logging.Formatter(f"%(asctime)s {prefix}%(message)s", "%Y-%m-%d %H:%M:%S")
    console = logging.StreamHandler(sys.stdout)
    console.setFormatter(formatter)
    logger.addHandler(console)
    if output_path and rank_id == 0:
        Path(output_path).mkdir(parents=True, exist_ok=True)
        file_handler = _LogFileHandler(Path(output_path) / log_name, encoding="utf-8")
        file_handler.setFormatter(formatter)
        logger.addHandler(file_handler)
    return logger
