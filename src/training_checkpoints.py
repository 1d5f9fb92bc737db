"""train.py's checkpoints: the training state they carry, writing them (per epoch, every N steps, on a signal)
with rotation, and restoring a run from one (--resume)."""
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

import mindspore as ms
from mindspore import nn

from src.ema import WeightsEma
from src.errors import UserError
from src.train_step import LOSS_SCALE_STATE
from src.weights.files import link_or_copy_atomic, read_checkpoint, save_checkpoint_atomic
from src.weights.loading import network_weights

STATE_KEYS = ("epoch_num", "step_in_epoch", "steps_per_epoch", "best_top1", "epoch_loss_sum")
# Added later than STATE_KEYS: a checkpoint without it resumes with 0.
OPTIONAL_STATE_KEYS = ("epoch_skipped_steps",)


@dataclass
class TrainingState:
    """Where a run is: epoch_num epochs done, step_in_epoch steps into the next one."""
    epoch_num: int = 0
    step_in_epoch: int = 0
    best_top1: float = -1.0
    epoch_loss_sum: float = 0.0  # summed losses of the unfinished epoch's steps that updated the weights
    epoch_skipped_steps: int = 0  # steps of the unfinished epoch skipped for a loss-scale overflow


def restore_training_state(path: str, net: nn.Cell, train_step: nn.Cell, config, steps_per_epoch: int,
                           logger: logging.Logger, ema: Optional[WeightsEma] = None) -> TrainingState:
    """Loads weights, optimizer state, the loss-scale state, the EMA (when ema is given) and the global step from a
    train.py checkpoint."""
    entries = read_checkpoint(path)
    if not all(key in entries for key in STATE_KEYS):
        raise UserError(f"checkpoint {path} has no training state (epoch, step, optimizer): --resume takes a "
                        "checkpoint written by train.py")
    network_weights(entries, net, path, config.model_name)  # checks architecture and head first
    saved_steps = int(entries["steps_per_epoch"].asnumpy())
    if saved_steps != steps_per_epoch:
        raise UserError(f"checkpoint {path} was written with {saved_steps} steps per epoch, this run has "
                        f"{steps_per_epoch}: resume with the same batch_size, train_num_samples and device count")
    # The schedule is rebuilt from the config (epoch_size may grow); the global step keeps its position.
    wanted = {p.name: p for p in train_step.get_parameters() if p.name != "learning_rate"}
    missing = [name for name in wanted if name not in entries and name not in LOSS_SCALE_STATE]
    if missing:
        raise UserError(f"checkpoint {path} lacks optimizer state for this run ({len(missing)} entries such as "
                        f"{missing[0]}): resume with the optimizer it was trained with")
    fresh = [name for name in wanted if name not in entries]
    if fresh:  # e.g. a float32 run resumed with loss scaling: the scale starts at the configured value
        logger.info("checkpoint %s has no loss-scale state: starting it from --loss_scale %g", path, config.loss_scale)
    ms.load_param_into_net(train_step, {name: entries[name] for name in wanted if name in entries}, strict_load=True)
    if ema is not None and not ema.load(entries):
        ema.restart_from_sources()
        logger.info("checkpoint %s has no EMA weights: the EMA starts from its weights", path)
    optional = {key: entries[key].asnumpy() if key in entries else 0 for key in OPTIONAL_STATE_KEYS}
    return TrainingState(epoch_num=int(entries["epoch_num"].asnumpy()),
                         step_in_epoch=int(entries["step_in_epoch"].asnumpy()),
                         best_top1=float(entries["best_top1"].asnumpy()),
                         epoch_loss_sum=float(entries["epoch_loss_sum"].asnumpy()),
                         epoch_skipped_steps=int(optional["epoch_skipped_steps"]))


class CheckpointWriter:
    """Writes {model}-epochNNN.ckpt at the end of epoch NNN and {model}-epochNNN-stepSSSSS.ckpt SSSSS steps into
    epoch NNN (save_checkpoint_steps), keeping the newest keep_checkpoint_max of them; {model}-last.ckpt is the
    newest of either, {model}-best.ckpt the best evaluated epoch, {model}-interrupted.ckpt the signal's resume
    point. Every file is written atomically (src.atomic_file): a crash leaves the previous ones intact."""

    ROTATED = re.compile(r"-epoch(\d{3,})(?:-step(\d{5,}))?\.ckpt$")

    def __init__(self, output_path: str, config, steps_per_epoch: int,
                 extra_parameters: Sequence[ms.Parameter] = ()) -> None:
        self.folder = Path(output_path)
        self.extra_parameters = list(extra_parameters)  # saved beside train_step's (the EMA's averages)
        self.model_name = config.model_name
        self.keep = config.keep_checkpoint_max
        # stem and the input size: eval.py, export.py and predict.py take them from here (RECORDED_KEYS).
        self.fixed = {"model_name": config.model_name, "class_num": config.class_num,
                      "steps_per_epoch": steps_per_epoch, "stem": config.stem,
                      "image_height": config.image_height, "image_width": config.image_width}

    def path(self, tag: str) -> Path:
        return self.folder / f"{self.model_name}-{tag}.ckpt"

    def _save(self, train_step: nn.Cell, path: Path, state: TrainingState) -> Path:
        extra = dict(self.fixed, epoch_num=state.epoch_num, step_in_epoch=state.step_in_epoch,
                     best_top1=float(state.best_top1), epoch_loss_sum=float(state.epoch_loss_sum),
                     epoch_skipped_steps=state.epoch_skipped_steps)
        source = [{"name": param.name, "data": param}
                  for param in [*train_step.get_parameters(), *self.extra_parameters]]
        return save_checkpoint_atomic(source, str(path), append_dict=extra)

    def rotated_files(self) -> List[Path]:
        """This model's epoch and step checkpoints in output_path, oldest first."""
        found: List[Tuple[Tuple[int, int], Path]] = []
        for path in self.folder.glob(f"{self.model_name}-epoch*.ckpt"):
            match = self.ROTATED.search(path.name)
            if match and path.name == f"{self.model_name}{match.group(0)}":
                epoch, step = int(match.group(1)), int(match.group(2) or 0)
                # epochNNN is the end of epoch NNN; epochNNN-stepS lies inside it, before its end.
                found.append(((epoch, step if step else 1 << 62), path))
        return [path for _, path in sorted(found)]

    def _rotate_and_link(self, path: Path, is_best: bool) -> Path:
        link_or_copy_atomic(path, self.path("last"))
        if is_best:
            link_or_copy_atomic(path, self.path("best"))
        for old in self.rotated_files()[:-self.keep]:
            old.unlink(missing_ok=True)
        return path

    def save_epoch(self, train_step: nn.Cell, state: TrainingState, is_best: bool) -> Path:
        path = self._save(train_step, self.path(f"epoch{state.epoch_num:03d}"), state)
        return self._rotate_and_link(path, is_best)

    def save_step(self, train_step: nn.Cell, state: TrainingState) -> Path:
        """A resumable checkpoint state.step_in_epoch steps into epoch state.epoch_num + 1."""
        path = self._save(train_step, self.path(f"epoch{state.epoch_num + 1:03d}-step{state.step_in_epoch:05d}"),
                          state)
        return self._rotate_and_link(path, is_best=False)

    def save_interrupted(self, train_step: nn.Cell, state: TrainingState) -> Path:
        return self._save(train_step, self.path("interrupted"), state)
