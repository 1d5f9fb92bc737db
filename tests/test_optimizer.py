"""The optimizers decay every parameter, BatchNorm included, as torch.optim.Adam/SGD do."""
import numpy as np
import mindspore as ms
import pytest

from src.model_utils.config import load_config
from src.resnet import build_resnet
from src.trainer import build_optimizer


@pytest.mark.parametrize("optimizer", ["adam", pytest.param("momentum", marks=pytest.mark.slow)])
def test_weight_decay_reaches_batchnorm_gamma(optimizer):
    config = load_config(["--optimizer", optimizer, "--weight_decay", "0.1"])
    net = build_resnet("resnet18", 10)
    params = net.trainable_params()
    opt = build_optimizer(config, params, np.full(4, 0.01, np.float32))
    gammas = {p.name: p.asnumpy().copy() for p in params if p.name.endswith(".gamma")}
    # Zero gradients: only weight decay (gradient += wd * param) can move a parameter.
    opt(tuple(ms.Tensor(np.zeros(p.shape, np.float32)) for p in params))
    moved = [name for name, before in gammas.items()
             if not np.array_equal(net.parameters_dict()[name].asnumpy(), before)]
    assert sorted(moved) == sorted(gammas), sorted(set(gammas) - set(moved))[:3]
