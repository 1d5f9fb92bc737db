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


def test_no_weight_decay_bn_bias_spares_exactly_the_one_dimensional_parameters():
    config = load_config(["--optimizer", "momentum", "--weight_decay", "0.1", "--no_weight_decay_bn_bias"])
    net = build_resnet("resnet18", 10)
    params = net.trainable_params()
    before = {p.name: p.asnumpy().copy() for p in params}
    opt = build_optimizer(config, params, np.full(4, 0.01, np.float32))
    opt(tuple(ms.Tensor(np.zeros(p.shape, np.float32)) for p in opt.parameters))  # only weight decay moves one
    moved = {name for name, value in before.items() if not np.array_equal(net.parameters_dict()[name].asnumpy(), value)}
    assert moved == {p.name for p in params if len(p.shape) > 1}
    assert "fc.weight" in moved and "fc.bias" not in moved and "bn1.gamma" not in moved


@pytest.mark.parametrize("native", [False, True], ids=["mindspore", "native"])
@pytest.mark.parametrize("nesterov", [False, True])
def test_nesterov_momentum_matches_torch_sgd(nesterov, native):
    torch = pytest.importorskip("torch")
    config = load_config(["--optimizer", "momentum", "--momentum", "0.9", "--weight_decay", "0.01",
                          "--nesterov", str(nesterov).lower()])
    rng = np.random.default_rng(0)
    start = rng.standard_normal((3, 4)).astype(np.float32)
    grads = [rng.standard_normal((3, 4)).astype(np.float32) for _ in range(3)]
    weight = ms.Parameter(ms.Tensor(start), name="w")
    opt = build_optimizer(config, [weight], np.full(3, 0.1, np.float32), native=native)
    theirs = torch.nn.Parameter(torch.from_numpy(start.copy()))
    reference = torch.optim.SGD([theirs], lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=nesterov)
    for grad in grads:
        opt((ms.Tensor(grad),))
        theirs.grad = torch.from_numpy(grad)
        reference.step()
    assert np.allclose(weight.asnumpy(), theirs.detach().numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("args, fragments", [
    (["--nesterov"], ["nesterov", "optimizer momentum"]),
    (["--optimizer", "momentum", "--nesterov", "--momentum", "0"], ["nesterov", "momentum"]),
    (["--lr_schedule", "onecycle", "--warmup_epochs", "1"], ["warmup_epochs", "onecycle"]),
    (["--grad_clip_norm", "-1"], ["grad_clip_norm"]),
])
def test_recipe_keys_refuse_contradictions_in_one_line(args, fragments):
    from conftest import one_line_user_error
    from src.errors import UserError
    with pytest.raises(UserError) as excinfo:
        load_config(args)
    one_line_user_error(excinfo, *fragments)


@pytest.mark.parametrize("amp_level", ["O0", "O2"])
def test_grad_clip_norm_bounds_the_global_norm_of_each_update(amp_level):
    """SGD with lr 1 and no momentum moves the weights by exactly the (clipped) gradients: their global L2 norm is
    grad_clip_norm when the raw gradients are larger, with and without a loss scale."""
    from mindspore import nn
    from src.train_step import AmpSetting, build_train_step
    ms.set_seed(0)
    config = load_config(["--optimizer", "momentum", "--momentum", "0", "--weight_decay", "0",
                          "--grad_clip_norm", "0.01"])
    net = nn.SequentialCell(nn.Flatten(), nn.Dense(12, 3))
    optimizer = build_optimizer(config, net.trainable_params(), np.ones(2, np.float32))
    amp = AmpSetting(amp_level, None if amp_level == "O0" else 1024.0)
    step = build_train_step(net, optimizer, config, amp)
    before = [p.asnumpy().copy() for p in net.trainable_params()]
    rng = np.random.default_rng(0)
    images = ms.Tensor(rng.standard_normal((4, 3, 2, 2)).astype(np.float32) * 10)
    step(images, ms.Tensor(np.array([0, 1, 2, 0], np.int32)))
    moved = [p.asnumpy() - old for p, old in zip(net.trainable_params(), before)]
    assert np.sqrt(sum(float((m.astype(np.float64) ** 2).sum()) for m in moved)) == pytest.approx(0.01, rel=1e-3)
