"""An exponential moving average (EMA) of a network's parameters, updated after every training step.

As timm's ModelEmaV2 and torchvision's reference ExponentialMovingAverage: ema = decay * ema + (1 - decay) * value
for every parameter, BatchNorm moving statistics included. The averages are Parameters named "ema.<name>", saved
in train.py's checkpoints beside the raw weights; eval.py, export.py and predict.py use them when present.
"""
from typing import Dict, List

import numpy as np
from mindspore import Parameter, ParameterTuple, Tensor, nn, ops

PREFIX = "ema."

_update = ops.MultitypeFuncGraph("_ema_update")


@_update.register("Number", "Tensor", "Tensor")
def _update_one(decay, average, value):
    return ops.assign(average, average * decay + ops.cast(value, average.dtype) * (1.0 - decay))


class WeightsEma(nn.Cell):
    """The EMA of every parameter of net; calling it (in graph mode) applies one update."""

    def __init__(self, net: nn.Cell, decay: float) -> None:
        super().__init__(auto_prefix=False)
        self.decay = float(decay)
        sources = list(net.get_parameters())
        self.sources = ParameterTuple(sources)
        self.averages = ParameterTuple([Parameter(Tensor(param.asnumpy().copy()), name=PREFIX + param.name,
                                                  requires_grad=False) for param in sources])
        self.hyper_map = ops.HyperMap()

    def construct(self):
        return self.hyper_map(ops.partial(_update, self.decay), self.averages, self.sources)

    def average_parameters(self) -> List[Parameter]:
        """The "ema.<name>" Parameters (what checkpoints hold)."""
        return list(self.averages)

    def restart_from_sources(self) -> None:
        """Sets every average to its parameter's current value."""
        for average, source in zip(self.averages, self.sources):
            average.set_data(Tensor(source.asnumpy().copy(), average.dtype))

    def load(self, entries: Dict[str, object]) -> bool:
        """Sets the averages from a checkpoint's "ema.<name>" entries; False (nothing set) unless it has them all."""
        if not all(average.name in entries for average in self.averages):
            return False
        for average in self.averages:
            value = entries[average.name]
            array = value.asnumpy() if hasattr(value, "asnumpy") else np.asarray(value)
            average.set_data(Tensor(array, average.dtype))
        return True

    def copy_to(self, net: nn.Cell) -> None:
        """Sets net's parameters (same architecture as the source network's) to the averages."""
        averages = {average.name[len(PREFIX):]: average for average in self.averages}
        for param in net.get_parameters():
            param.set_data(Tensor(averages[param.name].asnumpy(), param.dtype))


def ema_entries_as_weights(entries: Dict[str, object]) -> Dict[str, object]:
    """entries with each "ema.<name>" value in place of <name>'s, when the file holds an EMA of its weights
    (else entries unchanged)."""
    averaged = {name[len(PREFIX):]: value for name, value in entries.items() if name.startswith(PREFIX)}
    if not averaged or not all(name in entries for name in averaged):
        return entries
    return {name: averaged.get(name, value) for name, value in entries.items() if not name.startswith(PREFIX)}
