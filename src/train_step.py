"""The training step: mixed precision (amp_level), loss scaling (fixed or dynamic, with overflow checks on
every device, CPU included) and the loss totals the host reads once per window of steps (device-side for
sinks)."""
import atexit
import contextlib
import logging
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from typing import Iterator, List, Optional, Tuple, Union

import numpy as np
import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops

from src.ema import WeightsEma

# amp_level auto: the level MindSpore recommends per device (O3 for Ascend, O2 for GPU); fp32 on CPU.
AUTO_AMP_LEVEL = {"Ascend": "O3", "GPU": "O2", "CPU": "O0"}
# Dynamic loss scale: MindSpore's DynamicLossScaleManager defaults (halve on overflow, double after this many
# steps without one).
DYNAMIC_SCALE_FACTOR = 2
DYNAMIC_SCALE_WINDOW = 2000
# Parameters of the step that hold the loss-scale state: a checkpoint from a run without loss scaling lacks them.
LOSS_SCALE_STATE = ("scale_sense", "current_iterator_step", "last_overflow_iterator_step")


@dataclass(frozen=True)
class AmpSetting:
    """The precision a run trains in: level O0-O3; loss_scale None for none (O0), else its (initial) value."""
    level: str
    loss_scale: Optional[float] = None
    dynamic: bool = False

    def describe(self) -> str:
        if self.loss_scale is None:
            return f"amp_level {self.level} (float32)"
        kind = "dynamic" if self.dynamic else "fixed"
        return f"amp_level {self.level}, {kind} loss scale {self.loss_scale:g}"


def amp_level_for(requested: str, device: str) -> str:
    """The level (O0-O3) amp_level requested runs at on device: auto picks per device, an explicit level is kept."""
    return AUTO_AMP_LEVEL[device] if requested == "auto" else requested


def resolve_amp(config, device: str, logger: logging.Logger) -> AmpSetting:
    """The AmpSetting for config on device (see amp_level_for), with its loss scale."""
    level = amp_level_for(config.amp_level, device)
    if config.amp_level == "auto":
        logger.info("amp_level auto: %s on %s", level, device)
    elif level != "O0" and device == "CPU":
        logger.info("amp_level %s on CPU: runs as asked, but float16 brings no speed there (oneDNN's CPU "
                    "convolutions are fastest in float32); amp_level O0 or auto trains in float32", level)
    if level == "O0":
        return AmpSetting("O0")  # float32 needs no loss scale
    return AmpSetting(level, config.loss_scale, config.loss_scale_type == "dynamic")


_finite = ops.MultitypeFuncGraph("_finite")


@_finite.register("Tensor")
def _tensor_finite(grad):
    return ops.isfinite(grad).all()


_unscale = ops.MultitypeFuncGraph("_unscale")


@_unscale.register("Tensor", "Tensor")
def _tensor_unscale(scale, grad):
    return grad * ops.cast(ops.reciprocal(scale), grad.dtype)


class ClippedTrainStep(nn.TrainOneStepCell):
    """MindSpore's TrainOneStepCell with the gradients clipped to a global L2 norm of max_norm before the update
    (torch's clip_grad_norm_)."""

    def __init__(self, network: nn.Cell, optimizer: nn.Optimizer, max_norm: float) -> None:
        super().__init__(network, optimizer)
        self.max_norm = max_norm

    def construct(self, *inputs):
        loss = self.network(*inputs)
        grads = self.grad_no_sens(self.network, self.weights)(*inputs)
        grads = ops.clip_by_global_norm(self.grad_reducer(grads), self.max_norm)
        return ops.depend(loss, self.optimizer(grads))


class LossScaledTrainStep(nn.TrainOneStepWithLossScaleCell):
    """MindSpore's loss-scaled training step (the optimizer update is skipped on overflow), with the unscaled
    gradients clipped to a global L2 norm of max_norm (0: not clipped); returns (loss, overflow, loss scale).

    On CPU the overflow is found with IsFinite on the gradients: MindSpore's own check reads Ascend's float
    status registers (NPUGetFloatStatusV2), which the CPU backend has no kernel for.
    """

    def __init__(self, network: nn.Cell, optimizer: nn.Optimizer, scale_sense, max_norm: float = 0.0) -> None:
        super().__init__(network, optimizer, scale_sense)
        self.check_with_isfinite = ms.get_context("device_target") == "CPU"
        self.max_norm = max_norm

    def construct(self, *inputs):
        # TrainOneStepWithLossScaleCell.construct, with the clipping between the overflow check and the update.
        loss = self.network(*inputs)
        scaling_sens = self.scale_sense
        status = Tensor([0] * 8, ms.int32)
        scaling_sens_filled = ops.ones_like(loss) * ops.cast(scaling_sens, ops.dtype(loss))
        grads = self.grad(self.network, self.weights)(*inputs, scaling_sens_filled)
        grads = self.grad_reducer(self.hyper_map(ops.partial(_unscale, scaling_sens), grads))
        cond = self.get_overflow_status(status, grads)
        overflow = self.process_loss_scale(cond)
        if self.max_norm > 0:
            grads = ops.clip_by_global_norm(grads, self.max_norm)
        if not overflow:
            loss = ops.depend(loss, self.optimizer(grads))
        return loss, cond, scaling_sens

    def get_overflow_status(self, status, compute_output):
        if not self.check_with_isfinite:
            return super().get_overflow_status(status, compute_output)
        finite = ops.stack(self.hyper_map(_finite, compute_output)).all()
        flag = ops.cast(ops.logical_not(finite), ms.float32)
        if self.is_distributed:  # every rank skips the same steps (CPU AllReduce sums float32)
            flag = self.allreduce(flag)
        return flag > 0


class StepWithTotals(nn.Cell):
    """For sinks: runs a training step and adds to device-side totals, the loss of the steps that updated the
    weights and the number of steps skipped for a loss-scale overflow. The host reads them once per sink
    (read_totals), so it never waits on the device between a sink's steps."""

    def __init__(self, train_step: nn.Cell, loss_scaled: bool, ema: Optional[WeightsEma] = None) -> None:
        super().__init__(auto_prefix=False)  # the parameters keep their names (and checkpoints theirs)
        self.train_step = train_step
        self.loss_scaled = loss_scaled
        self.ema = ema
        self.has_ema = ema is not None
        # Not saved in checkpoints (the trainer saves train_step); their values go to TrainingState.
        self.loss_sum = Parameter(Tensor(0.0, ms.float32), name="window_totals.loss_sum", requires_grad=False)
        self.skipped_steps = Parameter(Tensor(0.0, ms.float32), name="window_totals.skipped_steps",
                                       requires_grad=False)

    def construct(self, images, labels):
        if self.loss_scaled:
            loss, overflow, _ = self.train_step(images, labels)
        else:
            loss = self.train_step(images, labels)
            overflow = ops.zeros((), ms.bool_)
        if self.has_ema:
            loss = ops.depend(loss, self.ema())  # after the update: MindSpore orders side effects as written
        skipped = ops.cast(overflow, ms.float32)
        loss = ops.depend(loss, ops.assign_add(self.loss_sum, ops.select(overflow, ops.zeros_like(loss), loss)))
        loss = ops.depend(loss, ops.assign_add(self.skipped_steps, skipped))
        return loss

    def read_totals(self) -> Tuple[float, int]:
        """(summed loss, steps skipped) since the last read, and starts the next sink at zero."""
        loss_sum, skipped = float(self.loss_sum.asnumpy()), int(self.skipped_steps.asnumpy())
        self.loss_sum.set_data(Tensor(0.0, ms.float32))
        self.skipped_steps.set_data(Tensor(0.0, ms.float32))
        return loss_sum, skipped

    def loss_scale(self) -> Optional[float]:
        """The loss scale in force (None without loss scaling)."""
        return float(self.train_step.scale_sense.asnumpy()) if self.loss_scaled else None


class StepWithHostTotals:
    """For batches fed and read one step at a time: StepWithTotals' interface, the totals summed on the host from
    each step's own outputs (on CPU, updating and resetting device totals every step made ResNet-50's step
    measurably slower; reading the step's outputs adds nothing)."""

    def __init__(self, train_step: nn.Cell, loss_scaled: bool, ema: Optional[WeightsEma] = None) -> None:
        self.train_step = train_step
        self.loss_scaled = loss_scaled
        self.ema = ema
        self.loss_sum, self.skipped_steps = 0.0, 0

    def __call__(self, images, labels):
        output = self.train_step(images, labels)
        if self.ema is not None:
            self.ema()
        loss = output[0] if self.loss_scaled else output
        if self.loss_scaled and bool(output[1].asnumpy()):
            self.skipped_steps += 1
        else:
            self.loss_sum += float(loss.asnumpy())
        return loss

    def read_totals(self) -> Tuple[float, int]:
        """(summed loss, steps skipped) since the last read."""
        totals = (self.loss_sum, self.skipped_steps)
        self.loss_sum, self.skipped_steps = 0.0, 0
        return totals

    def loss_scale(self) -> Optional[float]:
        return float(self.train_step.scale_sense.asnumpy()) if self.loss_scaled else None


_REWRITE_HOME: List[str] = []  # the process's private folder for MindSpore's rewritten networks, made once


@contextlib.contextmanager
def _rewrite_folder() -> Iterator[None]:
    """Runs the block in a private temporary folder, removed when the process exits, and gives sys.path back as
    the block found it.

    MindSpore's O1 mixed precision rewrites the network into Python source that it writes to
    ./rewritten_network/ in the current folder and imports from there (graph compilation reads it again later),
    which would leave files in the user's folder. Nothing else reads a relative path while the step is built.
    The rewritten source puts the folders of the network's modules (src/, mindspore/nn/layer) first on sys.path,
    where a later top-level import would find src/benchmark.py for `import benchmark`; the modules it imported
    stay loaded, so compiling it needs none of those entries.
    """
    if not _REWRITE_HOME:
        _REWRITE_HOME.append(tempfile.mkdtemp(prefix="resnet-amp-rewrite-"))
        atexit.register(shutil.rmtree, _REWRITE_HOME[0], True)
    previous, previous_path = os.getcwd(), list(sys.path)
    os.chdir(_REWRITE_HOME[0])
    try:
        yield
    finally:
        os.chdir(previous)
        sys.path[:] = previous_path


def update_alone_reads_gradients(config, amp: AmpSetting) -> bool:
    """Whether build_train_step's step hands the gradients straight to the optimizer: neither clipped (nor their
    norm taken) nor unscaled and checked for overflow on the way."""
    return amp.loss_scale is None and config.grad_clip_norm <= 0


def build_train_step(net: nn.Cell, optimizer: nn.Optimizer, config, amp: AmpSetting, sink: bool = False,
                     ema: Optional[WeightsEma] = None) -> Union[StepWithTotals, StepWithHostTotals]:
    """net's training step with config's loss (cross-entropy, label smoothing) at amp's precision, keeping the
    totals read_totals returns: on the device for sinks (sink), else on the host; ema, when given, is updated
    after every step.

    Without loss scaling it is MindSpore's build_train_network (TrainOneStepCell, the fastest step measured on
    CPU), or ClippedTrainStep with grad_clip_norm. With it, the same network in LossScaledTrainStep: a fixed scale
    (the update skipped on overflow; the trainer then stops) or DynamicLossScaleManager's update cell.
    """
    loss_fn = nn.CrossEntropyLoss(label_smoothing=config.label_smoothing)
    # float32 (O0) leaves the network as it is: no folder, none left behind by a run that is killed.
    with _rewrite_folder() if amp.level != "O0" else contextlib.nullcontext():
        # loss_scale_manager=None: the level's default manager (dynamic for O2) is refused on CPU.
        train_step = ms.amp.build_train_network(net, optimizer, loss_fn, level=amp.level, loss_scale_manager=None)
    if amp.loss_scale is None and config.grad_clip_norm > 0:
        train_step = ClippedTrainStep(train_step.network, optimizer, config.grad_clip_norm)
    if amp.loss_scale is not None:
        # MindSpore's build_train_network refuses a loss-scale manager on CPU: the network with its loss (and
        # the level's casts) it built is wrapped in the loss-scaled step here instead.
        if amp.dynamic:
            scale_sense = ms.amp.DynamicLossScaleManager(amp.loss_scale, DYNAMIC_SCALE_FACTOR,
                                                         DYNAMIC_SCALE_WINDOW).get_update_cell()
        else:
            scale_sense = Tensor(np.float32(amp.loss_scale))
        train_step = LossScaledTrainStep(train_step.network, optimizer, scale_sense, config.grad_clip_norm)
    train_step.set_train()
    if not sink:
        return StepWithHostTotals(train_step, amp.loss_scale is not None, ema)
    step = StepWithTotals(train_step, amp.loss_scale is not None, ema)
    step.set_train()
    return step
