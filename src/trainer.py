"""The training loop: epochs of TrainOneStepCell steps, evaluation, checkpoints, metrics.csv, curves,
resuming and saving on SIGINT/SIGTERM."""
import hashlib
import logging
import math
import signal
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Tuple

import numpy as np
import mindspore as ms
from mindspore import nn

from src.augmentation import Augmentation
from src.collectives import all_reduce_sum, barrier
from src.data_source import DataSource, prepare_data
from src.dataset import create_dataset
from src.ema import WeightsEma
from src.errors import UserError
from src.evaluation import EvalResult, average_batchnorm_statistics, evaluate
from src.fused_inference import inference_network
from src.lr_schedule import schedule_from_config
from src.metrics_file import MetricsFile
from src.native_optimizer import NativeAdam, NativeMomentum, NativeNesterovSGD, gradients_in_kernel_layout
from src.process_memory import return_freed_heap
from src.profiling import StepProfiler
from src.resnet import build_resnet
from src.train_step import build_train_step, resolve_amp, update_alone_reads_gradients
from src.training_checkpoints import CheckpointWriter, TrainingState, restore_training_state
from src.utils import RunEnv
from src.weights.pretrained import load_pretrained

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


def build_optimizer(config, params, learning_rates: np.ndarray, native: bool = False,
                    gradients_from: Optional[nn.Cell] = None, gradient_windows: bool = False) -> nn.Optimizer:
    """Adam or momentum SGD (Nesterov with config.nesterov) over params, with weight decay on every parameter as in
    torch.optim, or, with config.no_weight_decay_bn_bias, on every parameter but BatchNorm's and biases (1-D ones).
    native (the native library in use, float32 parameters on CPU): the update, decay included, runs as one native
    pass (src/native_optimizer.py), with the results of the MindSpore optimizer it stands for; gradients_from (the
    network of params, in a single-process run) then hands it its convolutions' weight gradients in their kernels'
    layout, and with gradient_windows (only where the update alone reads them: update_alone_reads_gradients) as
    windows of taps where only those meet the input (gradients_in_kernel_layout).

    The parameters go in as explicit groups: given a plain list, MindSpore's optimizers skip weight decay for
    BatchNorm gamma/beta, which the reference's torch.optim.Adam does not.
    """
    lr = ms.Tensor(learning_rates)
    params = list(params)
    if config.no_weight_decay_bn_bias:
        decayed = [p for p in params if len(p.shape) > 1]
        group = [{"params": decayed, "weight_decay": config.weight_decay},
                 {"params": [p for p in params if len(p.shape) <= 1], "weight_decay": 0.0}]
    else:
        group = [{"params": params, "weight_decay": config.weight_decay}]
    if not native:
        if config.optimizer == "adam":
            return nn.Adam(group, learning_rate=lr)
        if config.nesterov:
            # nn.SGD: MindSpore 2.10's nn.Momentum ignores use_nesterov on CPU (its updates equal plain momentum's);
            # nn.SGD's match torch.optim.SGD(nesterov=True) (tests/test_optimizer.py).
            return nn.SGD(group, learning_rate=lr, momentum=config.momentum, nesterov=True)
        return nn.Momentum(group, learning_rate=lr, momentum=config.momentum)
    if config.optimizer == "adam":
        optimizer = NativeAdam(group, learning_rate=lr)
    elif config.nesterov:
        optimizer = NativeNesterovSGD(group, learning_rate=lr, momentum=config.momentum)
    else:
        optimizer = NativeMomentum(group, learning_rate=lr, momentum=config.momentum)
    if gradients_from is not None:
        gradients_in_kernel_layout(gradients_from, optimizer, windows=gradient_windows)
    return optimizer


def native_update_allowed(config, conv_implementation: str) -> bool:
    """Whether the optimizer may be the native one (with the native library in use). It writes the weights in
    place, unseen by MindSpore's graph: nothing in the step's graph may read them after the update, and an EMA
    updated inside a sink's graph does (in graph mode it then read the weights from before the update)."""
    return conv_implementation == "onednn_blocked" and not (config.ema_decay > 0 and config.dataset_sink_mode)


class Trainer:
    """One training run as configured; run() returns when epoch_size epochs are done.

    Steps run in windows: the host reads the loss (device-side totals) once per window, at its end, and only
    there logs, writes step checkpoints and acts on signals. A window is one step when batches are fed from
    Python, a sink (sink_size steps, or the epoch) with dataset_sink_mode, and it ends early at a
    save_checkpoint_steps point and at the epoch's end.
    """

    def __init__(self, config, env: RunEnv, logger: logging.Logger) -> None:
        self.config = config
        self.env = env
        self.logger = logger
        self.data: DataSource = prepare_data(config, logger, training=True)
        logger.info("data: %s", self.data.describe())
        self.image_size = (config.image_height, config.image_width)
        self.augment = Augmentation.from_config(config)
        logger.info("augmentation: %s", self.augment.describe())
        self.steps_per_epoch = self.train_dataset(epoch=0).get_dataset_size()
        self.profiler = StepProfiler.from_config(config, env, logger, self.steps_per_epoch)  # checks it early
        self.eval_dataset = create_dataset(self.data.eval_path, False, config.batch_size, self.image_size,
                                           env.group_size, env.rank_id, config.eval_num_samples,
                                           config.num_parallel_workers, config.seed)
        self.net = build_resnet(config.model_name, config.class_num, config.zero_init_residual,
                                env.conv_implementation, config.stem)
        load_pretrained(self.net, config, logger)  # --pretrained weights; the --resume file's checkpoint_sha256
        self.inference_net: Optional[nn.Cell] = None  # what evaluation runs: see _evaluate_if_due
        self.ema = WeightsEma(self.net, config.ema_decay) if config.ema_decay > 0 else None
        self.ema_net: Optional[nn.Cell] = None  # a network holding the EMA's weights, to evaluate them
        self.ema_inference_net: Optional[nn.Cell] = None
        self.learning_rates = schedule_from_config(config, self.steps_per_epoch)
        self.amp = resolve_amp(config, env.device_target, logger)
        # Across processes the gradients are summed (all-reduce): they keep the plain layout there, which does not
        # depend on each machine's CPU.
        self.optimizer = build_optimizer(config, self.net.trainable_params(), self.learning_rates,
                                         native=native_update_allowed(config, env.conv_implementation),
                                         gradients_from=self.net if env.group_size == 1 else None,
                                         gradient_windows=update_alone_reads_gradients(config, self.amp))
        self.sink_mode = config.dataset_sink_mode
        self.step = build_train_step(self.net, self.optimizer, config, self.amp, sink=self.sink_mode, ema=self.ema)
        self.step_compiled = False
        self.device_queue = self.sink_mode and env.device_target != "CPU"
        if self.sink_mode:
            sink = f"sinks of {config.sink_size} steps" if config.sink_size > 0 else "one sink per epoch"
            if self.device_queue:
                logger.info("dataset_sink_mode: batches go through MindSpore's device queue, %s", sink)
            else:
                logger.info("dataset_sink_mode on CPU: %s with the loss read once per sink, as on a device, but "
                            "the batches come from Python (MindSpore has no device queue on CPU), so it is no "
                            "faster than without", sink)
        self.state = TrainingState()
        if config.resume:
            self.state = restore_training_state(config.resume, self.net, self.step.train_step, config,
                                                self.steps_per_epoch, logger, self.ema)
            logger.info("resumed from %s at epoch %d step %d", config.resume, self.state.epoch_num + 1,
                        self.state.step_in_epoch)
        self.checkpoints = CheckpointWriter(config.output_path, config, self.steps_per_epoch,
                                            self.ema.average_parameters() if self.ema else ())
        self.metrics = MetricsFile(str(Path(config.output_path) / "metrics.csv"),
                                   keep_epochs_up_to=self.state.epoch_num if config.resume else None)

    def train_dataset(self, epoch: int, skip_batches: int = 0):
        config = self.config
        return create_dataset(self.data.train_path, True, config.batch_size, self.image_size, self.env.group_size,
                              self.env.rank_id, config.train_num_samples, config.num_parallel_workers,
                              config.seed, epoch, skip_batches, self.augment)

    def run(self) -> TrainingState:
        config, state = self.config, self.state
        self.logger.info("python %s, MindSpore %s", sys.executable, ms.__version__)
        self.logger.info("training %s (%d classes) for %d epochs of %d steps, batch %d x %d device(s), %s, "
                         "%s, %s optimizer, lr %g (%s)", config.model_name, config.class_num, config.epoch_size,
                         self.steps_per_epoch, config.batch_size, self.env.group_size, self.env.device_target,
                         self.amp.describe(), config.optimizer, config.lr, config.lr_schedule)
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

    def _step_runner(self, dataset) -> Callable[[], Any]:
        """A callable running the next step on the next batch: from MindSpore's device queue, or fed from Python."""
        if self.device_queue:
            # sink_size 1 per call: the window's steps are launched back to back without reading anything back.
            return ms.data_sink(self.step, dataset, sink_size=1)
        iterator = dataset.create_tuple_iterator(num_epochs=1)
        return lambda: self.step(*next(iterator))

    def _window_end(self, step: int) -> int:
        """The step (within the epoch, exclusive) that the window starting at step runs to."""
        config, per_epoch = self.config, self.steps_per_epoch
        end = per_epoch
        if not self.sink_mode:
            end = step + 1
        elif config.sink_size > 0:
            end = min(end, (step // config.sink_size + 1) * config.sink_size)
        interval = config.save_checkpoint_steps
        if interval:
            global_step = self.state.epoch_num * per_epoch + step
            end = min(end, (global_step // interval + 1) * interval - self.state.epoch_num * per_epoch)
        return end

    def _train_epoch(self, stop: StopOnSignal) -> None:
        config, state, logger = self.config, self.state, self.logger
        epoch = state.epoch_num
        first_step = state.step_in_epoch
        run_step = self._step_runner(self.train_dataset(epoch, skip_batches=first_step))
        self.profiler.epoch_started(epoch, self.steps_per_epoch - first_step)
        images_per_step = config.batch_size * self.env.group_size
        started = last_report = time.perf_counter()
        last_reported_step = first_step
        report_loss_sum, report_skipped = 0.0, 0
        while state.step_in_epoch < self.steps_per_epoch:
            start, end = state.step_in_epoch, self._window_end(state.step_in_epoch)
            for _ in range(start, end):
                run_step()
                self.profiler.step_done()
            loss_sum, skipped = self.step.read_totals()  # the window's only wait for the device
            if not self.step_compiled:  # this window compiled the step: the compiler's freed heap goes back
                self.step_compiled = True
                return_freed_heap()
            self._check_window(loss_sum, skipped, start, end)
            state.epoch_loss_sum += loss_sum
            state.epoch_skipped_steps += skipped
            state.step_in_epoch = end
            report_loss_sum, report_skipped = report_loss_sum + loss_sum, report_skipped + skipped
            if end // config.log_interval > start // config.log_interval or end == self.steps_per_epoch:
                now = time.perf_counter()
                counted = end - last_reported_step - report_skipped
                scale = self.step.loss_scale()
                logger.info("epoch %d/%d step %d/%d loss %s lr %.6g %.2f images/s%s", epoch + 1, config.epoch_size,
                            end, self.steps_per_epoch, f"{report_loss_sum / counted:.4f}" if counted else "n/a",
                            self.learning_rates[epoch * self.steps_per_epoch + end - 1],
                            (end - last_reported_step) * images_per_step / max(now - last_report, 1e-9),
                            "" if scale is None else f" loss scale {scale:g}"
                            + (f", {report_skipped} step(s) skipped for overflow" if report_skipped else ""))
                last_report, last_reported_step = now, end
                report_loss_sum, report_skipped = 0.0, 0
            if config.save_checkpoint_steps and end < self.steps_per_epoch and \
                    (epoch * self.steps_per_epoch + end) % config.save_checkpoint_steps == 0:
                self._save_step_checkpoint()
            signum = self._agreed_stop(stop)
            if signum is not None:
                self._stop(signum, save=True)
        seconds = time.perf_counter() - started
        counted = self.steps_per_epoch - state.epoch_skipped_steps
        train_loss = state.epoch_loss_sum / counted if counted else None
        skipped = state.epoch_skipped_steps
        state.epoch_num, state.step_in_epoch, state.epoch_loss_sum, state.epoch_skipped_steps = epoch + 1, 0, 0.0, 0
        self._average_batchnorm_statistics()  # before evaluating and saving
        result, ema_result = self._evaluate_if_due()
        self._record_epoch(train_loss, skipped, seconds, (self.steps_per_epoch - first_step) * images_per_step,
                           result, ema_result)
        signum = self._agreed_stop(stop)
        if signum is not None:  # arrived during evaluation: the epoch checkpoint is the resume point
            self._stop(signum, save=False)

    def _check_window(self, loss_sum: float, skipped: int, start: int, end: int) -> None:
        """Stops the run (one line) on a non-finite loss, or on an overflow under a fixed loss scale."""
        epoch = self.state.epoch_num + 1
        steps = f"step {end}" if end - start == 1 else f"steps {start + 1}-{end}"
        if not math.isfinite(loss_sum):
            raise UserError(f"training diverged: loss is {loss_sum} at epoch {epoch} {steps}; lower --lr or add "
                            "--warmup_epochs")
        if skipped and not self.amp.dynamic:
            raise UserError(f"loss scale {self.amp.loss_scale:g} overflowed the float16 gradients of {skipped} step(s) "
                            f"at epoch {epoch} {steps} (their updates were skipped): lower --loss_scale or use "
                            "--loss_scale_type dynamic")

    def _average_batchnorm_statistics(self) -> None:
        """Averages the ranks' BatchNorm moving statistics (see evaluation.average_batchnorm_statistics), and their
        EMA's: the EMA cell's parameters include the network's, so one collective does both."""
        average_batchnorm_statistics(self.ema if self.ema is not None else self.net, self.env.group_size)

    def _save_step_checkpoint(self) -> None:
        # The ranks' BatchNorm moving statistics are averaged first, as at the end of an epoch (see _stop): the
        # epoch-end average is unchanged by it, and every rank resumes from the same values.
        self._average_batchnorm_statistics()
        if self.env.is_main_rank:
            path = self.checkpoints.save_step(self.step.train_step, self.state)
            self.logger.info("saved %s", path)

    def _agreed_stop(self, stop: StopOnSignal) -> Optional[int]:
        """The signal that stops training, agreed by all ranks so they all stop after the same step.

        A launcher sends SIGTERM to every worker, but not at the same instant: a rank that saw no signal
        yet stops too. Ranks count [saw SIGINT, saw SIGTERM] (MindSpore's CPU AllReduce only sums); any
        SIGTERM wins. Costs one tiny all-reduce per window.
        """
        if not self.env.distributed:
            return stop.signum
        seen = np.array([stop.signum == signal.SIGINT, stop.signum == signal.SIGTERM], np.float32)
        saw_int, saw_term = all_reduce_sum(seen)
        if saw_term:
            return signal.SIGTERM
        return signal.SIGINT if saw_int else None

    def _evaluate_if_due(self) -> Tuple[Optional[EvalResult], Optional[EvalResult]]:
        """(the raw weights' result, the EMA's) when this epoch is evaluated, else (None, None)."""
        epoch = self.state.epoch_num
        if epoch % self.config.eval_interval and epoch != self.config.epoch_size:
            return None, None
        # The fused inference network is built once and refreshed with the current weights each time.
        self.inference_net = inference_network(self.net, self.inference_net)
        result = self._evaluate(self.inference_net, "")
        ema_result = None
        if self.ema is not None:
            if self.ema_net is None:
                config = self.config
                self.ema_net = build_resnet(config.model_name, config.class_num, config.zero_init_residual,
                                            self.env.conv_implementation, config.stem)
            self.ema.copy_to(self.ema_net)
            self.ema_inference_net = inference_network(self.ema_net, self.ema_inference_net)
            ema_result = self._evaluate(self.ema_inference_net, " (EMA weights)")
        self.step.train_step.set_train(True)
        return_freed_heap()  # the first evaluation compiled its network; later trims find little and cost little
        return result, ema_result

    def _evaluate(self, net: nn.Cell, label: str) -> EvalResult:
        started = time.perf_counter()
        result = evaluate(net, self.eval_dataset, self.config.class_num, self.env.group_size)
        self.logger.info("epoch %d eval%s: top-1 %.4f top-5 %.4f loss %.4f on %d images (%.1f s)%s",
                         self.state.epoch_num, label, result.top1, result.top5, result.loss, result.num_samples,
                         time.perf_counter() - started, self.data.tag)
        return result

    def _record_epoch(self, train_loss: Optional[float], skipped: int, seconds: float, images: int,
                      result: Optional[EvalResult], ema_result: Optional[EvalResult]) -> None:
        state = self.state
        is_best = result is not None and result.top1 > state.best_top1
        if is_best:
            state.best_top1 = result.top1
        if not self.env.is_main_rank:
            return
        path = self.checkpoints.save_epoch(self.step.train_step, state, is_best)
        self.metrics.append({
            "epoch": state.epoch_num,
            "lr": float(self.learning_rates[state.epoch_num * self.steps_per_epoch - 1]),
            "train_loss": train_loss,
            "eval_loss": result.loss if result else None,
            "top1": result.top1 if result else None,
            "top5": result.top5 if result else None,
            "epoch_seconds": seconds,
            "images_per_second": images / max(seconds, 1e-9),
            "skipped_steps": skipped,
            "ema_eval_loss": ema_result.loss if ema_result else None,
            "ema_top1": ema_result.top1 if ema_result else None,
            "ema_top5": ema_result.top5 if ema_result else None,
        })
        # Imported here, not with the module: matplotlib holds about 25 MB of a process, which the other ranks,
        # benchmark.py's training step and the first epoch need not carry.
        from src.plotting import plot_training_curves
        plot_training_curves(self.metrics.rows, str(Path(self.config.output_path) / "training_curves.png"))
        self.logger.info("epoch %d done in %.1f s (train loss %s%s); saved %s%s", state.epoch_num, seconds,
                         "n/a" if train_loss is None else f"{train_loss:.4f}",
                         f", {skipped} step(s) skipped for loss-scale overflow" if skipped else "", path,
                         " (best so far)" if is_best else "")

    def _stop(self, signum: int, save: bool) -> None:
        """Saves the resume point (rank 0), logs it on every rank and ends the run."""
        checkpoint = self.checkpoints.path("interrupted" if save else "last")
        if save:
            # Each rank's moving statistics hold its own batches; their moving averages are linear in the
            # starting value, so resuming every rank from the average ends where the uninterrupted run does.
            self._average_batchnorm_statistics()
            if self.env.is_main_rank:
                self.checkpoints.save_interrupted(self.step.train_step, self.state)
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
