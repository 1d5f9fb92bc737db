"""Adam and momentum SGD with L2 weight decay, each as one native pass over the parameters (CPU, with the native
library).

Why: MindSpore's optimizers add the decay to the gradients as an addition and a multiplication per parameter, each a
pass over memory, before their update kernel; for ResNet-50 that costs more than the update itself. NativeAdam,
NativeMomentum and NativeNesterovSGD are nn.Adam, nn.Momentum and nn.SGD(nesterov=True) (same parameters, state and
step counters, so checkpoints and resuming are the same) whose update is one of native/onednn_conv.cc's AdamUpdate,
MomentumUpdate and NesterovSgdUpdate: decay, state and weights in one read and one write.
"""
from typing import Sequence, Tuple

import mindspore as ms
import numpy as np
from mindspore import nn, ops

from src.onednn_conv import GRADIENT_BLOCKS, GRADIENT_BLOCKS_OR_WINDOW, BlockedConv2d, usable_library

def _update_shape(*shapes):
    return (1,)


def _update_dtype(*dtypes):
    return ms.float32


def _native_update(optimizer: nn.Optimizer, kernel: str) -> Tuple[ms.Tensor, ms.Tensor, ops.Custom]:
    """The decays and the gradients' layouts (0 each: plain; see gradients_in_kernel_layout), one per parameter, and
    the native update op for an optimizer whose groups differ only in a fixed weight_decay, over float32
    parameters, without loss scale or gradient centralization."""
    name = type(optimizer).__name__
    offload = getattr(optimizer, "use_offload", False)  # only nn.Adam has it
    if (optimizer.is_group_lr or optimizer.dynamic_weight_decay or optimizer.need_scale or offload
            or optimizer.grad_centralization):
        raise ValueError(f"{name} takes groups that differ only in a fixed weight_decay, and no loss_scale")
    if any(p.dtype != ms.float32 for p in optimizer._parameters):
        raise ValueError(f"{name} updates float32 parameters only")
    decays = optimizer.group_weight_decay if optimizer.is_group else [optimizer.weight_decay] * len(
        optimizer._parameters)
    update = ops.Custom(f"{usable_library()}:{kernel}", _update_shape, _update_dtype, func_type="aot")
    # The update writes the weights and the optimizer's state where they lie. Marked as writing memory, so that
    # MindSpore hands it the parameters themselves: without the mark, a graph whose gradients pass a cell with a bprop
    # of its own (src/onednn_conv.py ReluOutputFanout) got a copy of each weight (TensorMove), and the update left
    # the weights as they were.
    update.add_prim_attr("side_effect_mem", True)
    layouts = ms.Tensor(np.zeros(len(decays), np.int64))
    return ms.Tensor(np.array(decays, np.float32)), layouts, update


def gradients_in_kernel_layout(net: nn.Cell, optimizer: nn.Optimizer, windows: bool = False) -> int:
    """Lets net's fused convolution+BatchNorm layers hand their weight gradients to optimizer, a native update, in
    the convolution kernel's own layout: the update puts them in OIHW order itself, in cache, which saves the
    training step a reorder of every weight gradient. Call it before the step first runs (compiles), and only
    where the gradients go from the network to this optimizer through element-wise operations or global norms
    (clipping, loss scale): not across processes whose CPUs may differ (data-parallel all-reduce), and not into
    any other optimizer. windows, only where nothing but the update reads the gradients (no clipping, no loss
    scale): layers whose output pixel only ever meets a window of each kernel (layer4's at 32x32 inputs) then
    write that window's gradient alone, not the zeros around it, and leave the rest of the gradient's memory
    unwritten. Returns the number of layers that hand their gradients over."""
    if not isinstance(optimizer, NATIVE_OPTIMIZERS):
        raise ValueError(f"gradients_in_kernel_layout needs a native optimizer, got {type(optimizer).__name__}")
    index = {param.name: k for k, param in enumerate(optimizer._parameters)}
    layouts = optimizer.gradient_layouts.asnumpy()
    count = 0
    for _, cell in net.cells_and_names():
        if isinstance(cell, BlockedConv2d) and cell.runs_batchnorm_itself() and cell.weight.name in index:
            cell.weight_gradient_layout = GRADIENT_BLOCKS_OR_WINDOW if windows else GRADIENT_BLOCKS
            layouts[index[cell.weight.name]] = 1
            count += 1
    optimizer.gradient_layouts = ms.Tensor(layouts)
    return count


class NativeAdam(nn.Adam):
    """nn.Adam's update (its formula: eps added to the uncorrected sqrt(v)) with torch.optim.Adam's L2 weight decay,
    for parameter groups that differ only in weight_decay; float32 parameters."""

    def __init__(self, params: Sequence, learning_rate, beta1: float = 0.9, beta2: float = 0.999,
                 eps: float = 1e-8) -> None:
        super().__init__(params, learning_rate=learning_rate, beta1=beta1, beta2=beta2, eps=eps)
        self.decays, self.gradient_layouts, self.update = _native_update(self, "AdamUpdate")

    def construct(self, gradients):
        lr = self.get_lr()
        beta1_power = self.beta1_power * self.beta1
        self.beta1_power = beta1_power
        beta2_power = self.beta2_power * self.beta2
        self.beta2_power = beta2_power
        done = self.update(lr, self.beta1, self.beta2, self.eps, beta1_power, beta2_power, self.decays,
                           self.gradient_layouts, *self._parameters, *self.moment1, *self.moment2, *gradients)
        # The update writes the weights where they lie (_native_update): the step counter's assignment waits for it
        # too, so whatever reads the weights after the optimizer (EMA, the next step) comes after the update.
        self.assignadd(self.global_step, ops.depend(self.global_step_increase_tensor, done))
        return done


class NativeMomentum(nn.Momentum):
    """nn.Momentum's update (accum = momentum * accum + gradient; weight -= lr * accum) with torch.optim.SGD's L2
    weight decay, for parameter groups that differ only in weight_decay; float32 parameters."""

    def __init__(self, params: Sequence, learning_rate, momentum: float) -> None:
        super().__init__(params, learning_rate=learning_rate, momentum=momentum)
        self.decays, self.gradient_layouts, self.update = _native_update(self, "MomentumUpdate")

    def construct(self, gradients):
        done = self.update(self.get_lr(), self.momentum, self.decays, self.gradient_layouts, *self.params,
                           *self.moments, *gradients)
        self.assignadd(self.global_step, ops.depend(self.global_step_increase_tensor, done))  # as NativeAdam's
        return done


class NativeNesterovSGD(nn.SGD):
    """nn.SGD's update with nesterov=True and dampening 0 (the first step sets accum to the gradient; weight -= lr *
    (gradient + momentum * accum)), as torch.optim.SGD(nesterov=True) with its L2 weight decay, for parameter groups
    that differ only in weight_decay; float32 parameters."""

    def __init__(self, params: Sequence, learning_rate, momentum: float) -> None:
        super().__init__(params, learning_rate=learning_rate, momentum=momentum, nesterov=True)
        self.decays, self.gradient_layouts, self.update = _native_update(self, "NesterovSgdUpdate")

    def construct(self, gradients):
        done = self.update(self.get_lr(), self.momentum, self.decays, self.gradient_layouts, *self._parameters,
                           *self.accum, *self.stat, *gradients)
        self.assignadd(self.global_step, ops.depend(self.global_step_increase_tensor, done))  # as NativeAdam's
        return done


NATIVE_OPTIMIZERS = (NativeAdam, NativeMomentum, NativeNesterovSGD)
