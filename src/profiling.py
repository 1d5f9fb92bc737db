"""--enable_profiling: MindSpore's profiler over a few training steps after the compiling one, written to
output_path/profiler/. Training goes on unchanged afterwards.

Uses mindspore.profiler.profile with a schedule: step 1 compiles the graph (skipped), step 2 warms the
profiler up, the next ACTIVE_STEPS steps are recorded; then tensorboard_trace_handler analyses them at
once, so the files are complete while training continues.
"""
import csv
import logging
import re
from pathlib import Path
from typing import List, Optional

from src.errors import UserError

SKIP_STEPS = 1  # the first step of a run compiles the graph: not what a step costs
WARMUP_STEPS = 1  # the profiler starts collecting here but keeps nothing (MindSpore's warm-up)
ACTIVE_STEPS = 3  # recorded; fewer when the epoch is shorter
MIN_STEPS = SKIP_STEPS + WARMUP_STEPS + 1
FOLDER_NAME = "profiler"
# The characters MindSpore's profiler accepts in its output path (mindspore/profiler/common/path_manager.py).
# It does not fail on others: it logs an error and writes to ./data instead, so we refuse them up front.
_PATH_CHARACTER = re.compile(r"[._/\s~0-9a-zA-Z\u4e00-\u9fa5-]")
# The file to read first, in order of preference (Ascend/GPU write op_statistic.csv; CPU the FRAMEWORK tables).
FIRST_FILES = ("ASCEND_PROFILER_OUTPUT/op_statistic.csv", "FRAMEWORK/cpu_op_type_info_*.csv",
               "ASCEND_PROFILER_OUTPUT/trace_view.json")
TRACE_FILE = "ASCEND_PROFILER_OUTPUT/trace_view.json"


def profiler_folder(output_path: str) -> Path:
    return Path(output_path) / FOLDER_NAME


def check_profiler_folder(folder: Path) -> Path:
    """Creates folder and returns its resolved path; refuses one the profiler would not (or could not) write."""
    resolved = Path(folder).expanduser().resolve()
    bad = sorted({char for char in str(resolved) if not _PATH_CHARACTER.fullmatch(char)})
    if bad:
        raise UserError(f"enable_profiling: MindSpore's profiler refuses the output folder {resolved} (it has "
                        f"{' '.join(repr(c) for c in bad)}; allowed are letters, digits, spaces and . _ - / ~): "
                        "choose another --output_path")
    try:
        resolved.mkdir(parents=True, exist_ok=True)
        probe = resolved / ".write_test"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise UserError(f"enable_profiling: cannot write the profiler output folder {resolved} "
                        f"({exc.strerror or exc}): choose a writable --output_path") from None
    return resolved


def top_op_types(table: Path, count: int = 3) -> List[str]:
    """'Conv2DBackpropFilter 43%' for the op types taking the most time in a CPU cpu_op_type_info csv."""
    try:
        with open(table, newline="", encoding="utf-8") as handle:
            rows = [(row["op_type"], float(row["percent"])) for row in csv.DictReader(handle)]
    except (OSError, KeyError, ValueError):
        return []
    rows.sort(key=lambda row: row[1], reverse=True)
    return [f"{name} {share:.0%}" for name, share in rows[:count]]


class StepProfiler:
    """Profiles ACTIVE_STEPS training steps of the first epoch that has enough of them; a no-op when disabled.

    The trainer calls epoch_started(steps) before an epoch, step_done() after each step and uses it as a
    context manager around training, so an interrupted run still stops (and analyses) the profiler.
    """

    def __init__(self, folder: Optional[Path], device_target: str, rank_id: int, logger: logging.Logger) -> None:
        self.folder = folder  # None: disabled (the key is off, or not rank 0)
        self.device_target = device_target
        self.rank_id = rank_id
        self.logger = logger
        self._profile = None
        self._steps_done = 0
        self._steps_wanted = 0
        self._epoch = 0

    @classmethod
    def from_config(cls, config, env, logger: logging.Logger, steps_per_epoch: int) -> "StepProfiler":
        """Checks the settings (one UserError line for a bad one) and returns the profiler for this process."""
        if not config.enable_profiling:
            return cls(None, env.device_target, env.rank_id, logger)
        if steps_per_epoch < MIN_STEPS:
            raise UserError(f"enable_profiling needs at least {MIN_STEPS} training steps per epoch (one compiles, "
                            f"one warms the profiler up, the rest are recorded); this run has {steps_per_epoch}: "
                            "raise --train_num_samples or lower --batch_size")
        if not env.is_main_rank:
            # Rank 0 only: data-parallel ranks run the same graph on the same shapes, output_path is shared
            # and only rank 0 writes there, and on one host N analyses at once would slow every rank.
            return cls(None, env.device_target, env.rank_id, logger)
        return cls(check_profiler_folder(profiler_folder(config.output_path)), env.device_target, env.rank_id, logger)

    def epoch_started(self, epoch: int, steps: int) -> None:
        """Starts profiling with this epoch if it is the first one with enough steps left (after a resume)."""
        if self.folder is None or self._steps_wanted or steps < MIN_STEPS:
            return
        from mindspore.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler
        activities = {"CPU": [ProfilerActivity.CPU], "GPU": [ProfilerActivity.CPU, ProfilerActivity.GPU],
                      "Ascend": [ProfilerActivity.CPU, ProfilerActivity.NPU]}[self.device_target]
        active = min(ACTIVE_STEPS, steps - SKIP_STEPS - WARMUP_STEPS)
        # The handler analyses the recorded steps as soon as the last one ends (the CPU profiler writes only
        # raw timestamps before that); it must be created before profile().
        handler = tensorboard_trace_handler(str(self.folder), worker_name=f"rank{self.rank_id}")
        self._profile = profile(activities=activities, on_trace_ready=handler,
                                schedule=schedule(skip_first=SKIP_STEPS, wait=0, warmup=WARMUP_STEPS,
                                                  active=active, repeat=1))
        self._steps_wanted = SKIP_STEPS + WARMUP_STEPS + active
        self._epoch = epoch
        self.logger.info("profiler: recording %d steps of epoch %d after %d compile and %d warm-up step(s)",
                         active, epoch + 1, SKIP_STEPS, WARMUP_STEPS)

    def step_done(self) -> None:
        """After each training step (the loss has been read, so the step's ops have run)."""
        if self._profile is None:
            return
        self._profile.step()  # after the last recorded step this analyses and writes the files
        self._steps_done += 1
        if self._steps_done >= self._steps_wanted:
            self._finish()

    def __enter__(self) -> "StepProfiler":
        return self

    def __exit__(self, *exc_info) -> None:
        if self._profile is not None:  # training stopped early: keep (and analyse) what was recorded
            self._finish()
        elif self.folder is not None and not self._steps_wanted:
            self.logger.info("profiler: nothing recorded, no epoch of this run had %d steps left to train", MIN_STEPS)

    def _finish(self) -> None:
        self._profile.stop()
        self._profile = None
        recorded = max(self._steps_done - SKIP_STEPS - WARMUP_STEPS, 0)
        if not recorded:  # stopped before the first recorded step: MindSpore deletes its folder
            self.logger.info("profiler: stopped before any step was recorded")
            return
        runs = sorted(self.folder.glob(f"rank{self.rank_id}_*_ascend_ms"), key=lambda path: path.stat().st_mtime)
        first = next((found for pattern in FIRST_FILES for found in sorted(runs[-1].glob(pattern))), None) \
            if runs else None  # runs[-1]: the newest, this run's (an earlier run's stay beside it)
        if first is None:
            self.logger.warning("profiler: %d step(s) recorded but no analysed output under %s (MindSpore's "
                                "profiler logs are in its logs/ folder)", recorded, self.folder)
            return
        if first.suffix == ".json":
            what = "the timeline, for ui.perfetto.dev"
        else:
            top = top_op_types(first) if first.name.startswith("cpu_op_type_info") else []
            what = "time per op type" + (f": {', '.join(top)}" if top else "")
            if (runs[-1] / TRACE_FILE).is_file():
                what += f"; the timeline is {TRACE_FILE}, for ui.perfetto.dev"
        self.logger.info("profiler: %d step(s) of epoch %d written to %s; open %s first (%s)", recorded,
                         self._epoch + 1, runs[-1], first.relative_to(runs[-1]), what)
