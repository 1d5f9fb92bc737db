"""Throughput of ResNet training steps and inference forward passes, MindSpore (this project's code)
against PyTorch/torchvision, each measurement in its own process so thread pools don't interfere, the processes
taking turns (measure_side_by_side); the FLOP count of the network and the machine's fp32 matrix-product (GEMM)
rate, to put the throughput in perspective. See FLOP_CONVENTION for what is counted.
"""
import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from src.process_memory import peak_memory_bytes, reset_peak_memory, return_freed_heap

REPO = Path(__file__).resolve().parents[1]
GEMM_BACKENDS = ("mindspore", "numpy", "torch")  # ops.matmul (oneDNN), numpy.matmul (OpenBLAS), torch.mm (MKL)
TRAIN_FLOPS_FACTOR = 3  # forward + backward-data + backward-weights, each about the forward's multiply-adds
FLOP_CONVENTION = ("2 flops per multiply-add of the network's convolutions and fully connected layer (BatchNorm, "
                   "ReLU, pooling, residual adds and the optimizer not counted); a training step counts 3 x the "
                   "forward pass (forward, backward-data, backward-weights)")


@dataclass
class Measurement:
    framework: str
    mode: str  # train or eval
    image_size: int
    batch_size: int
    threads: int
    seconds_per_step: List[float]
    flops_per_image: Optional[int] = None  # filled in by the parent process (see flops_per_image)
    conv_implementation: str = ""  # MindSpore's: the convolutions it ran (src/onednn_conv.py)
    onednn_max_cpu_isa: str = ""  # MindSpore's: the oneDNN instruction-set setting it ran under
    inference_network: str = ""  # MindSpore's, eval: the cell that ran (fused-blocked, fused-nhwc or resnet)
    recipe: str = ""  # MindSpore's, train: the amp_level, and "-sink" when the loss is read once per timing
    peak_rss_bytes: Optional[int] = None  # the worker's peak resident memory during the timed steps (Linux)
    optimizer: str = ""  # train: the training step's optimizer (a key of OPTIMIZERS)
    round_images_per_second: List[float] = field(default_factory=list)  # each round's median, with --rounds
    timing_start_times: List[float] = field(default_factory=list)  # each timing's start, Unix seconds
    ended_at: float = 0.0  # Unix seconds when the worker went on to finish (taking turns: when all were done)
    # While the workers beside it took their turns (measure_side_by_side): the seconds that took, and the CPU seconds
    # this worker's process used meanwhile (Linux; None elsewhere): near 0 when a waiting worker leaves the machine
    # to the one being timed
    idle_seconds: float = 0.0
    idle_cpu_seconds: Optional[float] = 0.0

    @property
    def images_per_second(self) -> float:
        return self.batch_size / statistics.median(self.seconds_per_step)

    @property
    def gflops_per_second(self) -> Optional[float]:
        return None if self.flops_per_image is None else self.flops_per_image * self.images_per_second / 1e9


@dataclass
class GemmMeasurement:
    """Timings of n x n fp32 matrix products with one backend (one product per timing)."""
    backend: str
    n: int
    threads: int
    onednn_max_cpu_isa: Optional[str]  # as the worker saw it: MindSpore's oneDNN honours it, OpenBLAS/MKL don't
    seconds: List[float]
    phase: str = ""  # "before" or "after" the model measurements

    @property
    def gflops_per_second(self) -> float:
        return 2 * self.n ** 3 / statistics.median(self.seconds) / 1e9


def warmup_steps(asked: Optional[int], steps: int) -> int:
    """The untimed steps before the timings of `steps` steps each: `asked`, or by default four timings' worth and at
    least 2. Why four: MindSpore's first 15 or so training steps at 32x32 run 5-7 % slower than the ones after
    (PyTorch's do not), and a training run is the steps after; docs/performance.md has the measurement."""
    return asked if asked is not None else max(2, 4 * steps)


def _time_steps(run_step: Callable[[], None], warmup: int, repeats: int, steps: int,
                finish: Optional[Callable[[], None]] = None,
                when_warm: Optional[Callable[[], object]] = None,
                turns: Optional[Tuple[Callable[[], None], Callable[[], None]]] = None
                ) -> Tuple[List[float], List[float]]:
    """Seconds per step of each repeat (steps steps each, then finish: waiting for the last one's result), after
    warmup steps (which include compilation), after which when_warm is called; and each repeat's start (Unix
    seconds). With turns, (wait_turn, turn_over), the warm-up's last `steps` steps and each repeat wait for their
    turn and hand it back after, and the return waits for a last turn: the worker's side of measure_side_by_side."""
    def run_block(count: int) -> None:
        for _ in range(count):
            run_step()
        if finish and count:
            finish()
    wait_turn, turn_over = turns or (lambda: None, lambda: None)
    alone = warmup if turns is None else max(warmup - steps, 0)
    run_block(alone)
    turn_over()
    wait_turn()
    run_block(warmup - alone)  # taking turns: caches and thread pools warm again after the others' warm-ups
    if when_warm:
        when_warm()
    turn_over()
    timings, started_at = [], []
    for _ in range(repeats):
        wait_turn()
        started_at.append(time.time())
        started = time.perf_counter()
        run_block(steps)
        timings.append((time.perf_counter() - started) / steps)
        turn_over()
    wait_turn()  # told when every worker is done: a process's exit would slow the others' timings
    return timings, started_at


RECIPE_PATTERN = re.compile(r"^O[0-3](-sink)?(-plain)?(-nn_optimizer|-oihw_gradients)?$")

# The training step's optimizer, the same in both frameworks: the reference's Adam (train.py's default), or the
# Nesterov momentum SGD of the configs/ recipes. MindSpore's config arguments, then torch.optim's.
OPTIMIZERS = {
    "adam": ([], ("Adam", {"lr": 1e-3, "weight_decay": 1e-5})),
    "nesterov": (["--optimizer", "momentum", "--nesterov", "--momentum", "0.9", "--lr", "0.05", "--weight_decay",
                  "0.0005"], ("SGD", {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 5e-4})),
}


def check_recipe(recipe: str) -> str:
    """A training recipe name: an amp_level O0-O3, with -sink for the loss read once per sink (here: per timing) and
    -plain for activations reordered to the plain layout around every native convolution (build_resnet's
    blocked_activations=False), -nn_optimizer for MindSpore's own optimizer (nn.Adam, nn.SGD) where the native
    library would run the one-pass update (src/native_optimizer.py), or -oihw_gradients for that update with every
    weight gradient reordered to plain OIHW first (no gradients_in_kernel_layout)."""
    if not RECIPE_PATTERN.match(recipe):
        raise ValueError(f"unknown recipe {recipe!r}: an amp_level O0-O3, optionally followed by -sink, then -plain, "
                         f"then -nn_optimizer or -oihw_gradients")
    return recipe


def _worker_env(threads: int) -> Dict[str, str]:
    # OpenBLAS (numpy) reads OPENBLAS_NUM_THREADS before OMP_NUM_THREADS: set both so every backend gets `threads`.
    return dict(os.environ, OMP_NUM_THREADS=str(threads), OPENBLAS_NUM_THREADS=str(threads))


def _worker_command(args: List[str], threads: int) -> List[str]:
    return [sys.executable, str(REPO / "benchmark.py"), *args, "--threads", str(threads)]


def _worker_failed(what: str, stderr: str) -> RuntimeError:
    return RuntimeError(f"{what}: worker failed:\n{stderr[-3000:]}")


def _run_worker(args: List[str], threads: int, what: str):
    """Runs benchmark.py as a worker process and returns the JSON it prints last."""
    process = subprocess.run(_worker_command(args, threads), cwd=REPO, env=_worker_env(threads), capture_output=True,
                             text=True)
    if process.returncode != 0:
        raise _worker_failed(what, process.stderr)
    return json.loads(process.stdout.strip().splitlines()[-1])


def mindspore_step(mode: str, model_name: str, image_size: int, batch_size: int, total_steps: int,
                   conv_implementation: str = "mindspore", inference_network: str = "fused",
                   recipe: str = "O0", optimizer: str = "adam"
                   ) -> Tuple[Callable[[], None], str, Optional[Callable[[], None]]]:
    """One training step (with the optimizer named in OPTIMIZERS, as train.py builds it for the recipe's amp_level,
    with the fixed loss scale above O0) or one inference forward: of the network evaluation runs (inference_network
    "fused"; "fused-blocked" or "fused-nhwc" force its activation layout) or of the ResNet cell itself ("resnet").
    Returns the step, for inference which network ran ("fused-" and the layout it ran on, when the network could be
    fused; "" for training), and what waits for the steps' results when the step itself does not (a -sink recipe:
    train.py reads the loss after every step without dataset_sink_mode, once per sink with it)."""
    import mindspore as ms
    from src.lr_schedule import schedule_from_config
    from src.model_utils.config import load_config
    from src.resnet import build_resnet
    from src.train_step import AmpSetting, build_train_step, update_alone_reads_gradients
    from src.trainer import build_optimizer, native_update_allowed
    from src.utils import set_execution_mode

    ms.set_seed(1)
    set_execution_mode(True, "CPU", training=mode == "train")  # as train.py's and eval.py's processes run
    config = load_config(OPTIMIZERS[optimizer][0], prog="benchmark.py")
    net = build_resnet(model_name, config.class_num, conv_implementation=conv_implementation,
                       blocked_activations="-plain" not in recipe)
    rng = np.random.default_rng(0)
    images = ms.Tensor(rng.standard_normal((batch_size, 3, image_size, image_size), np.float32))
    labels = ms.Tensor(rng.integers(0, config.class_num, batch_size).astype(np.int32))
    if mode == "eval":
        from src.fused_inference import FusedResNet, inference_network as evaluation_network
        net.set_train(False)
        inference_net = net
        if inference_network.startswith("fused"):
            layout = inference_network.partition("-")[2] or "auto"
            inference_net = evaluation_network(net, layout=layout)
        ran = "resnet"
        if isinstance(inference_net, FusedResNet):
            ran = "fused-blocked" if inference_net.runs_blocked else "fused-nhwc"
        return lambda: inference_net(images).asnumpy(), ran, None
    learning_rates = schedule_from_config(config.replace(epoch_size=1, warmup_epochs=0), total_steps)
    native = native_update_allowed(config, conv_implementation) and "-nn_optimizer" not in recipe
    level = check_recipe(recipe).split("-")[0]
    amp = AmpSetting(level, None if level == "O0" else config.loss_scale)
    update = build_optimizer(config, net.trainable_params(), learning_rates, native=native,
                             gradients_from=None if "-oihw_gradients" in recipe else net,
                             gradient_windows=update_alone_reads_gradients(config, amp))
    sink = "-sink" in recipe
    train_step = build_train_step(net, update, config, amp, sink=sink)
    if sink:
        return lambda: train_step(images, labels), "", train_step.read_totals
    return lambda: train_step(images, labels), "", None  # it reads the step's outputs itself, as in train.py


def torch_step(mode: str, model_name: str, image_size: int, batch_size: int,
               optimizer: str = "adam") -> Callable[[], None]:
    """The same step in PyTorch with torchvision's model: the optimizer named in OPTIMIZERS (Adam: lr 1e-3,
    weight_decay 1e-5), cross-entropy."""
    import torch
    import torchvision

    torch.manual_seed(1)
    net = getattr(torchvision.models, model_name)(num_classes=10)
    images = torch.randn(batch_size, 3, image_size, image_size)
    labels = torch.randint(0, 10, (batch_size,))
    if mode == "eval":
        net.eval()

        def forward() -> None:
            with torch.no_grad():
                net(images)
        return forward
    net.train()
    torch_class, options = OPTIMIZERS[optimizer][1]
    update = getattr(torch.optim, torch_class)(net.parameters(), **options)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step() -> None:
        update.zero_grad()
        loss_fn(net(images), labels).backward()
        update.step()
    return step


def export_onnx_here(model_name: str, image_size: int, batch_size: int, path: str) -> str:
    """Writes this project's ONNX export (export.py's export_network) of a seeded network to path."""
    import mindspore as ms
    from src.exporting import export_network
    from src.model_utils.config import load_config
    from src.resnet import build_resnet

    ms.set_seed(1)
    ms.set_context(mode=ms.GRAPH_MODE)
    net = build_resnet(model_name, load_config([], prog="benchmark.py").class_num)
    export_network(net, Path(path), "ONNX", batch_size, (image_size, image_size))
    return path


def export_onnx_in_subprocess(model_name: str, image_size: int, batch_size: int, path: str, threads: int) -> str:
    args = ["--worker", "onnx-export", "--model_name", model_name, "--sizes", str(image_size),
            "--batch_size", str(batch_size), "--onnx_path", path]
    return _run_worker(args, threads, f"ONNX export {image_size}x{image_size}")


def onnxruntime_step(onnx_path: str, image_size: int, batch_size: int, threads: int) -> Callable[[], None]:
    """One forward pass of the exported ONNX file in onnxruntime's CPU provider with `threads` intra-op threads
    (its default graph optimisations, one inter-op thread: the model is one chain)."""
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    session = onnxruntime.InferenceSession(onnx_path, options, providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    images = np.random.default_rng(0).standard_normal((batch_size, 3, image_size, image_size)).astype(np.float32)
    return lambda: session.run(None, {name: images})


def measure_here(framework: str, mode: str, model_name: str, image_size: int, batch_size: int, threads: int,
                 warmup: int, repeats: int, steps: int, conv_implementation: str = "auto",
                 inference_network: str = "fused", recipe: str = "O0", onnx_path: str = "",
                 optimizer: str = "adam",
                 turns: Optional[Tuple[Callable[[], None], Callable[[], None]]] = None) -> Measurement:
    """Runs one measurement in this process (training with the optimizer named in OPTIMIZERS); MindSpore's
    convolutions as conv_implementation resolves on CPU for the recipe's amp_level (training); onnxruntime
    (inference only) runs the file at onnx_path. turns: see _time_steps."""
    implementation = isa = ran_network = ""
    finish = None
    if framework == "torch":
        import torch
        torch.set_num_threads(threads)
        run_step = torch_step(mode, model_name, image_size, batch_size, optimizer)
    elif framework == "onnxruntime":
        if mode != "eval" or not onnx_path:
            raise ValueError("onnxruntime measures inference only, of an exported file (onnx_path)")
        run_step = onnxruntime_step(onnx_path, image_size, batch_size, threads)
    else:
        from src.utils import choose_convolutions  # as train.py's init_env does
        level = check_recipe(recipe).split("-")[0] if mode == "train" else "O0"
        implementation, isa = choose_convolutions(conv_implementation, "CPU", amp_level=level)
        run_step, ran_network, finish = mindspore_step(mode, model_name, image_size, batch_size,
                                                       warmup + repeats * steps, implementation, inference_network,
                                                       recipe, optimizer)
    # The peak resident memory of the timed steps alone, the same way for every framework: the model, its
    # optimizer state and what a step allocates, not the compilation's or the imports' transient peaks. The heap
    # the warm-up freed is handed back first, as train.py does once its step has compiled.
    reset = []

    def when_warm() -> None:
        return_freed_heap()
        reset.append(reset_peak_memory())
    timings, started_at = _time_steps(run_step, warmup, repeats, steps, finish, when_warm, turns)
    ended_at = time.time()
    peak = peak_memory_bytes() if reset and reset[0] else None
    return Measurement(framework, mode, image_size, batch_size, threads, timings, timing_start_times=started_at,
                       ended_at=ended_at, conv_implementation=implementation,
                       onednn_max_cpu_isa=isa, inference_network=ran_network,
                       recipe=recipe if framework == "mindspore" and mode == "train" else "", peak_rss_bytes=peak,
                       optimizer=optimizer if mode == "train" else "")


@dataclass
class WorkerRun:
    """One measurement for a worker process (benchmark.py --worker): measure_here's arguments."""
    framework: str
    mode: str
    model_name: str
    image_size: int
    batch_size: int
    warmup: int
    repeats: int
    steps: int
    conv_implementation: str = "auto"
    inference_network: str = "fused"
    recipe: str = "O0"
    onnx_path: str = ""
    optimizer: str = "adam"

    def describe(self) -> str:
        recipe = self.recipe if self.framework == "mindspore" and self.mode == "train" else ""
        return f"{self.framework} {recipe}".strip()

    def arguments(self) -> List[str]:
        return ["--worker", self.framework, "--modes", self.mode, "--model_name", self.model_name,
                "--sizes", str(self.image_size), "--batch_size", str(self.batch_size), "--warmup", str(self.warmup),
                "--repeats", str(self.repeats), "--steps", str(self.steps),
                "--conv_implementation", self.conv_implementation, "--inference_network", self.inference_network,
                "--recipes", self.recipe, "--onnx_path", self.onnx_path, "--optimizer", self.optimizer]


# A worker taking turns (--side_by_side) prints this line whenever it is idle, then waits for "go" on stdin.
TURN_OVER = "@benchmark-worker: turn over"


def worker_turns() -> Tuple[Callable[[], None], Callable[[], None]]:
    """The worker's side of measure_side_by_side: (wait_turn, turn_over) for measure_here."""
    def wait_turn() -> None:
        if sys.stdin.readline().strip() != "go":  # the parent stopped
            raise SystemExit("benchmark worker: the parent process stopped giving turns")

    def turn_over() -> None:
        print(TURN_OVER, flush=True)
    return wait_turn, turn_over


def _process_cpu_seconds(pid: int) -> Optional[float]:
    """CPU seconds the process's threads have run so far, from the scheduler's per-thread counts in /proc (in
    nanoseconds, where /proc/PID/stat counts 10 ms ticks); None where there are none (not Linux, or it is gone)."""
    total, found = 0, False
    for path in Path(f"/proc/{pid}/task").glob("*/schedstat"):
        try:
            total += int(path.read_text().split()[0])
            found = True
        except (OSError, IndexError, ValueError):  # a thread that ended meanwhile
            continue
    return total / 1e9 if found else None


SETTLE_INTERVAL = 0.01  # seconds between looks at a worker that just had its turn
SETTLE_SHARE = 0.1  # ... until its threads use less than this share of one core
SETTLE_LIMIT = 2.0  # seconds at most


def _settle(pid: int) -> None:
    """Waits until a worker's threads go quiet after its turn. Thread pools spin a while after their last task
    (onnxruntime's about 40 ms on 1.3 cores after a pass at 224x224 on a Zen 4), which would slow the next worker's
    first steps."""
    deadline = time.perf_counter() + SETTLE_LIMIT
    before = _process_cpu_seconds(pid)
    while before is not None and time.perf_counter() < deadline:
        time.sleep(SETTLE_INTERVAL)
        after = _process_cpu_seconds(pid)
        if after is None or after - before < SETTLE_SHARE * SETTLE_INTERVAL:
            return
        before = after


class _TurnTakingWorker:
    """A worker process of measure_side_by_side, its stderr in a file (a full pipe would block it)."""

    def __init__(self, run: WorkerRun, threads: int, stderr) -> None:
        command = _worker_command([*run.arguments(), "--side_by_side"], threads)
        self.what = f"{run.describe()} {run.mode} {run.image_size}"
        self.stderr = stderr
        self.lines: List[str] = []  # its stdout, but for the turn-over lines
        self.idle_seconds = 0.0
        self.idle_cpu_seconds: Optional[float] = 0.0
        self.process = subprocess.Popen(command, cwd=REPO, env=_worker_env(threads), stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=stderr, text=True)

    def failure(self) -> RuntimeError:
        self.process.wait()
        self.stderr.seek(0)
        return _worker_failed(self.what, self.stderr.read())

    def wait_until_idle(self) -> None:
        for line in self.process.stdout:
            if line.rstrip("\n") == TURN_OVER:
                return
            self.lines.append(line)
        raise self.failure()

    def _go(self, last: bool = False) -> None:
        try:
            self.process.stdin.write("go\n")
            if last:
                self.process.stdin.close()
            else:
                self.process.stdin.flush()
        except BrokenPipeError:
            raise self.failure() from None

    def take_turn(self) -> None:
        self._go()
        self.wait_until_idle()

    def result(self) -> Measurement:
        """Lets the worker finish (once every worker's timings are done) and reads its measurement."""
        self._go(last=True)
        self.lines.extend(self.process.stdout)
        if self.process.wait() != 0 or not self.lines:
            raise self.failure()
        return Measurement(**dict(json.loads(self.lines[-1]), idle_seconds=self.idle_seconds,
                                  idle_cpu_seconds=self.idle_cpu_seconds))


TRAIN_PY_STEP_LINE = re.compile(r"epoch 2/2 step \d+/\d+ loss \S+ lr \S+ [0-9.]+ images/s")


@dataclass
class TrainPyRun:
    """A real train.py run beside the workers of measure_side_by_side (benchmark.py --train_py): the default recipe
    with the optimizer named in OPTIMIZERS, on generated CIFAR-format data in work_folder, at image_size and
    batch_size, logging every step. Two epochs of 1 + (1 + repeats) * steps steps: the first compiles; of the
    second, the first step runs alone and then each turn runs `steps` steps, the first turn untimed, as a worker's
    warm-up's last block is."""
    model_name: str
    image_size: int
    batch_size: int
    steps: int
    repeats: int
    work_folder: str
    optimizer: str = "adam"

    def command(self) -> List[str]:
        steps_per_epoch = 1 + (1 + self.repeats) * self.steps
        return [sys.executable, str(REPO / "train.py"), "--model_name", self.model_name,
                "--data_path", str(Path(self.work_folder) / "data"), "--synthetic_data", "true", "--download", "false",
                "--image_height", str(self.image_size), "--image_width", str(self.image_size),
                "--batch_size", str(self.batch_size), "--epoch_size", "2",
                "--train_num_samples", str(self.batch_size * steps_per_epoch), "--eval_interval", "2",
                "--eval_num_samples", str(self.batch_size), "--log_interval", "1", "--keep_checkpoint_max", "1",
                "--output_path", str(Path(self.work_folder) / f"train-{self.image_size}"),
                *OPTIMIZERS[self.optimizer][0]]


class _StoppedTrainPy:
    """train.py taking turns in measure_side_by_side: stopped (SIGSTOP) whenever it is not its turn, so that its steps
    share the machine's phases with the workers' timings. A step's time is the time between its log line and the one
    before (read here as they come), less the time the process was stopped in between: a stop falls inside the step
    after the line that ended a turn."""

    def __init__(self, run: TrainPyRun, threads: int) -> None:
        self.run, self.threads = run, threads
        self.what = f"train.py {run.image_size}x{run.image_size}"
        self.output: List[str] = []  # all it printed
        self.turns: List[List[float]] = []  # each turn's step seconds
        self.turn_starts: List[float] = []  # each turn's resumption, Unix seconds
        self.idle_seconds = 0.0
        self.idle_cpu_seconds: Optional[float] = 0.0
        self._last_line_at: Optional[float] = None
        self._stopped_at: Optional[float] = None
        self._stopped_for = 0.0
        self.process = subprocess.Popen(run.command(), cwd=REPO, env=_worker_env(threads), stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True)

    def failure(self) -> RuntimeError:
        self._resume()
        self.output.extend(self.process.stdout)
        self.process.wait()
        return RuntimeError(f"{self.what}: failed:\n{''.join(self.output)[-3000:]}")

    def _read_steps(self, count: int) -> List[float]:
        """Reads its output up to `count` more step lines of the second epoch; each step's seconds."""
        seconds: List[float] = []
        for line in self.process.stdout:
            self.output.append(line)
            if not TRAIN_PY_STEP_LINE.search(line):
                continue
            now = time.perf_counter()
            if self._last_line_at is not None:
                seconds.append(now - self._last_line_at - self._stopped_for)
            self._last_line_at, self._stopped_for = now, 0.0
            if len(seconds) == count:  # 0: the first step line
                return seconds
        raise self.failure()

    def _pause(self) -> None:
        self.process.send_signal(signal.SIGSTOP)
        self._stopped_at = time.perf_counter()

    def _resume(self) -> None:
        if self._stopped_at is not None:
            self.process.send_signal(signal.SIGCONT)
            self._stopped_for += time.perf_counter() - self._stopped_at
            self._stopped_at = None

    def wait_until_idle(self) -> None:
        """Its first epoch and its second epoch's first step, alone (the pipeline's start is in that step)."""
        self._read_steps(0)
        self._pause()

    def take_turn(self) -> None:
        self.turn_starts.append(time.time())
        self._resume()
        self.turns.append(self._read_steps(self.run.steps))
        self._pause()

    def result(self) -> Measurement:
        """Lets train.py finish its run (its evaluation and checkpoints) and returns its timed turns' steps."""
        self._resume()
        self.output.extend(self.process.stdout)
        if self.process.wait() != 0:
            raise self.failure()
        timed = self.turns[1:]  # the first turn is the warm-up's last block, as the workers'
        return Measurement("train.py", "train", self.run.image_size, self.run.batch_size, self.threads,
                           [seconds for turn in timed for seconds in turn], optimizer=self.run.optimizer,
                           timing_start_times=self.turn_starts[1:], idle_seconds=self.idle_seconds,
                           idle_cpu_seconds=self.idle_cpu_seconds)


def _stop(process: subprocess.Popen) -> None:
    """Kills a worker still running or stopped (the measurement failed elsewhere) and reaps it."""
    if process.poll() is None:
        process.kill()
    process.wait()


def measure_side_by_side(runs: Sequence[WorkerRun], threads: int,
                         train_py: Optional[TrainPyRun] = None) -> List[Measurement]:
    """Measures runs in worker processes that take turns: each warms up (compilation included) while the others
    wait, then they run one at a time, in the order of runs, the warm-up's last block of steps, then each timing,
    each turn once the last one's threads have gone quiet; none ends (its exit takes CPU) before the last timing.
    The workers' timings interleave, so a slow phase of a shared machine lasting seconds to minutes hits them
    alike instead of deciding a ratio. A waiting worker blocks on its stdin;
    the CPU time it used meanwhile is recorded (Measurement.idle_seconds, idle_cpu_seconds).
    With train_py, a real train.py run takes turns last, stopped between its turns (_StoppedTrainPy), and its
    measurement comes last."""
    repeats = {run.repeats for run in runs} | ({train_py.repeats} if train_py else set())
    if len(repeats) > 1:
        raise ValueError("workers taking turns need the same number of repeats")
    with contextlib.ExitStack() as stack:
        workers: List[Union[_TurnTakingWorker, _StoppedTrainPy]] = []
        for run in runs:
            stderr = stack.enter_context(tempfile.TemporaryFile("w+"))
            worker = _TurnTakingWorker(run, threads, stderr)
            stack.callback(_stop, worker.process)
            workers.append(worker)
            worker.wait_until_idle()  # warmed up alone
        if train_py is not None:
            worker = _StoppedTrainPy(train_py, threads)
            stack.callback(_stop, worker.process)
            workers.append(worker)
            worker.wait_until_idle()
        for _ in range(1 + repeats.pop()):  # the warm-up's last block, then the timings
            for worker in workers:
                others = [(other, _process_cpu_seconds(other.process.pid)) for other in workers if other is not worker]
                started = time.perf_counter()
                worker.take_turn()
                took = time.perf_counter() - started
                for other, before in others:
                    after = _process_cpu_seconds(other.process.pid)
                    other.idle_seconds += took
                    if before is None or after is None or other.idle_cpu_seconds is None:
                        other.idle_cpu_seconds = None
                    else:
                        other.idle_cpu_seconds += after - before
                _settle(worker.process.pid)
        return [worker.result() for worker in workers]


def measure_in_subprocess(framework: str, mode: str, model_name: str, image_size: int, batch_size: int, threads: int,
                          warmup: int, repeats: int, steps: int, conv_implementation: str = "auto",
                          inference_network: str = "fused", recipe: str = "O0", onnx_path: str = "",
                          optimizer: str = "adam") -> Measurement:
    """One measurement in a worker process of its own (measure_side_by_side with nothing beside it)."""
    run = WorkerRun(framework, mode, model_name, image_size, batch_size, warmup, repeats, steps, conv_implementation,
                    inference_network, recipe, onnx_path, optimizer)
    return measure_side_by_side([run], threads)[0]


def measure_gemm_here(backend: str, n: int, threads: int, warmup: int, repeats: int,
                      conv_implementation: str = "auto") -> GemmMeasurement:
    """Times `repeats` products of two random n x n float32 matrices after max(warmup, 1) untimed ones (the first
    pays for allocation and thread start-up). The MindSpore backend gets the model workers' oneDNN setting."""
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((n, n), np.float32) for _ in range(2))
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA")
    if backend == "mindspore":
        import mindspore as ms
        from mindspore import ops
        from src.utils import choose_convolutions

        _, isa = choose_convolutions(conv_implementation, "CPU")
        a, b = ms.Tensor(a), ms.Tensor(b)
        product = lambda: ops.matmul(a, b).asnumpy()  # noqa: E731 (asnumpy waits for PyNative's async launch)
    elif backend == "torch":
        import torch

        torch.set_num_threads(threads)
        a, b = torch.from_numpy(a), torch.from_numpy(b)
        product = lambda: torch.mm(a, b)  # noqa: E731
    elif backend == "numpy":
        product = lambda: np.matmul(a, b)  # noqa: E731
    else:
        raise ValueError(f"unknown GEMM backend {backend!r}; choose one of {', '.join(GEMM_BACKENDS)}")
    timings, _ = _time_steps(product, max(warmup, 1), repeats, 1)
    return GemmMeasurement(backend, n, threads, isa, timings)


def measure_gemm_in_subprocess(backend: str, n: int, threads: int, warmup: int, repeats: int,
                               phase: str, conv_implementation: str = "auto") -> GemmMeasurement:
    args = ["--worker", f"gemm-{backend}", "--gemm_size", str(n), "--warmup", str(warmup), "--repeats", str(repeats),
            "--conv_implementation", conv_implementation]
    return GemmMeasurement(**dict(_run_worker(args, threads, f"GEMM {backend}"), phase=phase))


def gemm_rates(gemms: Sequence[GemmMeasurement]) -> Dict[str, float]:
    """GFLOP/s of each backend: 2 n^3 over the median of all its timings, whichever phase they come from."""
    timings: Dict[str, List[float]] = {}
    for gemm in gemms:
        timings.setdefault(gemm.backend, []).extend(gemm.seconds)
    return {backend: 2 * gemms[0].n ** 3 / statistics.median(seconds) / 1e9 for backend, seconds in timings.items()}


def forward_macs(model_name: str, image_size: int, num_classes: int) -> int:
    """Multiply-adds of one image's forward pass through build_resnet(model_name, num_classes) at
    image_size x image_size: every nn.Conv2d (output elements x in_channels/group x kernel area) and nn.Dense
    (in x out), with the shapes read by forward hooks during a PyNative forward pass at batch 1.

    Caps oneDNN's ISA (apply_cpu_speed_setting) in this process: without it the pass takes seconds at 224.
    """
    import mindspore as ms
    from mindspore import nn
    from src.resnet import build_resnet
    from src.utils import apply_cpu_speed_setting

    apply_cpu_speed_setting()
    counts: List[int] = []

    def count(cell: nn.Cell, inputs, output) -> None:
        if isinstance(cell, nn.Conv2d):
            kernel_h, kernel_w = cell.kernel_size
            counts.append(int(np.prod(output.shape)) * (cell.in_channels // cell.group) * kernel_h * kernel_w)
        else:
            counts.append(int(np.prod(output.shape)) * cell.in_channels)

    previous_mode = ms.get_context("mode")
    ms.set_context(mode=ms.PYNATIVE_MODE)  # Cell forward hooks are a PyNative (dynamic graph) feature
    try:
        net = build_resnet(model_name, num_classes)
        net.set_train(False)
        for _, cell in net.cells_and_names():
            if isinstance(cell, (nn.Conv2d, nn.Dense)):
                cell.register_forward_hook(count)
        net(ms.Tensor(np.zeros((1, 3, image_size, image_size), np.float32)))
    finally:
        ms.set_context(mode=previous_mode)
    return sum(counts)


def forward_macs_in_subprocess(model_name: str, sizes: Sequence[int], threads: int) -> Dict[int, int]:
    """forward_macs at each size with this project's class count (config class_num), in a worker process:
    this process stays free of MindSpore and of the oneDNN setting, which the PyTorch workers must not inherit."""
    args = ["--worker", "macs", "--model_name", model_name, "--sizes", ",".join(map(str, sizes))]
    return {int(size): macs for size, macs in _run_worker(args, threads, "FLOP count").items()}


def flops_per_image(macs: int, mode: str) -> int:
    """2 flops per multiply-add; a training step is 3 forward passes' worth (forward, backward-data, -weights)."""
    return 2 * macs * (TRAIN_FLOPS_FACTOR if mode == "train" else 1)


def _percent_of(rate: Optional[float], reference: Optional[float]) -> Optional[float]:
    return None if rate is None or not reference else 100 * rate / reference


def table(measurements: Sequence[Measurement], gemms: Sequence[GemmMeasurement] = (),
          model_name: str = "resnet50") -> str:
    """Markdown table: images/s of each framework, the MindSpore/PyTorch ratio and MindSpore's FLOP rate, absolute
    and as a percentage of the fastest GEMM; a footer states the FLOP convention and the GEMM rates."""
    def rate(found: Dict[str, Measurement], framework: str) -> str:
        return f"{found[framework].images_per_second:.1f}" if framework in found else "-"

    def number(value: Optional[float], digits: int) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    rates = gemm_rates(gemms) if gemms else {}
    reference = max(rates.values(), default=None)
    def ratio(found: Dict[str, Measurement], framework: str) -> str:
        if "mindspore" in found and framework in found:
            return f"{found['mindspore'].images_per_second / found[framework].images_per_second:.2f}x"
        return "-"

    header = ("| mode | input | batch | threads | MindSpore img/s | PyTorch img/s | MindSpore / PyTorch "
              "| GFLOP/image | MindSpore GFLOP/s | MindSpore % of GEMM | onnxruntime img/s | MindSpore / onnxruntime |")
    rows = [header, "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    recipes = list(dict.fromkeys(m.recipe for m in measurements if m.recipe))
    main = [m for m in measurements if m.recipe in ("", *recipes[:1])]  # the first recipe's training, vs PyTorch
    keys = sorted({(m.mode, m.image_size, m.batch_size) for m in main}, key=lambda k: (k[0] != "train", k[1], k[2]))
    for mode, size, batch in keys:
        found = {m.framework: m for m in main if (m.mode, m.image_size, m.batch_size) == (mode, size, batch)}
        first = next(iter(found.values()))
        ours = found["mindspore"].gflops_per_second if "mindspore" in found else None
        per_image = None if first.flops_per_image is None else first.flops_per_image / 1e9
        rows.append(f"| {mode} | {size}x{size} | {first.batch_size} | {first.threads} | {rate(found, 'mindspore')} | "
                    f"{rate(found, 'torch')} | {ratio(found, 'torch')} | {number(per_image, 3)} | {number(ours, 1)} | "
                    f"{number(_percent_of(ours, reference), 1)} | {rate(found, 'onnxruntime')} | "
                    f"{ratio(found, 'onnxruntime')} |")
    rows += ["", f"GFLOP/image of {model_name}: {FLOP_CONVENTION}."]
    if any(m.idle_seconds > 0 for m in measurements):
        rows += ["", idle_line(measurements)]
    if (any(len(m.round_images_per_second) > 1 for m in main)
            and any(m.framework in ("torch", "onnxruntime") for m in main)):
        rows += ["", round_table(main, keys)]
    if any(m.peak_rss_bytes for m in main):
        rows += ["", memory_table(main, keys)]
    if len(recipes) > 1:
        rows += ["", recipe_table(measurements, recipes)]
    if any(m.framework == "train.py" for m in measurements):
        rows += ["", train_py_table(measurements)]
    if gemms and any(m.framework in ("torch", "onnxruntime") for m in main):
        rows += ["", ceiling_table(main, keys, peak_rate(gemms, measurements))]
    if gemms:
        phases = list(dict.fromkeys(g.phase for g in gemms))
        timings = sum(len(g.seconds) for g in gemms if g.backend == gemms[0].backend)
        isa = ", ".join(sorted({str(g.onednn_max_cpu_isa) for g in gemms if g.backend == "mindspore"}))

        def describe(backend: str) -> str:  # pooled rate, then each phase's: a large spread means the machine drifted
            notes = [f"{g.phase} {g.gflops_per_second:.1f}" for g in gemms if g.backend == backend]
            notes += [f"ONEDNN_MAX_CPU_ISA={isa}"] if backend == "mindspore" else []
            return f"{backend} {rates[backend]:.1f} ({', '.join(notes)})"
        described = ", ".join(map(describe, rates))
        if rows[-1].rpartition("\n")[2].startswith("|"):  # a line right under a table would read as its last row
            rows.append("")
        rows.append(f"GEMM: fp32 {gemms[0].n}x{gemms[0].n} matrix products, {gemms[0].threads} threads, median of "
                    f"{timings} per backend ({' and '.join(phases)} the models): {described} GFLOP/s; "
                    f"% of GEMM is against the fastest, {reference:.1f} GFLOP/s.")
    return "\n".join(rows)


def idle_line(measurements: Sequence[Measurement]) -> str:
    """What the workers that took turns did while waiting: the most CPU any of them used, as a share of one core
    over the time it waited. A large share would mean a waiting worker slowed the one being timed."""
    waited = [m for m in measurements if m.idle_seconds > 0]
    line = "Each input size's workers took turns, one timed at a time"
    if any(m.idle_cpu_seconds is None for m in waited):
        return line + " (their CPU use while waiting is read from /proc, not available here)."
    worst = max(waited, key=lambda m: m.idle_cpu_seconds / m.idle_seconds)
    name = " ".join(part for part in (worst.framework, worst.recipe, worst.mode) if part)
    return (line + f"; while waiting, a worker used at most {100 * worst.idle_cpu_seconds / worst.idle_seconds:.1f} "
            f"% of a core ({name} {worst.image_size}x{worst.image_size}).")


def round_ratios(ours: Sequence[float], theirs: Sequence[float]) -> List[float]:
    """Each round's rate over the other's in the same round; none unless both have every round."""
    return [a / b for a, b in zip(ours, theirs)] if len(ours) == len(theirs) else []


def round_table(measurements: Sequence[Measurement], keys: Sequence[Tuple[str, int, int]]) -> str:
    """Markdown table of MindSpore's ratio to PyTorch and to onnxruntime in each round (each round's median against
    the other framework's in the same round), and the lowest: what a target for every round is checked against."""
    others = [name for name in ("torch", "onnxruntime") if any(m.framework == name for m in measurements)]
    titles = {"torch": "PyTorch", "onnxruntime": "onnxruntime"}
    header = "| mode | input | batch | " + " | ".join(
        f"MindSpore / {titles[name]} by round | lowest" for name in others) + " |"
    rows = [header, "|" + "---|" * (header.count("|") - 1)]
    for mode, size, batch in keys:
        found = {m.framework: m.round_images_per_second for m in measurements
                 if (m.mode, m.image_size, m.batch_size) == (mode, size, batch)}
        cells = []
        for name in others:
            ratios = round_ratios(found.get("mindspore", []), found.get(name, []))
            cells += [" / ".join(f"{r:.2f}x" for r in ratios) or "-", f"{min(ratios):.2f}x" if ratios else "-"]
        rows.append(f"| {mode} | {size}x{size} | {batch} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def memory_table(measurements: Sequence[Measurement], keys: Sequence[Tuple[str, int, int]]) -> str:
    """Markdown table of each framework's peak resident memory during the timed steps (MB), per mode, size and
    batch."""
    frameworks = [name for name in ("mindspore", "torch", "onnxruntime") if any(m.framework == name for m in measurements)]
    titles = {"mindspore": "MindSpore", "torch": "PyTorch", "onnxruntime": "onnxruntime"}
    header = "| mode | input | batch | " + " | ".join(f"{titles[name]} peak MB" for name in frameworks)
    header += " | MindSpore / PyTorch memory |" if "torch" in frameworks and "mindspore" in frameworks else " |"
    rows = [header, "|" + "---|" * (header.count("|") - 1)]
    for mode, size, batch in keys:
        found = {m.framework: m.peak_rss_bytes for m in measurements
                 if (m.mode, m.image_size, m.batch_size) == (mode, size, batch)}
        cells = [f"{found[name] / 1e6:.0f}" if found.get(name) else "-" for name in frameworks]
        if "torch" in frameworks and "mindspore" in frameworks:
            ours, theirs = found.get("mindspore"), found.get("torch")
            cells.append(f"{ours / theirs:.2f}x" if ours and theirs else "-")
        rows.append(f"| {mode} | {size}x{size} | {batch} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def recipe_table(measurements: Sequence[Measurement], recipes: Sequence[str]) -> str:
    """Markdown table of MindSpore training images/s per recipe (amp_level, -sink), each as a ratio to the first."""
    header = "| input | batch | " + " | ".join(f"{recipe} img/s" for recipe in recipes) + " | " + \
        " | ".join(f"{recipe} / {recipes[0]}" for recipe in recipes[1:]) + " |"
    rows = [header, "|" + "---|" * (2 + 2 * len(recipes) - 1)]
    for size, batch in sorted({(m.image_size, m.batch_size) for m in measurements if m.recipe}):
        found = {m.recipe: m for m in measurements if m.recipe and (m.image_size, m.batch_size) == (size, batch)}
        rates = [found[recipe].images_per_second if recipe in found else None for recipe in recipes]
        cells = [f"{rate:.1f}" if rate else "-" for rate in rates]
        cells += [f"{rate / rates[0]:.2f}x" if rate and rates[0] else "-" for rate in rates[1:]]
        rows.append(f"| {size}x{size} | {batch} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def peak_rate(gemms: Sequence[GemmMeasurement], measurements: Sequence[Measurement]) -> float:
    """The fastest fp32 rate seen in the run (GFLOP/s): the best single GEMM product or the best timing of a model
    measurement, whichever is higher. A shared machine's slow phases pull medians down; this is the rate it showed
    it can reach."""
    rates = [2 * g.n ** 3 / min(g.seconds) / 1e9 for g in gemms]
    rates += [m.flops_per_image * m.batch_size / min(m.seconds_per_step) / 1e9 for m in measurements
              if m.flops_per_image]
    return max(rates)


def ceiling_table(measurements: Sequence[Measurement], keys: Sequence[Tuple[str, int, int]], peak: float) -> str:
    """Markdown table: each framework's FLOP rate as a share of the run's peak fp32 rate (peak_rate), and the ratio to
    each peer that MindSpore would reach at 100 % of it: the most fp32 arithmetic allows on this machine without
    fewer FLOPs."""
    rows = [f"Against the fastest fp32 rate seen in this run, {peak:.1f} GFLOP/s (its best GEMM product or best "
            "model timing):", "",
            "| mode | input | batch | MindSpore % of peak | PyTorch % of peak | MindSpore / PyTorch at 100 % of peak "
            "| onnxruntime % of peak | MindSpore / onnxruntime at 100 % of peak |", "|---|---|---|---|---|---|---|---|"]
    for mode, size, batch in keys:
        found = {m.framework: m for m in measurements if (m.mode, m.image_size, m.batch_size) == (mode, size, batch)}
        cells = []
        for framework in ("mindspore", "torch", "onnxruntime"):
            rate = found[framework].gflops_per_second if framework in found else None
            cells.append("-" if rate is None else f"{100 * rate / peak:.1f}")
            if framework != "mindspore":
                cells.append("-" if not rate else f"{peak / rate:.2f}x")
        rows.append(f"| {mode} | {size}x{size} | {batch} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def train_py_table(measurements: Sequence[Measurement]) -> str:
    """Markdown table: a real train.py run's training images/s next to the benchmark's MindSpore training step,
    pooled and, with several rounds, round by round (each round's train.py run against that round's step, measured
    one after the other): a slow phase of a shared machine moves a single pair, the round ratios show it."""
    rounds = any(len(m.round_images_per_second) > 1 for m in measurements if m.framework == "train.py")
    rows = ["| input | batch | benchmark.py MindSpore img/s | train.py img/s | train.py / benchmark.py |"
            + (" by round |" if rounds else ""),
            "|---|---|---|---|---|" + ("---|" if rounds else "")]
    bench = {(m.image_size, m.batch_size): m for m in measurements if m.framework == "mindspore"
             and m.mode == "train" and m.recipe in ("", "O0")}
    for run in sorted((m for m in measurements if m.framework == "train.py"), key=lambda m: (m.image_size,
                                                                                             m.batch_size)):
        ours = bench.get((run.image_size, run.batch_size))
        row = (f"| {run.image_size}x{run.image_size} | {run.batch_size} | "
               f"{f'{ours.images_per_second:.1f}' if ours else '-'} | {run.images_per_second:.1f} | "
               f"{f'{run.images_per_second / ours.images_per_second:.2f}x' if ours else '-'} |")
        if rounds:
            ratios = round_ratios(run.round_images_per_second, ours.round_images_per_second if ours else [])
            row += f" {' / '.join(f'{r:.2f}x' for r in ratios) or '-'} |"
        rows.append(row)
    return "\n".join(rows)


def to_json(measurements: Sequence[Measurement], environment: Dict[str, str],
            gemms: Sequence[GemmMeasurement] = (), macs: Optional[Dict[int, int]] = None) -> Dict:
    """Everything measured: each model measurement with its FLOP rate (PyTorch's with the same count) and share
    of the GEMM rate, the forward multiply-adds per input size, and every GEMM timing."""
    rates = gemm_rates(gemms) if gemms else {}
    reference = max(rates.values(), default=None)
    result: Dict = {"environment": environment}
    result["flops"] = {"convention": FLOP_CONVENTION,
                       "forward_macs_per_image": {str(size): count for size, count in (macs or {}).items()}}
    result["gemm"] = {"reference_gflops_per_second": reference,  # the fastest backend's: the practical limit
                      "reference_backend": max(rates, key=rates.get) if rates else None,
                      "gflops_per_second_by_backend": rates,
                      "measurements": [dict(asdict(g), gflops_per_second=g.gflops_per_second) for g in gemms]}
    result["measurements"] = [dict(asdict(m), images_per_second=m.images_per_second,
                                   gflops_per_second=m.gflops_per_second,
                                   percent_of_gemm=_percent_of(m.gflops_per_second, reference))
                              for m in measurements]
    return result
