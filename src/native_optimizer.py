"""Adam with L2 weight decay as one native pass over the parameters (CPU, with the native library).

Why: MindSpore's nn.Adam adds the decay to the gradients as an addition and a multiplication per parameter, each a
pass over memory, before its Adam kernel; for ResNet-50 that costs more than the update itself. NativeAdam is
nn.Adam (same parameters, moments and step counters, so checkpoints and resuming are the same) whose update is
native/onednn_conv.cc's AdamUpdate: decay, moments and weights in one read and one write.
"""
from typing import Sequence

import mindspore as ms
import numpy as np
from mindspore import nn, ops

from src.onednn_conv import usable_library


def _update_shape(*shapes):
    return (1,)


def _update_dtype(*dtypes):
    return ms.float32


class NativeAdam(nn.Adam):
    """nn.Adam's update (its formula: eps added to the uncorrected sqrt(v)) with torch.optim.Adam's L2 weight decay,
    for parameter groups that differ only in weight_decay; float32 parameters."""

    def __init__(self, params: Sequence, learning_rate, beta1: float = 0.9, beta2: float = 0.999,
                 eps: float = 1e-8) -> None:
        super().__init__(params, learning_rate=learning_rate, beta1=beta1, beta2=beta2, eps=eps)
        if self.is_group_lr or self.dynamic_weight_decay or self.need_scale or self.use_offload:
            raise ValueError("NativeAdam takes groups that differ only in a fixed weight_decay, and no loss_scale")
        if any(p.dtype != ms.float32 for p in self._parameters):
            raise ValueError("NativeAdam updates float32 parameters only")
        decays = self.group_weight_decay if self.is_group else [self.weight_decay] * len(self._parameters)
        self.decays = ms.Tensor(np.array(decays, np.float32))
        self.update = ops.Custom(f"{usable_library()}:AdamUpdate", _update_shape, _update_dtype, func_type="aot")

    def construct(self, gradients):
        lr = self.get_lr()
        beta1_power = self.beta1_power * self.beta1
        self.beta1_power = beta1_power
        beta2_power = self.beta2_power * self.beta2
        self.beta2_power = beta2_power
        done = self.update(lr, self.beta1, self.beta2, self.eps, beta1_power, beta2_power, self.decays,
                           *self._parameters, *self.moment1, *self.moment2, *gradients)
        # The update writes the weights where they lie, which MindSpore's ordering of side effects does not see:
        # the step counter's assignment waits for it, so whatever reads the weights after the optimizer (EMA,
        # the next step) comes after the update.
        self.assignadd(self.global_step, ops.depend(self.global_step_increase_tensor, done))
        return done
