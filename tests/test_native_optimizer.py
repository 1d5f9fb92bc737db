"""NativeAdam, NativeMomentum and NativeNesterovSGD (one native pass each: decay, state, weights) compute what nn.Adam,
nn.Momentum and nn.SGD(nesterov=True) compute, keep their state under the same names, and are what training with
the native library builds."""
import re

import numpy as np
import mindspore as ms
import pytest
from mindspore import nn

from conftest import avx2_capped_case, native_channel_block, run_with_onednn_log

from src.model_utils.config import load_config
from src.native_optimizer import NativeAdam, NativeMomentum, NativeNesterovSGD
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


# Each native optimizer, the MindSpore optimizer it stands for, and their state besides the weights.
PAIRS = {
    "adam": (NativeAdam, nn.Adam, {}, ("moment1", "moment2"), ("beta1_power", "beta2_power", "global_step")),
    "momentum": (NativeMomentum, nn.Momentum, {"momentum": 0.9}, ("moments",), ("global_step",)),
    "nesterov": (NativeNesterovSGD, nn.SGD, {"momentum": 0.9, "nesterov": True}, ("accum", "stat"),
                 ("global_step",)),
}


def _pair(kind: str, params_ours, params_theirs, decay: float):
    native, reference, options, _, _ = PAIRS[kind]
    native_options = {k: v for k, v in options.items() if k != "nesterov"}
    return (native(_groups(params_ours, decay), learning_rate=ms.Tensor(LEARNING_RATES), **native_options),
            reference(_groups(params_theirs, decay), learning_rate=ms.Tensor(LEARNING_RATES), **options))


@pytest.mark.parametrize("kind", list(PAIRS))
@pytest.mark.parametrize("decay", [0.0, 0.05])
def test_native_update_follows_the_mindspore_optimizer_step_by_step(kind, decay):
    """Weights, the optimizer's state and its step counters, over steps with a changing learning rate, for a
    decayed group and an undecayed one."""
    ours, theirs = _pair(kind, _parameters("ours"), _parameters("theirs"), decay)
    _, _, _, state, counters = PAIRS[kind]
    for step in range(len(LEARNING_RATES)):
        ours(_gradients(step))
        theirs(_gradients(step))
        pairs = [(ours._parameters, theirs._parameters)] + [(getattr(ours, n), getattr(theirs, n)) for n in state]
        for mine, reference in pairs:
            for a, b in zip(mine, reference):
                np.testing.assert_allclose(a.asnumpy(), b.asnumpy(), rtol=2e-6, atol=1e-7, err_msg=b.name)
        assert not np.array_equal(ours._parameters[1].asnumpy(), _parameters("x")[1].asnumpy())
    for name in counters:
        np.testing.assert_allclose(getattr(ours, name).asnumpy(), getattr(theirs, name).asnumpy(), rtol=1e-7)
    assert ours.global_step.asnumpy()[0] == len(LEARNING_RATES)


@pytest.mark.parametrize("kind", list(PAIRS))
def test_native_state_is_the_mindspore_optimizers_so_checkpoints_resume_either_way(kind, tmp_path):
    """The same parameter names; the MindSpore optimizer's saved state, loaded into the native one, continues as
    the MindSpore optimizer would."""
    ours, theirs = _pair(kind, _parameters("w"), _parameters("w"), 0.05)
    assert [p.name for p in ours.get_parameters()] == [p.name for p in theirs.get_parameters()]
    for step in range(2):
        theirs(_gradients(step))
    ms.save_checkpoint(theirs, str(tmp_path / "optimizer.ckpt"))
    not_loaded, _ = ms.load_param_into_net(ours, ms.load_checkpoint(str(tmp_path / "optimizer.ckpt")))
    assert not not_loaded
    theirs(_gradients(2))
    ours(_gradients(2))
    for a, b in zip(ours.get_parameters(), theirs.get_parameters()):
        np.testing.assert_allclose(a.asnumpy(), b.asnumpy(), rtol=2e-6, atol=1e-7, err_msg=b.name)


@pytest.mark.parametrize("options, native, reference", [
    (["--optimizer", "adam"], NativeAdam, nn.Adam),
    (["--optimizer", "momentum"], NativeMomentum, nn.Momentum),
    (["--optimizer", "momentum", "--nesterov"], NativeNesterovSGD, nn.SGD),
])
def test_build_optimizer_takes_the_native_update_only_when_asked(options, native, reference):
    config = load_config(options)
    params = _parameters("b")
    assert type(build_optimizer(config, params, LEARNING_RATES, native=True)) is native
    assert type(build_optimizer(config, params, LEARNING_RATES)) is reference


@pytest.mark.parametrize("kind", list(PAIRS))
def test_native_updates_refuse_what_they_do_not_compute(kind):
    native, _, options, _, _ = PAIRS[kind]
    options = {k: v for k, v in options.items() if k != "nesterov"}
    with pytest.raises(ValueError, match="float32"):
        native([ms.Parameter(ms.Tensor(np.ones(3, np.float16)), name="half")], learning_rate=0.1, **options)
    with pytest.raises(ValueError, match="loss_scale"):
        native([{"params": _parameters("lr"), "lr": 0.5}], learning_rate=0.1, **options)


def test_the_update_runs_at_the_vector_width_onednns_isa_allows():
    """AVX-512 only where oneDNN runs AVX-512 code (ONEDNN_MAX_CPU_ISA caps both: benchmark.py --isa avx2, and
    the tests' own AVX2 cap), AVX2 under an AVX2 cap."""
    import ctypes
    from src.onednn_conv import channel_block, usable_library
    bits = ctypes.CDLL(usable_library()).onednn_conv_update_vector_bits()
    with open("/proc/cpuinfo") as cpuinfo:
        flags = cpuinfo.read()
    assert bits == (512 if channel_block() == 16 else 256 if " avx2" in flags else 128)



KERNEL_LAYOUT_SCRIPT = """
import hashlib, sys, numpy as np, mindspore as ms
from src.model_utils.config import load_config
from src.resnet import build_resnet
from src.train_step import AmpSetting, build_train_step
from src.trainer import build_optimizer
ms.set_context(mode=ms.GRAPH_MODE)
ms.set_seed(1)
config = load_config(sys.argv[3:])
net = build_resnet(sys.argv[2], 10, conv_implementation="onednn_blocked")
optimizer = build_optimizer(config, net.trainable_params(), np.full(3, 0.05, np.float32), native=True,
                            gradients_from=net if sys.argv[1] != "0" else None, gradient_windows=sys.argv[1] == "2")
step = build_train_step(net, optimizer, config, AmpSetting("O0"))
rng = np.random.default_rng(0)
for _ in range(3):
    step(ms.Tensor(rng.standard_normal((4, 3, 32, 32)).astype(np.float32)),
         ms.Tensor(rng.integers(0, 10, 4).astype(np.int32)))
digest = hashlib.sha256(b"".join(p.asnumpy().tobytes() for p in net.trainable_params())).hexdigest()
print("LAYERS", int((optimizer.gradient_layouts.asnumpy() == 1).sum()), "WEIGHTS", digest)
"""


@pytest.mark.slow
@pytest.mark.parametrize("isa, model, options", [
    pytest.param(None, "resnet18", ["--optimizer", "adam"], id="uncapped-adam"),
    avx2_capped_case("AVX2", "resnet18", ["--optimizer", "adam"], id="AVX2-adam"),
    pytest.param(None, "resnet18", ["--optimizer", "momentum", "--nesterov"], id="uncapped-nesterov"),
    pytest.param(None, "resnet50", ["--optimizer", "adam"], id="uncapped-adam-resnet50")])
def test_weight_gradients_in_the_kernels_layout_train_to_the_same_weights(isa, model, options):
    """With gradients_from, the convolutions' weight gradients reach the native update in the kernel's blocked
    layout (no reorder of them to OIHW runs) and the update puts them back in order itself: the weights after
    three steps are bit for bit those of the plain-gradient run, also with gradient_windows, where layer4's layers
    at 32x32 leave only the taps that meet their input. Uncapped, an AVX-512 CPU takes 16-channel blocks
    (1x1 kernels transposed in registers); under the AVX2 cap, 8-channel blocks. ResNet-50's repeated blocks run
    as one shared graph each (lazy_inline), with the first block's constants: each weight gradient's layout must
    still reach the update for its own weights."""
    def train(kernel_layout: str):
        output = run_with_onednn_log(["-c", KERNEL_LAYOUT_SCRIPT, kernel_layout, model, *options], isa)
        gradient_reorders = re.findall(r"exec,cpu,reorder,.*src:f32::blocked:ABcd(?:8b8a|16b16a)::f0 "
                                       r"dst:f32::blocked:abcd:", output)
        layers, _, weights = output.split("LAYERS", 1)[1].split()[:3]
        return len(gradient_reorders), int(layers), weights

    kernel_layout, windows, plain = train("1"), train("2"), train("0")
    # Every convolution (ResNet-18's 20, ResNet-50's 53; the stem's gradient, 3 channels, stays plain).
    assert kernel_layout[:2] == windows[:2] == (0, 20 if model == "resnet18" else 53)
    # Without it every step reorders most of them (ResNet-18: measured 14 a step with 16-channel blocks): not the
    # stem's, nor those of layer4's convolutions into one-pixel maps (matrix products at 32x32, on plain weights).
    # With 8-channel blocks (AVX2) the seven 3x3 stride-1 layers on maps of 4x4 and up compute theirs natively
    # (Winograd), in OIHW, which leaves 4 a step. ResNet-50: measured 32 a step with 8-channel blocks, and 26 with 16,
    # where the twelve 1x1 stride-1 layers on 2x2 maps compute theirs as matrix products, in OIHW.
    wide = native_channel_block(isa) == 16
    least = (24 if wide else 30) if model == "resnet50" else 10 if wide else 4
    assert plain[1] == 0 and plain[0] >= 3 * least and plain[0] % 3 == 0, plain
    assert kernel_layout[2] == windows[2] == plain[2]


def test_gradients_in_kernel_layout_needs_a_native_optimizer():
    from src.native_optimizer import gradients_in_kernel_layout
    from src.resnet import build_resnet
    net = build_resnet("resnet18", 10, conv_implementation="onednn_blocked")
    with pytest.raises(ValueError, match="native optimizer"):
        gradients_in_kernel_layout(net, nn.Adam(net.trainable_params(), 0.01))
    native = NativeAdam(net.trainable_params(), 0.01)
    assert gradients_in_kernel_layout(net, native) == 20
    assert (native.gradient_layouts.asnumpy() == 1).sum() == 20


def test_gradient_windows_only_where_the_update_alone_reads_the_gradients():
    """Windows of taps leave the rest of a gradient's memory unwritten, so build_train_step's steps that clip the
    gradients or unscale them and check them for overflow must not get them."""
    from src.model_utils.config import load_config
    from src.train_step import AmpSetting, update_alone_reads_gradients
    assert update_alone_reads_gradients(load_config([]), AmpSetting("O0"))
    assert not update_alone_reads_gradients(load_config(["--grad_clip_norm", "1"]), AmpSetting("O0"))
    assert not update_alone_reads_gradients(load_config([]), AmpSetting("O2", 1024.0))


def _blocked_resnet18_step(config, learning_rate: float, native: bool, gradient_windows: bool = False):
    """One training step of ResNet-18 (onednn_blocked, 32x32, batch 4, fixed seed and data) with the optimizer
    build_optimizer makes for config (native: with gradients_from the network): (the optimizer, each trainable
    parameter's value before the step, after it), copies by name."""
    from src.resnet import build_resnet
    from src.train_step import AmpSetting, build_train_step
    rng = np.random.default_rng(0)
    images = ms.Tensor(rng.standard_normal((4, 3, 32, 32)).astype(np.float32))
    labels = ms.Tensor(rng.integers(0, 10, 4).astype(np.int32))
    ms.set_seed(3)
    net = build_resnet("resnet18", 10, conv_implementation="onednn_blocked")
    optimizer = build_optimizer(config, net.trainable_params(), np.full(2, learning_rate, np.float32), native=native,
                                gradients_from=net if native else None, gradient_windows=gradient_windows)
    step = build_train_step(net, optimizer, config, AmpSetting("O0"))
    before = {p.name: p.asnumpy().copy() for p in net.trainable_params()}  # asnumpy may share the parameter's memory
    step(images, labels)
    return optimizer, before, {p.name: p.asnumpy().copy() for p in net.trainable_params()}


@pytest.mark.parametrize("clip", [0.0, 0.01], ids=["unclipped", "clipped"])
def test_native_update_with_gradients_from_the_network_moves_the_weights_by_the_gradients(clip):
    """SGD with lr 1 and no momentum or decay moves the weights by exactly minus the gradients. ResNet-18 at 32x32,
    whose layer4 convolutions see one pixel, hands the update its gradients in the kernels' layouts, and windows of
    taps where nothing else reads them: the move is the gradients of MindSpore's optimizer in the same step, and
    with clipping their global norm is grad_clip_norm (a gradient with unwritten memory in it would not be)."""
    from src.model_utils.config import load_config
    from src.train_step import AmpSetting, update_alone_reads_gradients
    config = load_config(["--optimizer", "momentum", "--momentum", "0", "--weight_decay", "0",
                          "--grad_clip_norm", str(clip)])
    moves = []
    for native in (False, True):
        _, before, after = _blocked_resnet18_step(
            config, 1.0, native, gradient_windows=native and update_alone_reads_gradients(config, AmpSetting("O0")))
        moves.append([after[name].astype(np.float64) - old.astype(np.float64) for name, old in before.items()])
    reference, native_move = moves
    norm = np.sqrt(sum(float((m ** 2).sum()) for m in native_move))
    if clip:
        assert norm == pytest.approx(clip, rel=1e-3)
    for want, got in zip(reference, native_move):
        assert np.abs(got - want).max() <= 1e-5 * max(np.abs(want).max(), 1e-30) + 1e-12


@pytest.mark.slow
@pytest.mark.parametrize("kind, graph", [*((kind, True) for kind in PAIRS), ("adam", False)],
                         ids=[*(f"{kind}-graph" for kind in PAIRS), "adam-pynative"])
def test_native_update_in_a_blocked_resnet_step_moves_the_weights_as_the_mindspore_optimizer(kind, graph):
    """A training step on channel blocks, whose gradients pass cells with a bprop of their own (a residual block's
    input fanout), updates the weights themselves: in graph mode, without its mark as writing memory, the native
    update got MindSpore's copies of the weights (TensorMove) and left the weights as they were. The step's weights
    equal those of the MindSpore optimizer it stands for (ResNet-18 at 32x32, one step, in the mode as train.py sets
    it)."""
    from src.utils import set_execution_mode
    memory_level = ms.get_context("memory_optimize_level")  # a number; the mode: conftest's mindspore_mode_restored
    config = load_config(["--optimizer", "adam"] if kind == "adam" else
                         ["--optimizer", "momentum", *(["--nesterov"] if kind == "nesterov" else [])])
    after = []
    try:
        set_execution_mode(graph, "CPU", training=True)
        for native in (True, False):
            optimizer, before, weights = _blocked_resnet18_step(config, 0.01, native)
            assert isinstance(optimizer, PAIRS[kind][0 if native else 1])
            unmoved = [name for name in before if np.array_equal(weights[name], before[name])]
            assert not unmoved, f"native={native}: {unmoved}"
            after.append(weights)
    finally:
        ms.set_context(memory_optimize_level=f"O{memory_level}")
    ours, reference = after
    for name, weights in reference.items():
        np.testing.assert_allclose(ours[name], weights, rtol=2e-6, atol=1e-7, err_msg=name)
