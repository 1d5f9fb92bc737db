"""The training loop: epochs of TrainOneStepCell steps, evaluation, checkpoints, metrics.csv, curves,
resuming and saving on SIGINT/SIGTERM."""
import hashlib
import logging
import math
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import numpy as np
import mindspore as ms
from mindspore import nn

from src.collectives import all_reduce_sum, barrier
from src.data_source import DataSource, prepare_data
from src.dataset import create_dataset
from src.errors import UserError
from src.evaluation import EvalResult, average_batchnorm_statistics, evaluate
from src.fused_inference import inference_network
from src.lr_schedule import schedule_from_config
from src.metrics_file import MetricsFile
from src.plotting import plot_training_curves
from src.profiling import StepProfiler
from src.resnet import build_resnet
from src.utils import RunEnv
from src.weights.files import link_or_copy_atomic, read_checkpoint, save_checkpoint_atomic
from src.weights.loading import network_weights
from src.weights.pretrained import load_pretrained

STATE_KEYS = ("epoch_num", "step_in_epoch", "steps_per_epoch", "best_top1", "epoch_loss_sum")


@dataclass
class TrainingState:
    """Where a run is: epoch_num epochs done, step_in_epoch steps into the next one."""
    epoch_num: int = 0
    step_in_epoch: int = 0
    best_top1: float = -1.0
    epoch_loss_sum: float = 0.0  # summed step losses of the unfinished epoch


class TrainingInterrupted(Exception):
    """Raised after a signal stopped training and a resumable checkpoint was written."""

    def __init__(self, signum: int, checkpoint: Optional[Path]) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.checkpoint = checkpoint

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class StopOnSignal:
    """Turns the first SIGINT/SIGTERM into a flag read between steps; a second one acts as usual."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.signum: Optional[int] = None
        self._previous: Dict[int, Any] = {}

    def __enter__(self) -> "StopOnSignal":
        for signum in self.SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def _handle(self, signum: int, frame) -> None:
        del frame
        self.signum = signum
        for other, handler in self._previous.items():  # a second signal is not caught again
            signal.signal(other, handler)

    def __exit__(self, *exc_info) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


def weights_digest(net: nn.Cell) -> str:
    """SHA-256 over every parameter (name, then bytes), in a fixed order."""
    digest = hashlib.sha256()
    for param in sorted(net.get_parameters(), key=lambda p: p.name):
        digest.update(param.name.encode())
        digest.update(np.ascontiguousarray(param.asnumpy()).tobytes())
    return digest.hexdigest()


def resolve_amp(config, device: str, logger: logging.Logger) -> Tuple[str, Optional[float]]:
    """(amp level, static loss scale or None). CPU runs O0: oneDNN computes convolutions in fp32 anyway."""
    if config.amp_level == "O0":
        return "O0", None
    if device == "CPU":
        logger.info("amp_level %s: CPU trains in fp32 (O0) instead, fp16 gives no speed there", config.amp_level)
        return "O0", None
    return config.amp_level, config.loss_scale


def build_optimizer(config, params, learning_rates: np.ndarray) -> nn.Optimizer:
    """Adam or momentum SGD over params, with weight decay on every parameter as in torch.optim.

    The parameters go in as one group: given a plain list, MindSpore's optimizers skip weight decay for
    BatchNorm gamma/beta, which the reference's torch.optim.Adam does not.
    """
    lr = ms.Tensor(learning_rates)
    group = [{"params": list(params), "weight_decay": config.weight_decay}]
    if config.optimizer == "adam":
        return nn.Adam(group, learning_rate=lr)
    return nn.Momentum(group, learning_rate=lr, momentum=config.momentum)


def build_train_step(net: nn.Cell, optimizer: nn.Optimizer, config, amp_level: str,
                     loss_scale: Optional[float]) -> nn.Cell:
    loss_fn = nn.CrossEntropyLoss(label_smoothing=config.label_smoothing)
    manager = ms.amp.FixedLossScaleManager(loss_scale, drop_overflow_update=False) if loss_scale else None
    kwargs = {"loss_scale_manager": manager} if manager else {}
    train_step = ms.amp.build_train_network(net, optimizer, loss_fn, level=amp_level, **kwargs)
    train_step.set_train()
    return train_step


def restore_training_state(path: str, net: nn.Cell, train_step: nn.Cell, config,
                           steps_per_epoch: int) -> TrainingState:
    """Loads weights, optimizer state and the global step from a train.py checkpoint."""
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
    missing = [name for name in wanted if name not in entries]
    if missing:
        raise UserError(f"checkpoint {path} lacks optimizer state for this run ({len(missing)} entries such as "
                        f"{missing[0]}): resume with the optimizer it was trained with")
    ms.load_param_into_net(train_step, {name: entries[name] for name in wanted}, strict_load=True)
    return TrainingState(epoch_num=int(entries["epoch_num"].asnumpy()),
                         step_in_epoch=int(entries["step_in_epoch"].asnumpy()),
                         best_top1=float(entries["best_top1"].asnumpy()),
                         epoch_loss_sum=float(entries["epoch_loss_sum"].asnumpy()))


class CheckpointWriter:
    """Writes {model}-epochNNN.ckpt (keeping keep_checkpoint_max), -last, -best and -interrupted."""

    def __init__(self, output_path: str, config, steps_per_epoch: int) -> None:
        self.folder = Path(output_path)
        self.model_name = config.model_name
        self.keep = config.keep_checkpoint_max
        self.fixed = {"model_name": config.model_name, "class_num": config.class_num,
                      "steps_per_epoch": steps_per_epoch}

    def path(self, tag: str) -> Path:
        return self.folder / f"{self.model_name}-{tag}.ckpt"

    def _save(self, train_step: nn.Cell, path: Path, state: TrainingState) -> Path:
        extra = dict(self.fixed, epoch_num=state.epoch_num, step_in_epoch=state.step_in_epoch,
                     best_top1=float(state.best_top1), epoch_loss_sum=float(state.epoch_loss_sum))
        return save_checkpoint_atomic(train_step, str(path), append_dict=extra)

    def save_epoch(self, train_step: nn.Cell, state: TrainingState, is_best: bool) -> Path:
        path = self._save(train_step, self.path(f"epoch{state.epoch_num:03d}"), state)
        link_or_copy_atomic(path, self.path("last"))
        if is_best:
            link_or_copy_atomic(path, self.path("best"))
        epoch_files = sorted(self.folder.glob(f"{self.model_name}-epoch[0-9][0-9][0-9].ckpt"))
        for old in epoch_files[:-self.keep]:
            old.unlink(missing_ok=True)
        return path

    def save_interrupted(self, train_step: nn.Cell, state: TrainingState) -> Path:
        return self._save(train_step, self.path("interrupted"), state)


class Trainer:
    """One training run as configured; run() returns when epoch_size epochs are done."""

    def __init__(self, config, env: RunEnv, logger: logging.Logger) -> None:
        self.config = config
        self.env = env
        self.logger = logger
        self.data: DataSource = prepare_data(config, logger, training=True)
        logger.info("data: %s", self.data.describe())
        self.image_size = (config.image_height, config.image_width)
        self.steps_per_epoch = self.train_dataset(epoch=0).get_dataset_size()
        self.profiler = StepProfiler.from_config(config, env, logger, self.steps_per_epoch)  # checks it early
        self.eval_dataset = create_dataset(self.data.eval_path, False, config.batch_size, self.image_size,
                                           env.group_size, env.rank_id, config.eval_num_samples,
                                           config.num_parallel_workers, config.seed)
        self.net = build_resnet(config.model_name, config.class_num, config.zero_init_residual,
                                env.conv_implementation)
        load_pretrained(self.net, config, logger)  # --pretrained weights; the --resume file's checkpoint_sha256
        self.inference_net: Optional[nn.Cell] = None  # what evaluation runs: see _evaluate_if_due
        self.learning_rates = schedule_from_config(config, self.steps_per_epoch)
        self.optimizer = build_optimizer(config, self.net.trainable_params(), self.learning_rates)
        amp_level, loss_scale = resolve_amp(config, env.device_target, logger)
        self.train_step = build_train_step(self.net, self.optimizer, config, amp_level, loss_scale)
        self.sink_mode = config.dataset_sink_mode and env.device_target != "CPU"
        if config.dataset_sink_mode and not self.sink_mode:
            logger.info("dataset_sink_mode: MindSpore sinks data on Ascend and GPU only; CPU feeds batches from Python")
        self.state = TrainingState()
        if config.resume:
            self.state = restore_training_state(config.resume, self.net, self.train_step, config,
                                                self.steps_per_epoch)
            logger.info("resumed from %s at epoch %d step %d", config.resume, self.state.epoch_num + 1,
                        self.state.step_in_epoch)
        self.checkpoints = CheckpointWriter(config.output_path, config, self.steps_per_epoch)
        self.metrics = MetricsFile(str(Path(config.output_path) / "metrics.csv"),
                                   keep_epochs_up_to=self.state.epoch_num if config.resume else None)

    def train_dataset(self, epoch: int, skip_batches: int = 0):
        config = self.config
        return create_dataset(self.data.train_path, True, config.batch_size, self.image_size, self.env.group_size,
                              self.env.rank_id, config.train_num_samples, config.num_parallel_workers,
                              config.seed, epoch, skip_batches)

    def run(self) -> TrainingState:
        config, state = self.config, self.state
        self.logger.info("python %s, MindSpore %s", sys.executable, ms.__version__)
        self.logger.info("training %s (%d classes) for %d epochs of %d steps, batch %d x %d device(s), %s, "
                         "%s optimizer, lr %g (%s)", config.model_name, config.class_num, config.epoch_size,
                         self.steps_per_epoch, config.batch_size, self.env.group_size, self.env.device_target,
                         config.optimizer, config.lr, config.lr_schedule)
        if state.epoch_num >= config.epoch_size:
            self.logger.info("nothing to do: the checkpoint has finished %d of %d epochs (raise --epoch_size to "
                             "train on)", state.epoch_num, config.epoch_size)
            return state
        with StopOnSignal() as stop, self.profiler:  # the profiler is stopped even if training stops early
            while state.epoch_num < config.epoch_size:
                self._train_epoch(stop)
        # Every rank logs it: equal digests show data-parallel ranks ended with identical weights.
        self.logger.info("final weights sha256 %s", weights_digest(self.net))
        return state

    def _step_function(self, dataset):
        """A callable running one step and returning the loss: fed from Python or from the device queue."""
        if self.sink_mode:
            sink = ms.data_sink(self.train_step, dataset, sink_size=1)
            return lambda: sink(), dataset.get_dataset_size()
        iterator = dataset.create_tuple_iterator(num_epochs=1)
        return lambda: self.train_step(*next(iterator)), dataset.get_dataset_size()

    def _train_epoch(self, stop: StopOnSignal) -> None:
        config, state, logger = self.config, self.state, self.logger
        epoch = state.epoch_num
        first_step = state.step_in_epoch
        dataset = self.train_dataset(epoch, skip_batches=first_step)
        run_step, steps = self._step_function(dataset)
        self.profiler.epoch_started(epoch, steps)
        images_per_step = config.batch_size * self.env.group_size
        started = last_report = time.perf_counter()
        last_reported_step = first_step
        for step in range(first_step, first_step + steps):
            output = run_step()
            loss = float((output[0] if isinstance(output, tuple) else output).asnumpy())
            self.profiler.step_done()  # after asnumpy(): the step's ops have all run
            if not math.isfinite(loss):
                raise UserError(f"training diverged: loss is {loss} at epoch {epoch + 1} step {step + 1}; lower --lr "
                                "or add --warmup_epochs")
            state.epoch_loss_sum += loss
            state.step_in_epoch = step + 1
            if state.step_in_epoch % config.log_interval == 0 or state.step_in_epoch == self.steps_per_epoch:
                now = time.perf_counter()
                logger.info("epoch %d/%d step %d/%d loss %.4f lr %.6g %.1f images/s", epoch + 1, config.epoch_size,
                            state.step_in_epoch, self.steps_per_epoch, loss,
                            self.learning_rates[epoch * self.steps_per_epoch + step],
                            (state.step_in_epoch - last_reported_step) * images_per_step / max(now - last_report, 1e-9))
                last_report, last_reported_step = now, state.step_in_epoch
            signum = self._agreed_stop(stop)
            if signum is not None:
                self._stop(signum, save=True)
        seconds = time.perf_counter() - started
        train_loss = state.epoch_loss_sum / self.steps_per_epoch
        state.epoch_num, state.step_in_epoch, state.epoch_loss_sum = epoch + 1, 0, 0.0
        average_batchnorm_statistics(self.net, self.env.group_size)  # before evaluating and saving
        result = self._evaluate_if_due()
        self._record_epoch(train_loss, seconds, (self.steps_per_epoch - first_step) * images_per_step, result)
        signum = self._agreed_stop(stop)
        if signum is not None:  # arrived during evaluation: the epoch checkpoint is the resume point
            self._stop(signum, save=False)

    def _agreed_stop(self, stop: StopOnSignal) -> Optional[int]:
        """The signal that stops training, agreed by all ranks so they all stop after the same step.

        A launcher sends SIGTERM to every worker, but not at the same instant: a rank that saw no signal
        yet stops too. Ranks count [saw SIGINT, saw SIGTERM] (MindSpore's CPU AllReduce only sums); any
        SIGTERM wins. Costs one tiny all-reduce per step.
        """
        if not self.env.distributed:
            return stop.signum
        seen = np.array([stop.signum == signal.SIGINT, stop.signum == signal.SIGTERM], np.float32)
        saw_int, saw_term = all_reduce_sum(seen)
        if saw_term:
            return signal.SIGTERM
        return signal.SIGINT if saw_int else None

    def _evaluate_if_due(self) -> Optional[EvalResult]:
        epoch = self.state.epoch_num
        if epoch % self.config.eval_interval and epoch != self.config.epoch_size:
            return None
        started = time.perf_counter()
        # The fused inference network is built once and refreshed with the current weights each time.
        self.inference_net = inference_network(self.net, self.inference_net)
        result = evaluate(self.inference_net, self.eval_dataset, self.config.class_num, self.env.group_size)
        self.train_step.set_train(True)
        self.logger.info("epoch %d eval: top-1 %.4f top-5 %.4f loss %.4f on %d images (%.1f s)%s", epoch, result.top1,
                         result.top5, result.loss, result.num_samples, time.perf_counter() - started,
                         " [SYNTHETIC data]" if self.data.synthetic else "")
        return result

    def _record_epoch(self, train_loss: float, seconds: float, images: int, result: Optional[EvalResult]) -> None:
        state = self.state
        is_best = result is not None and result.top1 > state.best_top1
        if is_best:
            state.best_top1 = result.top1
        if not self.env.is_main_rank:
            return
        path = self.checkpoints.save_epoch(self.train_step, state, is_best)
        self.metrics.append({
            "epoch": state.epoch_num,
            "lr": float(self.learning_rates[state.epoch_num * self.steps_per_epoch - 1]),
            "train_loss": train_loss,
            "eval_loss": result.loss if result else None,
            "top1": result.top1 if result else None,
            "top5": result.top5 if result else None,
            "epoch_seconds": seconds,
            "images_per_second": images / max(seconds, 1e-9),
        })
        plot_training_curves(self.metrics.rows, str(Path(self.config.output_path) / "training_curves.png"))
        self.logger.info("epoch %d done in %.1f s (train loss %.4f); saved %s%s", state.epoch_num, seconds, train_loss,
                         path, " (best so far)" if is_best else "")

    def _stop(self, signum: int, save: bool) -> None:
        """Saves the resume point (rank 0), logs it on every rank and ends the run."""
        checkpoint = self.checkpoints.path("interrupted" if save else "last")
        if save:
            # Each rank's moving statistics hold its own batches; their moving averages are linear in the
            # starting value, so resuming every rank from the average ends where the uninterrupted run does.
            average_batchnorm_statistics(self.net, self.env.group_size)
            if self.env.is_main_rank:
                self.checkpoints.save_interrupted(self.train_step, self.state)
        if self.env.distributed:
            barrier()  # the other ranks exit only after rank 0 has saved (a launcher kills the rest then)
        # MindSpore's graph runtime re-raises Ctrl-C during a step as SIGTERM: say so rather than confuse.
        note = " (from a launcher, or a Ctrl-C that MindSpore re-raised as SIGTERM)" if signum == signal.SIGTERM else ""
        self.logger.info("stopped by %s%s at epoch %d step %d; resume with --resume %s", signal.Signals(signum).name,
                         note, self.state.epoch_num + 1, self.state.step_in_epoch, checkpoint)
        raise TrainingInterrupted(signum, checkpoint)


def run_training(config, env: RunEnv, logger: logging.Logger) -> int:
    """Trains as configured; returns the process exit code (128 + signal number when interrupted)."""
    try:
        Trainer(config, env, logger).run()
    except TrainingInterrupted as stopped:
        return stopped.exit_code
    return 0
