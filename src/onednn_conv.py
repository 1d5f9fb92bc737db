"""Convolutions run by oneDNN on blocked memory layouts, as MindSpore Custom (aot) operators on CPU.

MindSpore 2.10 gives oneDNN plain NCHW tensors, which gets im2col+GEMM kernels at best (and, unless the
instruction set is capped at AVX2, oneDNN's slow reference kernels). native/onednn_conv.cc lets oneDNN
choose its layouts, as PyTorch does, and gets the direct AVX-512 kernels. `BlockedConv2d` is an
nn.Conv2d (same parameters, initialisation and checkpoints) whose forward and gradients go through it.
"""
import ctypes
import functools
import os
from pathlib import Path
from typing import Callable, Optional, Tuple

import mindspore as ms
from mindspore import nn, ops
from mindspore.ops import constexpr

from src.errors import UserError
from src.model_utils.config import CHOICES
from src.file_hash import file_digest

SOURCE_PATH = Path(__file__).resolve().parents[1] / "native" / "onednn_conv.cc"
BUILD_COMMAND = "python -m pip install ./native"
# The (stride, padding) pairs native/onednn_conv.cc exports a function for.
SUPPORTED_STRIDES = (1, 2)
SUPPORTED_PADDINGS = (0, 1, 2, 3)
# Activation layouts of the training ops: MindSpore's plain NCHW, or oneDNN's channel blocks (nChw16c, nChw8c
# without AVX-512) in a tensor of the same (N, C, H, W) shape, which MindSpore's element-wise ops (ReLU, the
# residual addition and their gradients) handle as they handle any other order of the same numbers.
PLAIN, BLOCKED = 0, 1
# The layouts a training convolution may leave its weight gradient in (native/onednn_conv.cc's WeightGradient).
GRADIENT_PLAIN, GRADIENT_BLOCKS, GRADIENT_BLOCKS_OR_WINDOW = 0, 1, 2


@functools.lru_cache(maxsize=None)
def native_library() -> Tuple[Optional[str], str]:
    """(path of the built library, "") when it can be used, else (None, why not and what to do)."""
    try:
        import resnet_onednn_conv
    except ImportError:
        return None, f"the native convolution library is not installed: run {BUILD_COMMAND}"
    library = resnet_onednn_conv.LIBRARY_PATH
    if not library.exists():
        error = resnet_onednn_conv.BUILD_ERROR_PATH
        cause = error.read_text(errors="replace").splitlines()[0] if error.exists() else "no library file"
        return None, f"the native convolution library failed to build ({cause}); fix that and run {BUILD_COMMAND}"
    try:
        built_from = ctypes.CDLL(str(library)).onednn_conv_source_digest
        built_from.restype = ctypes.c_char_p
        built_digest = built_from().decode()
    except (OSError, AttributeError) as error:
        return None, f"the native convolution library {library} does not load ({error}); run {BUILD_COMMAND}"
    if SOURCE_PATH.exists() and built_digest != file_digest(str(SOURCE_PATH), "sha256"):
        return None, f"the installed native convolution library was built from another {SOURCE_PATH.name}: " \
                     f"run {BUILD_COMMAND}"
    return str(library), ""


def usable_library() -> str:
    """The built library's path; RuntimeError with the reason when it can't be used (callers resolved
    conv_implementation first, so this is a programming error, not a user's)."""
    library, why_not = native_library()
    if library is None:
        raise RuntimeError(why_not)
    return library


def native_thread_count() -> int:
    """Threads the native convolutions should use: OMP_NUM_THREADS as the process was started with (os.environ
    keeps that value; MindSpore sets the C-level variable to 1 when it loads), else the CPUs this process may
    run on, shared among the msrun workers of its machine: RESNET_LOCAL_WORKERS, which the launcher sets to this
    node's worker count, else msrun's MS_WORKER_NUM, which counts every node's workers (a single-machine job
    started with msrun by hand)."""
    requested = os.environ.get("OMP_NUM_THREADS", "")
    if requested.isdigit() and int(requested) > 0:
        return int(requested)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    workers = ""
    if os.environ.get("MS_ROLE") == "MS_WORKER":
        workers = os.environ.get("RESNET_LOCAL_WORKERS") or os.environ.get("MS_WORKER_NUM", "")
    return max(1, cpus // int(workers)) if workers.isdigit() and int(workers) > 0 else cpus


def set_native_threads(threads: int) -> int:
    """Sizes the native library's thread pool (before its first convolution); returns the size in use."""
    return int(ctypes.CDLL(usable_library()).onednn_conv_set_threads(int(threads)))


@functools.lru_cache(maxsize=None)
def channel_block() -> int:
    """Channels per block of the native blocked layouts: 16 where oneDNN runs AVX-512 code, else 8; oneDNN has jit
    kernels only for its ISA's block. Fixes oneDNN's ISA for the process, so call it after choose_convolutions."""
    return int(ctypes.CDLL(usable_library()).onednn_conv_channel_block())


def resolve_conv_implementation(requested: str, device_target: str, amp_level: str = "O0") -> Tuple[str, str]:
    """(implementation in use, why): 'auto' takes onednn_blocked on CPU when the library is usable and the
    convolutions run in float32 (amp_level O0; every other level casts them to float16)."""
    if requested not in CHOICES["conv_implementation"]:
        raise UserError(f"conv_implementation {requested!r} is not one of {', '.join(CHOICES['conv_implementation'])}")
    if requested == "mindspore":
        return "mindspore", "requested"
    if amp_level != "O0":
        if requested == "onednn_blocked":
            raise UserError(f"conv_implementation onednn_blocked runs float32 convolutions only and amp_level "
                            f"{amp_level} casts them to float16: set --conv_implementation auto or mindspore, or "
                            "--amp_level O0")
        return "mindspore", f"amp_level {amp_level} runs float16 convolutions, which the native library has none of"
    if device_target != "CPU":
        if requested == "onednn_blocked":
            raise UserError(f"conv_implementation onednn_blocked runs on CPU only, not {device_target}; "
                            f"set --conv_implementation auto or mindspore")
        return "mindspore", f"{device_target} has its own convolution kernels"
    library, why_not = native_library()
    if library is None:
        if requested == "onednn_blocked":
            raise UserError(f"conv_implementation onednn_blocked: {why_not}")
        return "mindspore", why_not
    return "onednn_blocked", library


def _output_shape_is_last_input(first, second, last):
    return last


def _output_dtype_is_last_input(first, second, last):
    return last


@functools.lru_cache(maxsize=None)
def _forward_op(stride: int, padding: int) -> ops.Custom:
    """The forward Custom op for one (stride, padding), with its gradient ops as bprop."""
    library = usable_library()
    suffix = f"_s{stride}_p{padding}"
    # The backward ops take a third input only for its shape (the result's), which aot ops can't be told.
    backward_data = ops.Custom(f"{library}:ConvBackwardData{suffix}", _output_shape_is_last_input,
                               _output_dtype_is_last_input, func_type="aot")
    backward_weights = ops.Custom(f"{library}:ConvBackwardWeights{suffix}", _output_shape_is_last_input,
                                  _output_dtype_is_last_input, func_type="aot")

    def output_shape(x_shape, w_shape):
        return (x_shape[0], w_shape[0], (x_shape[2] + 2 * padding - w_shape[2]) // stride + 1,
                (x_shape[3] + 2 * padding - w_shape[3]) // stride + 1)

    def output_dtype(x_dtype, w_dtype):
        return x_dtype

    def bprop(x, weight, out, dout):
        return backward_data(dout, weight, x), backward_weights(dout, x, weight)

    return ops.Custom(f"{library}:ConvForward{suffix}", output_shape, output_dtype, func_type="aot", bprop=bprop)


@functools.lru_cache(maxsize=None)
def relu_mask_bytes(y_shape: Tuple[int, int, int, int]) -> int:
    """Bytes of the mask a conv+BatchNorm call returns for its ReLU's gradient, for an output of y_shape."""
    count = ctypes.CDLL(usable_library()).onednn_conv_relu_mask_bytes
    count.restype = ctypes.c_int64
    count.argtypes = [ctypes.c_int64] * 4
    size = int(count(*y_shape))
    if size < 0:
        raise RuntimeError(f"the native library has no ReLU mask for output shape {y_shape}")
    return size


@functools.lru_cache(maxsize=None)
def _conv_batchnorm_op(stride: int, padding: int, defer_input_gradient: bool = False,
                       residual_add_relu: bool = False, relu_gradient_by_users: bool = False) -> ops.Custom:
    """Convolution then BatchNorm on the batch's statistics in one native call (training), and a ReLU where the
    layouts say so, with its gradient op as bprop: (x, weight, gamma, beta, moving mean, moving variance, (eps,
    momentum), layouts (x's, y's: PLAIN or BLOCKED; the weight gradient's, BlockedConv2d.weight_gradient_layout;
    1 for the ReLU, else 0)) -> (y, the convolution's output in channel
    blocks, kept for the gradient, batch mean, batch variance (biased), new moving mean, new moving variance, the
    ReLU's mask for the gradient: uint8, a bit a number, unused without the ReLU).
    The gradient of x comes in x's layout.

    defer_input_gradient: the gradient of x is a native call of its own, so that the graph drops it where nothing
    uses it (a network's first convolution: training differentiates the weights, not the images).
    residual_add_relu: a residual block's end, y = relu(BatchNorm(conv(x)) + residual), with the residual (in
    channel blocks, as y) an input after the layouts, which have no ReLU of the BatchNorm's own.
    relu_gradient_by_users: with residual_add_relu, y's users apply the ReLU's gradient (ReluOutputFanout,
    ReluOutputGradient), so that the bprop starts from the sum's gradient."""
    library = usable_library()
    suffix = f"_s{stride}_p{padding}"
    if residual_add_relu:
        make_bprop = functools.partial(_conv_batchnorm_add_relu_bprop, relu_gradient=not relu_gradient_by_users)
    else:
        make_bprop = _conv_batchnorm_bprop_deferred if defer_input_gradient else _conv_batchnorm_bprop

    def output_shape(x_shape, w_shape, gamma_shape, *others):
        y_shape = (x_shape[0], w_shape[0], (x_shape[2] + 2 * padding - w_shape[2]) // stride + 1,
                   (x_shape[3] + 2 * padding - w_shape[3]) // stride + 1)
        mask_shape = (relu_mask_bytes(tuple(int(d) for d in y_shape)),)
        return y_shape, y_shape, gamma_shape, gamma_shape, gamma_shape, gamma_shape, mask_shape

    def output_dtype(x_dtype, *others):
        return (x_dtype,) * 6 + (ms.uint8,)

    name = "ConvBnAddReluForward" if residual_add_relu else "ConvBnForward"
    return ops.Custom(f"{library}:{name}{suffix}", output_shape, output_dtype, func_type="aot",
                      bprop=make_bprop(library, suffix))


def _four_of_first_dtype(first, *others):
    return first, first, first, first


def _five_of_first_dtype(first, *others):
    return first, first, first, first, first


def _first_dtype(first, *others):
    return first


def _conv_batchnorm_bprop(library: str, suffix: str) -> Callable:
    """ConvBnForward's bprop: dx, dw, dgamma and dbeta from one native call. Its fifth output is the call's working
    memory (the convolution's output gradient): MindSpore's, so that it is reused once the call is done."""
    def backward_shape(dy, conv_out, mean, variance, gamma, constants, layouts, x, weight, relu_mask):
        return x, weight, gamma, gamma, dy

    backward = ops.Custom(f"{library}:ConvBnBackward{suffix}", backward_shape, _five_of_first_dtype,
                          func_type="aot")

    def bprop(x, weight, gamma, beta, moving_mean, moving_variance, constants, layouts, out, dout):
        # Only y carries a gradient: conv_out, mean and variance are for this bprop, the moving statistics are
        # assigned.
        dx, dw, dgamma, dbeta, _ = backward(dout[0], out[1], out[2], out[3], gamma, constants, layouts, x, weight,
                                            out[6])
        return (dx, dw, dgamma, dbeta, ops.zeros_like(moving_mean), ops.zeros_like(moving_variance),
                ops.zeros_like(constants), ops.zeros_like(layouts))

    return bprop


def _conv_batchnorm_add_relu_bprop(library: str, suffix: str, relu_gradient: bool = True) -> Callable:
    """ConvBnAddReluForward's bprop: ReLU's gradient from y (the residual's gradient too), then ConvBnForward's.
    relu_gradient=False: y's users applied the ReLU's gradient already (see ReluOutputFanout)."""
    gradient = _relu_gradient_op(library)
    conv_batchnorm_bprop = _conv_batchnorm_bprop(library, suffix)

    def bprop(x, weight, gamma, beta, moving_mean, moving_variance, constants, layouts, residual, out, dout):
        d_sum = gradient(dout[0], out[0]) if relu_gradient else dout[0]
        return conv_batchnorm_bprop(x, weight, gamma, beta, moving_mean, moving_variance, constants, layouts, out,
                                    (d_sum,)) + (d_sum,)

    return bprop


def _conv_batchnorm_bprop_deferred(library: str, suffix: str) -> Callable:
    """ConvBnForward's bprop with dx in a native call of its own, after the one for dw, dgamma and dbeta, which
    hands it the convolution's output gradient."""
    def weights_shape(dy, conv_out, mean, variance, gamma, constants, layouts, x, weight, relu_mask):
        return dy, weight, gamma, gamma  # the convolution's output gradient (blocked), dw, dgamma, dbeta

    def data_shape(d_conv_out, weight, layouts, x):
        return x

    backward_weights = ops.Custom(f"{library}:ConvBnBackwardWeights{suffix}", weights_shape, _four_of_first_dtype,
                                  func_type="aot")
    backward_data = ops.Custom(f"{library}:ConvBnBackwardData{suffix}", data_shape, _first_dtype, func_type="aot")

    def bprop(x, weight, gamma, beta, moving_mean, moving_variance, constants, layouts, out, dout):
        d_conv_out, dw, dgamma, dbeta = backward_weights(dout[0], out[1], out[2], out[3], gamma, constants, layouts,
                                                         x, weight, out[6])
        return (backward_data(d_conv_out, weight, layouts, x), dw, dgamma, dbeta, ops.zeros_like(moving_mean),
                ops.zeros_like(moving_variance), ops.zeros_like(constants), ops.zeros_like(layouts))

    return bprop


def _same_shape(shape):
    return shape


def _same_dtype(dtype):
    return dtype


@functools.lru_cache(maxsize=None)
def _reorder_ops() -> Tuple[ops.Custom, ops.Custom]:
    """(plain -> channel blocks, channel blocks -> plain), each the other's gradient."""
    library = usable_library()
    to_blocked = ops.Custom(f"{library}:ToBlocked", _same_shape, _same_dtype, func_type="aot")
    from_blocked = ops.Custom(f"{library}:FromBlocked", _same_shape, _same_dtype, func_type="aot")

    def to_bprop(x, out, dout):
        return (from_blocked(dout),)

    def from_bprop(x, out, dout):
        return (to_blocked(dout),)

    return (ops.Custom(f"{library}:ToBlocked", _same_shape, _same_dtype, func_type="aot", bprop=to_bprop),
            ops.Custom(f"{library}:FromBlocked", _same_shape, _same_dtype, func_type="aot", bprop=from_bprop))


class ChannelBlocks(nn.Cell):
    """Reorders a float32 (N, C, H, W) activation into oneDNN's channel blocks (to_blocked) or back; the gradient
    goes the other way. C must be a multiple of channel_block()."""

    def __init__(self, to_blocked: bool) -> None:
        super().__init__()
        self.op = _reorder_ops()[0 if to_blocked else 1]

    def construct(self, x):
        return self.op(x)


def _pooled_shape(x_shape):  # kernel 3, stride 2, padding 1
    pooled = (x_shape[0], x_shape[1], (x_shape[2] - 1) // 2 + 1, (x_shape[3] - 1) // 2 + 1)
    return pooled, pooled


def _pooled_dtypes(x_dtype):
    return x_dtype, ms.uint8


@functools.lru_cache(maxsize=None)
def _relu_max_pool_op() -> ops.Custom:
    """ReLU then torch's MaxPool2d(3, 2, padding=1) on channel blocks, for training: x -> (y, each output's argmax,
    which the gradient reads); its gradient op as bprop."""
    library = usable_library()

    def backward_shape(dy, y, workspace, x):
        return x, dy  # dx, and the call's working memory (dy masked by the ReLU's gradient)

    backward = ops.Custom(f"{library}:ReluMaxPoolGrad_k3_s2_p1", backward_shape,
                          lambda dy, *others: (dy, dy), func_type="aot")

    def bprop(x, out, dout):
        return (backward(dout[0], out[0], out[1], x)[0],)

    return ops.Custom(f"{library}:ReluMaxPool_k3_s2_p1", _pooled_shape, _pooled_dtypes, func_type="aot",
                      bprop=bprop)


class ReluMaxPool(nn.Cell):
    """ReLU then torch's MaxPool2d(3, 2, padding=1) (ResNet's imagenet stem), on a float32 (N, C, H, W) activation in
    channel blocks, in one native call; so is its gradient. C must be a multiple of channel_block()."""

    def __init__(self) -> None:
        super().__init__()
        self.op = _relu_max_pool_op()

    def construct(self, x):
        return self.op(x)[0]


@functools.lru_cache(maxsize=None)
def _relu_gradient_op(library: str) -> ops.Custom:
    """(dy, y) -> 0 where the ReLU's output y is <= 0 and dy elsewhere (as torch's), element-wise in one native pass."""
    return ops.Custom(f"{library}:ReluGradient", lambda dy, y: dy, lambda dy, y: dy, func_type="aot")


@functools.lru_cache(maxsize=None)
def _relu_gradient_of_sum_op(library: str) -> ops.Custom:
    """(da, db, y) -> 0 where the ReLU's output y is <= 0 and da + db elsewhere, element-wise in one native pass."""
    return ops.Custom(f"{library}:ReluGradientOfSum", lambda da, db, y: da, lambda da, db, y: da, func_type="aot")


class ReluOutputFanout(nn.Cell):
    """x -> (x, x) for the two users of a ReLU's output x (a residual block's input: its first convolution and its
    identity) in a training step on channel blocks; the forward copies nothing. x's gradient is the ReLU's gradient of
    the sum of theirs, in one native pass, where MindSpore's automatic differentiation would add them (AddN) and the
    bprop of the op that made x would then apply the ReLU's gradient in a pass of its own. That op need not apply it
    again (doing so changes no number, only costs a pass): a block's end built with relu_gradient_by_users skips it."""

    def __init__(self) -> None:
        super().__init__()
        self.gradient = _relu_gradient_of_sum_op(usable_library())

    def construct(self, x):
        return x, x

    def bprop(self, x, out, dout):
        return (self.gradient(dout[0], dout[1], x),)


class ReluOutputGradient(nn.Cell):
    """The identity on a ReLU's output x, whose bprop applies the ReLU's gradient: for the one user of a residual
    block's output whose ReLU gradient the block leaves to its users (see ReluOutputFanout), the network's last."""

    def __init__(self) -> None:
        super().__init__()
        self.gradient = _relu_gradient_op(usable_library())

    def construct(self, x):
        return x

    def bprop(self, x, out, dout):
        return (self.gradient(dout, x),)


@functools.lru_cache(maxsize=None)
def _add_relu_op() -> ops.Custom:
    """relu(a + b) element-wise in one native pass (the residual addition and its ReLU, in any layout), for training;
    the gradient of both inputs, ReLU's gradient, in one more, as bprop."""
    library = usable_library()
    gradient = _relu_gradient_op(library)

    def bprop(a, b, out, dout):
        da = gradient(dout, out)
        return da, da

    return ops.Custom(f"{library}:AddRelu", lambda a, b: a, lambda a, b: a, func_type="aot", bprop=bprop)


@constexpr
def _batchnorm_call_arguments(eps: float, momentum: float, x_layout: int, y_layout: int,
                              weight_gradient_layout: int, relu: bool) -> Tuple[ms.Tensor, ms.Tensor]:
    """The two small tensors a conv+BatchNorm call takes besides the data: (eps, momentum) as float32, the layouts
    (x's, y's, the weight gradient's, ReLU) as int64. Made in Python while the graph compiles (constexpr): built
    inside construct with ms.Tensor and int(), they took a quarter to a third of a training step's compile time
    (ResNet-18 and ResNet-50, docs/performance.md)."""
    return (ms.Tensor([eps, momentum], ms.float32),
            ms.Tensor([int(x_layout), int(y_layout), int(weight_gradient_layout), int(relu)], ms.int64))


def _symmetric_padding(cell: nn.Conv2d) -> Optional[int]:
    if cell.pad_mode == "valid":
        return 0
    if cell.pad_mode != "pad":
        return None  # 'same' pads asymmetrically at stride 2
    padding = cell.padding if isinstance(cell.padding, tuple) else (cell.padding,) * 4
    return padding[0] if len(set(padding)) == 1 else None


class BlockedConv2d(nn.Conv2d):
    """nn.Conv2d whose float32 forward and gradients run on oneDNN's blocked layouts (CPU).

    Configurations the native library has no kernel for (groups, dilation, other strides or paddings,
    other dtypes) run MindSpore's own Conv2d.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        stride = self.stride[2:] if len(self.stride) == 4 else self.stride
        dilation = self.dilation[2:] if len(self.dilation) == 4 else self.dilation
        padding = _symmetric_padding(self)
        supported = (self.group == 1 and tuple(dilation) == (1, 1) and stride[0] == stride[1]
                     and stride[0] in SUPPORTED_STRIDES and padding in SUPPORTED_PADDINGS)
        self.blocked_op = _forward_op(stride[0], padding) if supported else None
        # The fused BatchNorm runs on channel blocks.
        fusable = supported and not self.has_bias and self.out_channels % channel_block() == 0
        self.batchnorm_op = _conv_batchnorm_op(stride[0], padding) if fusable else None
        self.batchnorm_add_relu_op = _conv_batchnorm_op(stride[0], padding, residual_add_relu=True) if fusable else None
        self.batchnorm_add_relu_op_for_relu_users = (  # its bprop leaves the ReLU's gradient to y's users
            _conv_batchnorm_op(stride[0], padding, residual_add_relu=True, relu_gradient_by_users=True)
            if fusable else None)
        self.blocked_stride, self.blocked_padding = stride[0], padding  # what the native ops are told
        # Where the weight gradient may come (see gradients_in_kernel_layout): GRADIENT_PLAIN, plain OIHW;
        # GRADIENT_BLOCKS, also the convolution kernel's own layout, for a native optimizer update that reads it
        # there; GRADIENT_BLOCKS_OR_WINDOW, also only the taps that ever meet the input, for that update alone.
        self.weight_gradient_layout = GRADIENT_PLAIN

    @staticmethod
    def channel_block_cells() -> Tuple[ChannelBlocks, ChannelBlocks]:
        """Cells that reorder activations into channel blocks and back, for a training step that keeps them there
        between with_batchnorm calls (ResNet)."""
        return ChannelBlocks(True), ChannelBlocks(False)

    @staticmethod
    def relu_output_fanout_cell() -> ReluOutputFanout:
        """A cell that hands a residual block's input to its two users and applies the ReLU's gradient for them, in
        a training step on channel blocks (with_batchnorm_add_relu's relu_gradient_by_users)."""
        return ReluOutputFanout()

    @staticmethod
    def relu_output_gradient_cell() -> ReluOutputGradient:
        """The identity that applies the ReLU's gradient for the one user of the last block's output (as above)."""
        return ReluOutputGradient()

    @staticmethod
    def relu_max_pool_cell() -> ReluMaxPool:
        """A cell that runs ReLU and the imagenet stem's max pool on channel blocks (training)."""
        return ReluMaxPool()

    def defer_input_gradient(self) -> None:
        """with_batchnorm computes the gradient of x in a native call of its own, which the graph drops where
        nothing uses it: for a network's first convolution, whose input is the images."""
        if self.batchnorm_op is not None:
            self.batchnorm_op = _conv_batchnorm_op(self.blocked_stride, self.blocked_padding, True)

    def runs_batchnorm_itself(self) -> bool:
        """Whether with_batchnorm runs the convolution and a training BatchNorm in one native call (float32)."""
        return self.batchnorm_op is not None

    def with_batchnorm(self, x, bn: nn.BatchNorm2d, x_layout: int = PLAIN, y_layout: int = PLAIN,
                       relu: bool = False):
        """bn(self(x)), and with relu ReLU of that. In training on batch statistics all run in one native call, the
        convolution's output kept in oneDNN's blocked layout for its BatchNorm kernels (the ReLU fused into the
        BatchNorm's, a bit a number kept for its gradient), and bn's moving statistics are updated as
        nn.BatchNorm2d updates them: with the unbiased batch variance, bn.momentum being the new batch's weight
        (nn.BatchNorm2d keeps 1 - its momentum argument there). x and y are in channel blocks where x_layout /
        y_layout say BLOCKED (only in that call: the caller checks runs_batchnorm_itself and trains in float32); a
        bool says BLOCKED when true, so that graph code passes its flag without an int() to compile."""
        if self.batchnorm_op is None or x.dtype != ms.float32 or not bn.training or bn.use_batch_statistics is False:
            y = bn(self.construct(x))
            return ops.relu(y) if relu else y
        constants, layouts = _batchnorm_call_arguments(bn.eps, bn.momentum, x_layout, y_layout,
                                                       self.weight_gradient_layout, relu)
        # By index: unpacked with _ for the unused outputs, each left a node that MindSpore's compiler removed with a
        # "side effect nodes were eliminated by mistake" warning.
        outputs = self.batchnorm_op(x, self.weight, bn.gamma, bn.beta, bn.moving_mean, bn.moving_variance,
                                    constants, layouts)
        ops.assign(bn.moving_mean, outputs[4])
        ops.assign(bn.moving_variance, outputs[5])
        return outputs[0]

    def with_batchnorm_add_relu(self, x, bn: nn.BatchNorm2d, residual, relu_gradient_by_users: bool = False):
        """relu(bn(self(x)) + residual) with x, the residual and the result in channel blocks: a residual block's end
        in a training step. On batch statistics in one native call, as with_batchnorm (the same moving statistics):
        the BatchNorm's statistics, then its normalization with the addition and ReLU, two passes over the
        convolution's output, where oneDNN's BatchNorm wrote its output and the addition read it back. Elsewhere
        with_batchnorm, then relu(a + b) in one native pass.
        relu_gradient_by_users: every user of the result applies the ReLU's gradient (ReluOutputFanout), so that
        the native call's gradient does not apply it again (the fallback's does; it gives the same numbers)."""
        if (self.batchnorm_add_relu_op is None or x.dtype != ms.float32 or not bn.training
                or bn.use_batch_statistics is False):
            return _add_relu_op()(self.with_batchnorm(x, bn, BLOCKED, BLOCKED), residual)
        constants, layouts = _batchnorm_call_arguments(bn.eps, bn.momentum, BLOCKED, BLOCKED,
                                                       self.weight_gradient_layout, False)
        op = self.batchnorm_add_relu_op_for_relu_users if relu_gradient_by_users else self.batchnorm_add_relu_op
        outputs = op(x, self.weight, bn.gamma, bn.beta, bn.moving_mean, bn.moving_variance, constants, layouts,
                     residual)
        ops.assign(bn.moving_mean, outputs[4])
        ops.assign(bn.moving_variance, outputs[5])
        return outputs[0]

    def construct(self, x):
        if self.blocked_op is None or x.dtype != ms.float32:
            return super().construct(x)
        output = self.blocked_op(x, self.weight)
        if self.has_bias:
            output = self.bias_add(output, self.bias)
        return output
