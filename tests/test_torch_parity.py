"""Numerical parity with torchvision after converting a .pth with src.weights.convert, for ResNet-18..152.

For each depth a torchvision network (random weights, randomised BatchNorm parameters and statistics) is saved
with torch.save, converted to a .ckpt by convert_pth_to_ckpt and loaded into our network. Then:

- eval mode: logits equal torchvision's (relative 1e-5 of max |logit|);
- train mode, whole network: logits within what float32 allows (see TRAIN_LOGITS_SPREAD_FACTOR);
- train mode, unit by unit (stem, every residual block, head): given the same input and the same upstream
  gradient as in torch's backward pass, each unit's output, BatchNorm moving statistics, input gradient and the
  cross-entropy gradient of EVERY parameter equal torch's float64 result (relative 1e-3, measured ~1e-6);
- ResNet-18 whole network: every parameter's gradient equals torch's directly (relative 1e-3);
- one Adam step from equal weights on the same batch: the weights after the step differ only as far as the
  gradient differences and MindSpore's epsilon placement explain (bound derived in adam_step_bound).

Why unit by unit: a deep network at initialisation in train mode is chaotic in float32. Train-mode BatchNorm
amplifies rounding differences layer after layer, and a ReLU input within rounding of zero switches off in one run
and not in the other, which moves a whole gradient row. Measured on a batch of 4 at 32x32: torch float32 vs torch
float64 logits 2.5e-3 (ResNet-101) and 3.7e-2 (ResNet-152) apart; whole-network gradients of MindSpore and torch
float32 up to 18 % apart for ResNet-18 (torch float32 is the one that is off: MindSpore is within 1.5e-4 of
float64) and 285 % for ResNet-152. No float32 implementation, torch's included, can match another elementwise
there. Per unit the same comparison is well conditioned (worst 4e-5), and the units compose to the whole gradient
by the chain rule, so every parameter is still checked. torch float64 is the reference per unit so that a ReLU flip
in torch's own float32 run does not count against MindSpore. Within a unit a flip can still happen in MindSpore's
float32 run: at 32x32 maps (the cifar stem's layer1: 262k values per ReLU at batch 4) one or a few ReLU inputs fall
within rounding of zero (measured |z| <= 8e-8 max|z|), and one switched decision moved a conv gradient by 0.6 %
(ResNet-18) to 10 % (bn3.bias, ResNet-50); torch float32 itself is 0.04 % off float64 there. So the float64
reference takes MindSpore's ReLU decisions, and the test checks that they differ from float64's only within
RELU_FLIP_MARGIN of zero; with that, unit gradients match to ~1e-6.

The cifar stem (3x3 stride-1 conv1, no max pool; torchvision's network with conv1 = Conv2d(3, 64, 3, 1, 1) and
maxpool = Identity()) is measured the same way for ResNet-18 and -50 (and ResNet-18 on the blocked convolutions),
eval logits at 32x32.

Run with -s to see the measured numbers.
"""
import copy
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Tuple

import numpy as np
import pytest

import mindspore as ms
from mindspore import nn
from mindspore.nn.utils import no_init_parameters

torch = pytest.importorskip("torch")
torchvision = pytest.importorskip("torchvision")

from conftest import in_fresh_process, randomise_batchnorm, read_ckpt_entries, rel_diff
from src.native_optimizer import NativeAdam
from src.resnet import Bottleneck, build_resnet, conv_bn
from src.weights.convert import convert_pth_to_ckpt, torchvision_resnet
from src.weights.names import mindspore_to_torch_name

ms.set_context(mode=ms.PYNATIVE_MODE)  # per-op execution: no graph compilation for five depths

DEPTHS = ["resnet18", "resnet34", "resnet50", "resnet101", "resnet152"]
NUM_CLASSES = 10
EVAL_SHAPE = (4, 3, 64, 64)  # layer4 at 2x2, so padding at the borders matters up to the last stage
# The cifar stem (3x3 stride-1 conv1, no max pool) at CIFAR's size: layer4 at 4x4.
EVAL_SHAPE_CIFAR = (4, 3, 32, 32)
TRAIN_SHAPE = (4, 3, 32, 32)  # CIFAR's size; train mode computes a backward pass, keep it cheap

EVAL_REL_TOL = 1e-5  # max|ms - torch| / max|torch| on logits
UNIT_FORWARD_REL_TOL = 1e-5  # unit outputs and moving statistics vs torch float64
GRAD_REL_TOL = 1e-3  # max|g_ms - g_ref| / max|g_ref| per parameter (the bound)
# Per unit, the float64 reference takes MindSpore's ReLU decisions; they may differ from float64's own only where
# float64's pre-activation is within this fraction of its tensor's max |value| of zero (rounding, not a bug).
RELU_FLIP_MARGIN = 1e-5
# Whole-network train-mode logits may differ from torch float32 by this many times torch's own float32 error
# (torch float32 vs torch float64, measured in the test), or by TRAIN_LOGITS_FLOOR, whichever is larger.
TRAIN_LOGITS_SPREAD_FACTOR = 4.0
TRAIN_LOGITS_FLOOR = 1e-5

# Adam as in the reference recipe (lr 1e-3, betas, eps), with a weight decay large enough that the decay term
# decides the direction of many first-step updates (the recipe's 1e-5 would not show in a single step).
LR, BETAS, EPS, WEIGHT_DECAY = 1e-3, (0.9, 0.999), 1e-8, 1e-2

WHOLE_GRADIENT_DEPTHS = ("resnet18",)  # shallow enough to compare the whole backward pass (see its test)

MEASURED: Dict[str, Dict[str, float]] = {}  # depth -> numbers, printed at the end of the module


# ----------------------------------------------------------------------------------------------- helpers

def unit_names(tv_net: "torch.nn.Module") -> List[str]:
    """'stem', every residual block ('layer1.0', ...) and 'head', in forward order."""
    blocks = [f"{layer}.{index}" for layer in ("layer1", "layer2", "layer3", "layer4")
              for index in range(len(getattr(tv_net, layer)))]
    return ["stem", *blocks, "head"]


def torch_unit(tv_net: "torch.nn.Module", name: str) -> Callable:
    if name == "stem":
        return lambda x: tv_net.maxpool(tv_net.relu(tv_net.bn1(tv_net.conv1(x))))
    if name == "head":
        return lambda features: tv_net.fc(features)
    layer, index = name.split(".")
    return getattr(tv_net, layer)[int(index)]


def torch_unit_prefixes(name: str) -> Tuple[str, ...]:
    return {"stem": ("conv1.", "bn1."), "head": ("fc.",)}.get(name, (name + ".",))


def ms_unit(net: nn.Cell, name: str) -> Callable:
    if name == "stem":
        return lambda x: net.maxpool(net.relu(net.bn1(net.conv1(x))))
    if name == "head":
        return lambda features: net.fc(features)
    layer, index = name.split(".")
    return getattr(net, layer)[int(index)]


def ms_relu_decisions(net: nn.Cell, name: str, x) -> List[np.ndarray]:
    """MindSpore's ReLU decisions (pre-activation > 0) inside a unit, in forward order, from a train-mode forward of
    its cells as ResNet runs them; the moving statistics this extra forward changes are put back."""
    if name == "head":
        return []
    saved = {p.name: p.asnumpy().copy() for p in net.get_parameters() if ".moving_" in p.name}
    if name == "stem":
        pre = [conv_bn(net.conv1, net.bn1, x)]
    else:
        layer, index = name.split(".")
        block = getattr(net, layer)[int(index)]
        pre = [conv_bn(block.conv1, block.bn1, x)]
        out = conv_bn(block.conv2, block.bn2, block.relu(pre[-1]))
        if isinstance(block, Bottleneck):
            pre.append(out)
            out = conv_bn(block.conv3, block.bn3, block.relu(out))
        identity = x if block.downsample is None else conv_bn(block.downsample[0], block.downsample[1], x)
        pre.append(out + identity)
    decisions = [z.asnumpy() > 0 for z in pre]
    for param in net.get_parameters():
        if param.name in saved:
            param.set_data(ms.Tensor(saved[param.name]))
    return decisions


def torch_unit_with_decisions(tv_net: "torch.nn.Module", name: str, decisions: List[np.ndarray],
                              flips: List[Tuple[int, float]]) -> Callable:
    """torch_unit whose ReLUs take the given decisions (MindSpore's): relu(z) = z * decision. Appends (elements
    where a decision differs from z > 0, their largest |z| / max|z|) to flips for each ReLU."""
    if name == "head":
        return torch_unit(tv_net, name)

    def forward(x):
        remaining = iter(decisions)

        def relu(z):
            decision = torch.from_numpy(next(remaining))
            differ = (z.detach() > 0) != decision
            worst = float(z.detach().abs()[differ].max() / z.detach().abs().max()) if differ.any() else 0.0
            flips.append((int(differ.sum()), worst))
            return z * decision.to(z.dtype)

        if name == "stem":
            return tv_net.maxpool(relu(tv_net.bn1(tv_net.conv1(x))))
        layer, index = name.split(".")
        block = getattr(tv_net, layer)[int(index)]
        out = block.bn2(block.conv2(relu(block.bn1(block.conv1(x)))))
        if isinstance(block, torchvision.models.resnet.Bottleneck):
            out = block.bn3(block.conv3(relu(out)))
        identity = x if block.downsample is None else block.downsample(x)
        return relu(out + identity)
    return forward


def ms_unit_objective(cell: Callable, upstream, loss_fn: nn.Cell, labels) -> Callable:
    """inputs -> (objective, output): sum(output * upstream), whose gradient is upstream backpropagated through
    the unit, or for the head (upstream None) the cross-entropy loss itself."""
    def objective(inputs):
        out = cell(inputs)
        return (loss_fn(out, labels) if upstream is None else (out * upstream).sum()), out
    return objective


def capture_units(tv_net: "torch.nn.Module", images: np.ndarray, labels: np.ndarray):
    """One torch float32 train-mode forward/backward of cross-entropy; returns (logits, parameter gradients,
    {unit: (input, upstream gradient)}) with each unit's input and the gradient arriving at its output."""
    captured: Dict[str, list] = {}
    handles = []

    def hook(name: str):
        def record(module, inputs, output):
            captured[name] = [inputs[0].detach().clone(), None]
            output.register_hook(lambda grad: captured[name].__setitem__(1, grad.detach().clone()))
        return record

    for name in unit_names(tv_net):
        if name == "stem":  # the stem's output is maxpool's; its input is the images
            handles.append(tv_net.maxpool.register_forward_hook(hook(name)))
        elif name == "head":
            handles.append(tv_net.fc.register_forward_hook(hook(name)))
        else:
            handles.append(torch_unit(tv_net, name).register_forward_hook(hook(name)))
    tv_net.train()
    tv_net.zero_grad()
    logits = tv_net(torch.from_numpy(images))
    torch.nn.functional.cross_entropy(logits, torch.from_numpy(labels).long()).backward()
    for handle in handles:
        handle.remove()
    captured["stem"][0] = torch.from_numpy(images)
    grads = {key: p.grad.detach().numpy().copy() for key, p in tv_net.named_parameters()}
    return logits.detach().numpy(), grads, {name: tuple(pair) for name, pair in captured.items()}


def adam_step_bound(w: np.ndarray, g_ms: np.ndarray, g_torch: np.ndarray) -> np.ndarray:
    """Largest |update_ms - update_torch| per element for Adam's first step that gradient differences and
    MindSpore's epsilon placement explain, plus float32 rounding.

    First step with g^ = g + wd*w: torch.optim.Adam moves by lr*g^/(|g^| + eps). MindSpore's nn.Adam (the
    ApplyAdam kernel) adds eps to sqrt(v) before the bias correction, i.e. moves by lr*g^/(|g^| + eps'),
    eps' = eps/sqrt(1 - beta2). With f_e(g) = g/(|g| + e):
      |f_eps'(a) - f_eps(a)| <= (eps' - eps)/(|a| + eps')   and   |f_eps(a) - f_eps(b)| <= 2|a - b|/(max(|a|,|b|) + eps)
    (factor 1 for equal signs; for opposite signs |a - b| >= max(|a|,|b|) and |f| < 1). So an element whose
    gradients agree must step alike, and one whose gradient sign differs may step the other way (2 lr).
    """
    eps_ms = EPS / np.sqrt(1.0 - BETAS[1])
    a = g_ms.astype(np.float64) + WEIGHT_DECAY * w
    b = g_torch.astype(np.float64) + WEIGHT_DECAY * w
    explained = (eps_ms - EPS) / (np.abs(a) + eps_ms) + 2 * np.abs(a - b) / (np.maximum(np.abs(a), np.abs(b)) + EPS)
    return LR * explained + 1e-6 * (np.abs(w) + LR)


# ------------------------------------------------------------------------------------- the measurements

@dataclass
class Parity:
    """Everything measured for one depth (computed once, checked by several tests)."""
    depth: str
    eval_rel: float = 0.0
    eval_scale: float = 0.0
    train_logits_rel: float = 0.0
    train_logits_torch_spread: float = 0.0  # torch float32 vs torch float64
    unit_forward_rel: Dict[str, float] = field(default_factory=dict)
    # unit -> (ReLU decisions MindSpore took otherwise than float64, the largest float64 |z| / max|z| among them)
    unit_relu_flips: Dict[str, Tuple[int, float]] = field(default_factory=dict)
    unit_stats_rel: Dict[str, float] = field(default_factory=dict)
    unit_input_grad_rel: Dict[str, float] = field(default_factory=dict)
    unit_param_grad_rel: Dict[str, float] = field(default_factory=dict)  # torch name -> rel
    whole_grad_rel: Dict[str, float] = field(default_factory=dict)  # torch name -> rel vs torch float32
    whole_grad_rel_f64: Dict[str, float] = field(default_factory=dict)  # vs torch float64 (WHOLE_GRADIENT_DEPTHS)
    whole_grad_torch_spread: float = 0.0  # torch float32 vs float64, worst parameter
    adam_excess: Dict[str, float] = field(default_factory=dict)  # max(|du| - bound), <= 0 passes
    adam_max_diff_in_lr: float = 0.0
    adam_share_over_1pct_lr: float = 0.0
    adam_share_decided_by_decay: float = 0.0
    adam_min_step_in_lr: float = 0.0
    trainable_ms: List[str] = field(default_factory=list)
    trainable_torch: List[str] = field(default_factory=list)
    seconds: float = 0.0


def measure(depth: str, folder, conv_implementation: str = "mindspore", stem: str = "imagenet") -> Parity:
    """stem cifar: torchvision's network with conv1 = Conv2d(3, 64, 3, 1, 1, bias=False) and maxpool = Identity()
    against ours built with stem="cifar" (the converter finds the stem from conv1's shape)."""
    start = time.perf_counter()
    result = Parity(depth)
    rng = np.random.default_rng(DEPTHS.index(depth))
    torch.manual_seed(DEPTHS.index(depth))
    tv_net = torchvision_resnet(depth, NUM_CLASSES, stem)
    randomise_batchnorm(tv_net, rng)
    tv_reference = copy.deepcopy(tv_net).double()  # float64 twin, still with the saved running statistics

    # Convert through files, as a user would.
    pth, ckpt = folder / f"{depth}.pth", folder / f"{depth}.ckpt"
    torch.save(tv_net.state_dict(), pth)
    assert convert_pth_to_ckpt(str(pth), str(ckpt)).stem == stem
    with no_init_parameters():  # every parameter comes from the .ckpt
        net = build_resnet(depth, NUM_CLASSES, conv_implementation=conv_implementation, stem=stem)
    not_loaded, _ = ms.load_param_into_net(net, read_ckpt_entries(ckpt), strict_load=True)
    assert not not_loaded, not_loaded
    pth.unlink()
    ckpt.unlink()

    # Eval mode, whole network.
    images = rng.standard_normal(EVAL_SHAPE_CIFAR if stem == "cifar" else EVAL_SHAPE).astype(np.float32)
    tv_net.eval()
    net.set_train(False)
    with torch.no_grad():
        expected = tv_net(torch.from_numpy(images)).numpy()
    result.eval_rel = rel_diff(net(ms.Tensor(images)).asnumpy(), expected)
    result.eval_scale = float(np.abs(expected).max())

    # Train mode: torch float32 forward/backward with each unit's input and upstream gradient recorded.
    images = rng.standard_normal(TRAIN_SHAPE).astype(np.float32)
    labels = rng.integers(0, NUM_CLASSES, TRAIN_SHAPE[0])
    torch_logits, torch_grads, units = capture_units(tv_net, images, labels)
    torch_weights = {key: p.detach().numpy().copy() for key, p in tv_net.named_parameters()}

    # Unit by unit against torch float64 on the same inputs and upstream gradients (MindSpore network fresh
    # from the .ckpt: its moving statistics are the file's, like the float64 twin's running statistics).
    net.set_train(True)
    tv_reference.train()
    loss_fn = nn.CrossEntropyLoss()
    ms_labels = ms.Tensor(labels.astype(np.int32))
    bn_pairs = {name: module for name, module in tv_reference.named_modules()
                if isinstance(module, torch.nn.BatchNorm2d)}
    ms_parameters = net.parameters_dict()
    for name in unit_names(tv_net):
        unit_input, upstream = units[name]
        ref_input = unit_input.double().requires_grad_(True)
        prefixes = torch_unit_prefixes(name)
        ref_params = {key: p for key, p in tv_reference.named_parameters() if key.startswith(prefixes)}
        for p in ref_params.values():
            p.grad = None
        x = ms.Tensor(unit_input.numpy())
        # A ReLU input within rounding of zero may switch the other way in MindSpore's float32 than in float64 (at
        # 32x32 maps, the cifar stem's layer1, it happens in a few units): the float64 reference takes MindSpore's
        # decisions, and the test checks they differ only there (RELU_FLIP_MARGIN).
        flips: List[Tuple[int, float]] = []
        reference_unit = torch_unit_with_decisions(tv_reference, name, ms_relu_decisions(net, name, x), flips)
        if name == "head":  # the loss itself is part of the head
            ref_out = reference_unit(ref_input)
            torch.nn.functional.cross_entropy(ref_out, torch.from_numpy(labels).long()).backward()
        else:
            ref_out = reference_unit(ref_input)
            (ref_out * upstream.double()).sum().backward()
        result.unit_relu_flips[name] = (sum(count for count, _ in flips), max((w for _, w in flips), default=0.0))

        cell = ms_unit(net, name)
        params = [p for p in net.trainable_params() if mindspore_to_torch_name(p.name) in ref_params]
        assert sorted(mindspore_to_torch_name(p.name) for p in params) == sorted(ref_params), name
        objective = ms_unit_objective(cell, None if name == "head" else ms.Tensor(upstream.numpy()), loss_fn,
                                      ms_labels)
        (_, out), (grad_input, grad_params) = ms.value_and_grad(objective, 0, params, has_aux=True)(x)
        result.unit_forward_rel[name] = rel_diff(out.asnumpy(), ref_out.detach().numpy())
        result.unit_input_grad_rel[name] = rel_diff(grad_input.asnumpy(), ref_input.grad.numpy())
        for p, g in zip(params, grad_params):
            key = mindspore_to_torch_name(p.name)
            result.unit_param_grad_rel[key] = rel_diff(g.asnumpy(), ref_params[key].grad.numpy())
        # Moving statistics after this one train-mode forward (momentum 0.1 in torch's convention).
        for module_name, bn in bn_pairs.items():
            if (module_name + ".").startswith(prefixes):
                for ms_field, torch_field in (("moving_mean", "running_mean"), ("moving_variance", "running_var")):
                    ms_value = ms_parameters[f"{module_name}.{ms_field}"].asnumpy()
                    stat = f"{module_name}.{ms_field}"
                    result.unit_stats_rel[stat] = rel_diff(ms_value, getattr(bn, torch_field).numpy())

    # Whole network, train mode: logits (and the float32-vs-float64 spread of torch itself) and gradients.
    with torch.no_grad():
        ref_logits = tv_reference(torch.from_numpy(images).double()).numpy()
    params = net.trainable_params()
    result.trainable_ms = [mindspore_to_torch_name(p.name) for p in params]
    result.trainable_torch = list(torch_grads)

    def whole(inputs, targets):
        out = net(inputs)
        return loss_fn(out, targets), out
    (_, ms_logits), ms_grads = ms.value_and_grad(whole, None, params, has_aux=True)(ms.Tensor(images), ms_labels)
    scale = float(np.abs(ref_logits).max())
    result.train_logits_rel = float(np.abs(ms_logits.asnumpy() - torch_logits).max()) / scale
    result.train_logits_torch_spread = float(np.abs(torch_logits - ref_logits).max()) / scale
    ms_grads = {mindspore_to_torch_name(p.name): g.asnumpy() for p, g in zip(params, ms_grads)}
    result.whole_grad_rel = {key: rel_diff(ms_grads[key], torch_grads[key]) for key in torch_grads}
    if depth in WHOLE_GRADIENT_DEPTHS:  # float64 reference for the whole backward pass
        tv_reference.zero_grad()
        out = tv_reference(torch.from_numpy(images).double())
        torch.nn.functional.cross_entropy(out, torch.from_numpy(labels).long()).backward()
        ref = {key: p.grad.numpy() for key, p in tv_reference.named_parameters()}
        result.whole_grad_rel_f64 = {key: rel_diff(ms_grads[key], ref[key]) for key in ref}
        result.whole_grad_torch_spread = max(rel_diff(torch_grads[key], ref[key]) for key in ref)

    # One Adam step from equal weights, each framework with its own gradients of the same batch. The group form
    # applies weight_decay to every parameter as torch does (ungrouped, MindSpore skips names with
    # 'gamma'/'beta', i.e. BatchNorm, unless told otherwise).
    before = {key: p.asnumpy().copy() for key, p in zip(result.trainable_ms, params)}
    for key, value in before.items():
        assert np.array_equal(value, torch_weights[key]), key
    optimizer = nn.Adam([{"params": params, "weight_decay": WEIGHT_DECAY}], learning_rate=LR, beta1=BETAS[0],
                        beta2=BETAS[1], eps=EPS)
    optimizer(tuple(ms.Tensor(ms_grads[key]) for key in result.trainable_ms))
    # fused: torch's single-kernel Adam (same update; 25x faster on CPU than the per-tensor loop for 60M weights).
    torch_optimizer = torch.optim.Adam(tv_net.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY,
                                       fused=True)
    torch_optimizer.step()  # uses the gradients of capture_units' backward pass
    after_torch = {key: p.detach().numpy() for key, p in tv_net.named_parameters()}
    worst, over, decided, total, min_step = 0.0, 0, 0, 0, np.inf
    for key, p in zip(result.trainable_ms, params):
        w = before[key].astype(np.float64)
        step_ms, step_torch = p.asnumpy() - w, after_torch[key] - w
        diff = np.abs(step_ms - step_torch)
        result.adam_excess[key] = float((diff - adam_step_bound(w, ms_grads[key], torch_grads[key])).max())
        worst = max(worst, float(diff.max()) / LR)
        over += int((diff > 0.01 * LR).sum())
        # Elements whose step direction the decay term decides (sign of g + wd*w differs from sign of g).
        decided += int((np.sign(torch_grads[key]) != np.sign(torch_grads[key] + WEIGHT_DECAY * w)).sum())
        total += diff.size
        min_step = min(min_step, float(np.abs(step_torch).max()) / LR)
    result.adam_max_diff_in_lr = worst
    result.adam_share_over_1pct_lr = over / total
    result.adam_share_decided_by_decay = decided / total
    result.adam_min_step_in_lr = min_step
    result.seconds = time.perf_counter() - start
    return result


# The blocked-layout convolutions (src/onednn_conv.py) must pass the same tests with the same tolerances: one
# network of each block type, to keep the suite's time down. The cifar stem (3x3 stride-1 conv1, no max pool) the
# same: ResNet-18 and -50 at 32x32, and ResNet-18 on the blocked convolutions.
CASES = [(depth, "mindspore", "imagenet") for depth in DEPTHS] + [
    ("resnet18", "onednn_blocked", "imagenet"), ("resnet50", "onednn_blocked", "imagenet"),
    ("resnet18", "mindspore", "cifar"), ("resnet50", "mindspore", "cifar"), ("resnet18", "onednn_blocked", "cifar")]


# The cases measured together, in one new process each: a process pays MindSpore's and torch's imports (about 5 s)
# once for its group. The shallow networks leave little memory behind; ResNet-101 and -152 get a process each.
PROCESS_GROUPS = [[case for case in CASES if case[0] in depths]
                  for depths in (("resnet18", "resnet34"), ("resnet50",), ("resnet101",), ("resnet152",))]
assert sorted(case for group in PROCESS_GROUPS for case in group) == sorted(CASES)
RESULTS: Dict[Tuple[str, str, str], Parity] = {}  # case -> its measurement, as each group is measured


def case_id(case) -> str:
    """resnet18, resnet18-onednn_blocked, resnet18-cifar, resnet18-onednn_blocked-cifar."""
    return "-".join(part for part in case if part not in ("mindspore", "imagenet"))


def measure_cases(cases: List[Tuple[str, str, str]], folders: List[Path]) -> List[Parity]:
    return [measure(depth, folder, conv_implementation, stem)
            for (depth, conv_implementation, stem), folder in zip(cases, folders)]


@pytest.fixture(scope="module", params=CASES, ids=case_id)
def parity(request, tmp_path_factory) -> Parity:
    depth, conv_implementation, stem = request.param
    if request.param not in RESULTS:
        group = next(group for group in PROCESS_GROUPS if request.param in group)
        folders = [tmp_path_factory.mktemp(case[0]) for case in group]
        RESULTS.update(zip(group, in_fresh_process(measure_cases, group, folders)))
    result = RESULTS[request.param]
    label = ", ".join(part for part in (conv_implementation, f"{stem} stem") if part not in ("mindspore", "imagenet stem"))
    MEASURED[f"{depth} ({label})" if label else depth] = {
        "eval logits rel": result.eval_rel,
        "train logits rel vs torch f32": result.train_logits_rel,
        "torch f32 vs f64 train logits": result.train_logits_torch_spread,
        "unit forward rel": max(result.unit_forward_rel.values()),
        "ReLU decisions unlike float64": sum(count for count, _ in result.unit_relu_flips.values()),
        "their max |z| / max|z|": max(worst for _, worst in result.unit_relu_flips.values()),
        "moving stats rel": max(result.unit_stats_rel.values()),
        "unit grads rel (worst param)": max(result.unit_param_grad_rel.values()),
        "unit input grads rel": max(result.unit_input_grad_rel.values()),
        "whole-net grads rel vs torch f32": max(result.whole_grad_rel.values()),
        **({"whole-net grads rel vs torch f64": max(result.whole_grad_rel_f64.values()),
            "torch f32 vs f64 whole-net grads": result.whole_grad_torch_spread} if result.whole_grad_rel_f64 else {}),
        "adam max |dw| diff / lr": result.adam_max_diff_in_lr,
        "adam share > 1% lr": result.adam_share_over_1pct_lr,
        "adam share decided by decay": result.adam_share_decided_by_decay,
        "seconds": result.seconds,
    }
    return result


@pytest.fixture(scope="module", autouse=True)
def print_measurements():
    yield
    if MEASURED:
        print("\nmeasured parity with torchvision (relative = max|diff| / max|reference|):")
        for depth, numbers in MEASURED.items():
            print(f"  {depth}: " + ", ".join(f"{key} {value:.3g}" for key, value in numbers.items()))


# ------------------------------------------------------------------------------------------------ tests

@pytest.mark.slow
def test_eval_logits_match(parity):
    """Eval mode with the converted weights gives torchvision's logits (relative 1e-5 of max |logit|)."""
    assert parity.eval_scale > 1e-3  # a meaningful output, not all zeros
    assert parity.eval_rel <= EVAL_REL_TOL, f"{parity.depth}: eval logits differ by {parity.eval_rel:.3g} relative"


@pytest.mark.slow
def test_train_mode_unit_outputs_and_moving_statistics_match(parity):
    """Train mode (batch statistics): every unit's output and every BatchNorm's moving statistics after the
    forward equal torch float64's on the same input."""
    bad = {name: rel for name, rel in parity.unit_forward_rel.items() if rel > UNIT_FORWARD_REL_TOL}
    assert not bad, f"{parity.depth}: unit outputs differ: {bad}"
    n_bn = sum(1 for key in parity.trainable_torch if key.endswith(".bias") and not key.startswith("fc."))
    assert len(parity.unit_stats_rel) == 2 * n_bn  # every BatchNorm's mean and variance was compared
    bad = {name: rel for name, rel in parity.unit_stats_rel.items() if rel > UNIT_FORWARD_REL_TOL}
    assert not bad, f"{parity.depth}: moving statistics differ: {dict(list(bad.items())[:5])}"


@pytest.mark.slow
def test_train_mode_whole_network_logits_match(parity):
    """Whole network in train mode: logits differ from torch float32 no more than float32 itself allows here
    (TRAIN_LOGITS_SPREAD_FACTOR x torch's own float32-vs-float64 difference, at least TRAIN_LOGITS_FLOOR)."""
    bound = max(TRAIN_LOGITS_FLOOR, TRAIN_LOGITS_SPREAD_FACTOR * parity.train_logits_torch_spread)
    assert parity.train_logits_rel <= bound, (
        f"{parity.depth}: train-mode logits differ by {parity.train_logits_rel:.3g} relative; torch's own "
        f"float32 error is {parity.train_logits_torch_spread:.3g}")


@pytest.mark.slow
def test_cross_entropy_gradients_of_every_parameter_match(parity):
    """Every trainable parameter's gradient (unit by unit, same inputs and upstream gradients as torch's
    backward) equals torch float64's within relative 1e-3; so does every unit's input gradient."""
    assert sorted(parity.unit_param_grad_rel) == sorted(parity.trainable_torch)  # every parameter, once
    # The reference took MindSpore's ReLU decisions: they differ from float64's only within rounding of zero.
    bad = {name: flips for name, flips in parity.unit_relu_flips.items() if flips[1] > RELU_FLIP_MARGIN}
    assert not bad, f"{parity.depth}: ReLU decisions differ from float64's away from zero (count, |z|/max|z|): {bad}"
    assert sorted(parity.trainable_ms) == sorted(parity.trainable_torch)
    bad = {key: rel for key, rel in parity.unit_param_grad_rel.items() if rel > GRAD_REL_TOL}
    assert not bad, f"{parity.depth}: gradients differ (relative): {dict(list(bad.items())[:5])}"
    bad = {name: rel for name, rel in parity.unit_input_grad_rel.items() if rel > GRAD_REL_TOL}
    assert not bad, f"{parity.depth}: input gradients differ (relative): {bad}"


@pytest.mark.slow
def test_whole_network_gradients_match_for_resnet18(parity):
    """ResNet-18 is shallow enough to compare the whole backward pass: every parameter's gradient equals torch
    float64's within relative 1e-3 (measured 1.5e-4; torch's own float32 run is 18 % off here: a ReLU flip, see
    the module docstring)."""
    if parity.depth not in WHOLE_GRADIENT_DEPTHS:
        pytest.skip("deeper networks are chaotic in train-mode float32 (see the module docstring); "
                    "their gradients are compared unit by unit")
    assert sorted(parity.whole_grad_rel_f64) == sorted(parity.trainable_torch)
    bad = {key: rel for key, rel in parity.whole_grad_rel_f64.items() if rel > GRAD_REL_TOL}
    assert not bad, f"whole-network gradients differ from torch float64 (relative): {bad}"


@pytest.mark.slow
def test_one_adam_step_gives_equal_weights(parity):
    """nn.Adam and torch.optim.Adam (same lr, betas, eps, weight_decay) take one step from equal weights on the
    same batch; every element of every parameter ends within adam_step_bound of torch's."""
    assert parity.adam_min_step_in_lr > 0.5  # every parameter really moved (first Adam step ~ lr)
    assert parity.adam_share_decided_by_decay > 1e-3  # the weight decay term matters in this step
    bad = {key: excess for key, excess in parity.adam_excess.items() if excess > 0}
    assert not bad, (f"{parity.depth}: weights after one Adam step differ beyond what the gradient differences "
                     f"explain (excess over the bound, absolute): {dict(list(bad.items())[:5])}")



@pytest.mark.parametrize("adam", [nn.Adam, NativeAdam], ids=["nn_adam", "native_adam"])
def test_adam_matches_torch_over_several_steps(adam):
    """The optimizer alone over three steps (a first step cannot show beta1: the bias correction cancels it):
    nn.Adam (or NativeAdam, its one-pass form) in the group form and torch.optim.Adam with the same lr, betas, eps
    and weight_decay, fed the same gradients, keep equal weights. The gradients are far above eps, where MindSpore's
    eps placement (eps added before the bias correction) changes a step by under 1e-4 lr."""
    rng = np.random.default_rng(7)
    shapes = {"conv.weight": (8, 4, 3, 3), "bn.gamma": (8,), "bn.beta": (8,), "fc.weight": (5, 8), "fc.bias": (5,)}
    start = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}
    ms_params = [ms.Parameter(ms.Tensor(value.copy()), name=name) for name, value in start.items()]
    torch_params = [torch.nn.Parameter(torch.from_numpy(value.copy())) for value in start.values()]
    ms_adam = adam([{"params": ms_params, "weight_decay": WEIGHT_DECAY}], learning_rate=LR, beta1=BETAS[0],
                   beta2=BETAS[1], eps=EPS)
    torch_adam = torch.optim.Adam(torch_params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    steps = 3
    for _ in range(steps):
        # |g| in [0.05, 1] with random signs: larger than the decay term (0.01 |w|), so g + wd*w stays off zero.
        grads = [(rng.choice([-1.0, 1.0], shape) * 10 ** rng.uniform(-1.3, 0.0, shape)).astype(np.float32)
                 for shape in shapes.values()]
        ms_adam(tuple(ms.Tensor(g) for g in grads))
        for param, g in zip(torch_params, grads):
            param.grad = torch.from_numpy(g.copy())
        torch_adam.step()
    for name, ms_param, torch_param in zip(shapes, ms_params, torch_params):
        moved = np.abs(torch_param.detach().numpy() - start[name]).max()
        assert moved > 0.5 * LR, name
        difference = np.abs(ms_param.asnumpy() - torch_param.detach().numpy()).max()
        assert difference <= 1e-3 * LR * steps, f"{name}: weights differ by {difference / LR:.3g} lr after {steps} steps"
