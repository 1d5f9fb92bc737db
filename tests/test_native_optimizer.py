"""NativeAdam (one native pass: decay, moments, weights) computes what nn.Adam computes, keeps its state under the
same names, and is what training with the native library builds."""
import numpy as np
import mindspore as ms
import pytest
from mindspore import nn

from src.model_utils.config import load_config
from src.native_optimizer import NativeAdam
from src.trainer import build_optimizer

# Sizes around the native update's 65536-element chunks (one short, several with a tail) and small ones.
SHAPES = [(3, 5), (65536 + 7,), (2, 65536), (64, 3, 7, 7), (1,)]
LEARNING_RATES = np.array([0.01, 0.03, 0.002, 0.02], np.float32)


def _parameters(tag: str):
    rng = np.random.default_rng(0)
    return [ms.Parameter(ms.Tensor(rng.standard_normal(shape).astype(np.float32)), name=f"{tag}.p{i}")
            for i, shape in enumerate(SHAPES)]


def _groups(params, decay: float):
    return [{"params": params[:3], "weight_decay": decay}, {"params": params[3:], "weight_decay": 0.0}]


def _gradients(step: int):
    rng = np.random.default_rng(100 + step)
    return tuple(ms.Tensor(rng.standard_normal(shape).astype(np.float32) * 10 ** rng.uniform(-4, 1))
                 for shape in SHAPES)


@pytest.mark.parametrize("decay", [0.0, 0.05])
def test_native_adam_follows_nn_adam_step_by_step(decay):
    """Weights, both moments, the bias-correction powers and the step count, over steps with a changing learning
    rate, for a decayed group and an undecayed one."""
    ours = NativeAdam(_groups(_parameters("ours"), decay), learning_rate=ms.Tensor(LEARNING_RATES))
    theirs = nn.Adam(_groups(_parameters("theirs"), decay), learning_rate=ms.Tensor(LEARNING_RATES))
    for step in range(len(LEARNING_RATES)):
        ours(_gradients(step))
        theirs(_gradients(step))
        for mine, reference in [(ours._parameters, theirs._parameters), (ours.moment1, theirs.moment1),
                                (ours.moment2, theirs.moment2)]:
            for a, b in zip(mine, reference):
                np.testing.assert_allclose(a.asnumpy(), b.asnumpy(), rtol=2e-6, atol=1e-7, err_msg=b.name)
        assert not np.array_equal(ours._parameters[1].asnumpy(), _parameters("x")[1].asnumpy())
    for name in ("beta1_power", "beta2_power", "global_step"):
        np.testing.assert_allclose(getattr(ours, name).asnumpy(), getattr(theirs, name).asnumpy(), rtol=1e-7)
    assert ours.global_step.asnumpy()[0] == len(LEARNING_RATES)


def test_native_adam_state_is_nn_adams_so_checkpoints_resume_either_way(tmp_path):
    """The same parameter names; nn.Adam's saved state, loaded into NativeAdam, continues as nn.Adam would."""
    theirs = nn.Adam(_groups(_parameters("w"), 0.05), learning_rate=ms.Tensor(LEARNING_RATES))
    ours = NativeAdam(_groups(_parameters("w"), 0.05), learning_rate=ms.Tensor(LEARNING_RATES))
    assert [p.name for p in ours.get_parameters()] == [p.name for p in theirs.get_parameters()]
    for step in range(2):
        theirs(_gradients(step))
    ms.save_checkpoint(theirs, str(tmp_path / "adam.ckpt"))
    not_loaded, _ = ms.load_param_into_net(ours, ms.load_checkpoint(str(tmp_path / "adam.ckpt")))
    assert not not_loaded
    theirs(_gradients(2))
    ours(_gradients(2))
    for a, b in zip(ours.get_parameters(), theirs.get_parameters()):
        np.testing.assert_allclose(a.asnumpy(), b.asnumpy(), rtol=2e-6, atol=1e-7, err_msg=b.name)


def test_build_optimizer_takes_native_adam_only_when_asked():
    config = load_config(["--optimizer", "adam"])
    params = _parameters("b")
    assert type(build_optimizer(config, params, LEARNING_RATES, native=True)) is NativeAdam
    assert type(build_optimizer(config, params, LEARNING_RATES)) is nn.Adam
    momentum = load_config(["--optimizer", "momentum"])
    assert not isinstance(build_optimizer(momentum, params, LEARNING_RATES, native=True), NativeAdam)


def test_native_adam_refuses_what_its_update_does_not_compute():
    with pytest.raises(ValueError, match="float32"):
        NativeAdam([ms.Parameter(ms.Tensor(np.ones(3, np.float16)), name="half")], learning_rate=0.1)
    with pytest.raises(ValueError, match="loss_scale"):
        NativeAdam([{"params": _parameters("lr"), "lr": 0.5}], learning_rate=0.1)


def test_the_update_runs_at_the_vector_width_onednns_isa_allows():
    """AVX-512 only where oneDNN runs AVX-512 code (ONEDNN_MAX_CPU_ISA caps both: benchmark.py --isa avx2, and
    the tests' own AVX2 cap), AVX2 under an AVX2 cap."""
    import ctypes
    from src.onednn_conv import channel_block, usable_library
    bits = ctypes.CDLL(usable_library()).onednn_conv_adam_vector_bits()
    with open("/proc/cpuinfo") as cpuinfo:
        flags = cpuinfo.read()
    assert bits == (512 if channel_block() == 16 else 256 if " avx2" in flags else 128)

