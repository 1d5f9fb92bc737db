"""Training and inference throughput of this project's ResNet (MindSpore) next to torchvision's (PyTorch), and for
inference next to onnxruntime running this project's ONNX export, with MindSpore's achieved FLOP rate as a share of
the machine's fp32 matrix-product (GEMM) rate.

python benchmark.py [--sizes 32,224] [--modes train,eval] [--frameworks mindspore,torch,onnxruntime]
                    [--batch_size 32[,64]] [--repeats 3] [--rounds 1]
                    [--gemm_size 3072] [--conv_implementation auto|onednn_blocked|mindspore]
                    [--inference_network fused|fused-blocked|fused-nhwc|resnet] [--recipes O0,O2,O3,O0-sink]
                    [--optimizer adam|nesterov] [--isa native|avx2] [--train_py] [--output FILE]

Each (framework, mode, input size, batch size, training recipe) runs in its own process: warmup steps (compilation
included) are not timed, then --repeats timings of --steps steps, the processes of one (mode, input size, batch
size) taking turns timing by timing, so that each framework's timings and the others' share the machine's phases;
the table reports the median, pooled over --rounds rounds. onnxruntime (inference only, --threads intra-op threads)
runs the file export.py writes for a seeded network of the same shape, exported once per input size and batch before
the rounds. MindSpore runs as train.py does, with conv_implementation resolved on CPU; --train_py also times
train.py itself, taking turns with the training workers (stopped between its turns). The GEMM rate is timed the same
way (one n x n product per timing, one process per backend: MindSpore ops.matmul with the oneDNN setting its model
workers use, numpy, and torch.mm when torch is installed) before and after the model measurements; the fastest
backend's median is the reference. FLOPs per image are counted from the network (see src.benchmark.FLOP_CONVENTION).
Results go to stdout as a markdown table and to --output as JSON.
"""
import argparse
import datetime
import importlib
import importlib.metadata
import itertools
import json
import os
import platform
import sys
import tempfile
from dataclasses import asdict, replace
from pathlib import Path
from typing import Callable, Dict, List, Tuple

from src.architectures import MODEL_NAMES as ARCHITECTURES  # not src.resnet's: it would load MindSpore
from src.atomic_file import write_text_atomic
from src.benchmark import (GEMM_BACKENDS, OPTIMIZERS, Measurement, TrainPyRun, WorkerRun, check_recipe,
                           export_onnx_here, export_onnx_in_subprocess, flops_per_image, forward_macs,
                           forward_macs_in_subprocess, measure_gemm_here, measure_gemm_in_subprocess, measure_here,
                           measure_side_by_side, table, to_json, warmup_steps, worker_turns)
from src.errors import OneLineArgumentParser, UserError, run_cli
from src.model_utils.config import CHOICES

FRAMEWORKS = ("mindspore", "torch", "onnxruntime")
WORKERS = FRAMEWORKS + ("macs", "onnx-export") + tuple(f"gemm-{backend}" for backend in GEMM_BACKENDS)


def _int_at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value
    return parse


def _whole_numbers(minimum: int, what: str) -> Callable[[str], List[int]]:
    """A comma-separated list of whole numbers of at least minimum, each once."""
    def parse(text: str) -> List[int]:
        try:
            return list(dict.fromkeys(_int_at_least(minimum)(part) for part in text.split(",")))
        except argparse.ArgumentTypeError as exc:
            raise argparse.ArgumentTypeError(f"comma-separated {what}: {exc}") from None
    return parse


# 32 is the smallest input ResNet's five stride-2 stages leave a pixel of.
_sizes = _whole_numbers(32, "input sizes")
_batch_sizes = _whole_numbers(1, "batch sizes")


def _names(*allowed: str) -> Callable[[str], List[str]]:
    def parse(text: str) -> List[str]:
        names = text.split(",")
        unknown = [name for name in names if name not in allowed]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {', '.join(map(repr, unknown))}; "
                                             f"choose from {', '.join(allowed)}")
        return names
    return parse


def _recipes(text: str) -> List[str]:
    try:
        return list(dict.fromkeys(check_recipe(part) for part in text.split(",")))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


# --isa avx2: each framework's switch. oneDNN (MindSpore's, the native convolutions' and PyTorch's), PyTorch's own
# kernels, MKL (PyTorch's GEMMs) and OpenBLAS (numpy's GEMM reference).
AVX2_CAP = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
            "OPENBLAS_CORETYPE": "Haswell"}


def parse_args(argv=None) -> argparse.Namespace:
    parser = OneLineArgumentParser(prog="benchmark.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=_sizes, default="32,224", help="input sizes, comma separated")
    parser.add_argument("--modes", type=_names("train", "eval"), default="train,eval", help="train, eval or both")
    parser.add_argument("--frameworks", type=_names(*FRAMEWORKS), default=",".join(FRAMEWORKS),
                        help="any of mindspore, torch, onnxruntime (inference only), comma separated")
    parser.add_argument("--model_name", choices=ARCHITECTURES, default="resnet50")
    parser.add_argument("--batch_size", type=_batch_sizes, default="32",
                        help="images per step; several, comma separated, are measured side by side (e.g. 32,64)")
    parser.add_argument("--threads", type=_int_at_least(1), default=os.cpu_count() or 1)
    parser.add_argument("--warmup", type=_int_at_least(0), default=None,
                        help="untimed steps before the timings (default: four timings' worth, at least 2: 20 at "
                             "32x32, 4 at larger sizes; MindSpore's first 15 or so training steps run 5-7 %% slower)")
    parser.add_argument("--repeats", type=_int_at_least(1), default=3)
    parser.add_argument("--rounds", type=_int_at_least(1), default=1,
                        help="times the whole set of measurements is repeated, alternating the frameworks")
    parser.add_argument("--steps", type=_int_at_least(0), default=0,
                        help="steps per repeat (0: 5 at 32x32, 1 at larger sizes)")
    parser.add_argument("--gemm_size", type=_int_at_least(1), default=3072,
                        help="n of the n x n GEMM (3072: 58 GFLOP, about 0.3-0.8 s a product on 2 cores)")
    parser.add_argument("--conv_implementation", choices=CHOICES["conv_implementation"], default="auto",
                        help="MindSpore's convolutions, as the config key (auto: onednn_blocked when built)")
    parser.add_argument("--inference_network", choices=("fused", "fused-blocked", "fused-nhwc", "resnet"),
                        default="fused",
                        help="MindSpore's inference: the fused network evaluation runs (one oneDNN call a layer, "
                             "when the convolutions are onednn_blocked; its activation layout as "
                             "evaluation picks it, or forced), or the ResNet cell itself")
    parser.add_argument("--recipes", type=_recipes, default="O0",
                        help="MindSpore training recipes, comma separated: amp_level O0-O3, with -sink for the loss "
                             "read once per timing of --steps steps as with dataset_sink_mode, then -plain for the "
                             "activations reordered to the plain layout around every native convolution, then "
                             "-nn_optimizer for MindSpore's own optimizer instead of the native one-pass update "
                             "or -oihw_gradients for that update with the weight gradients reordered to OIHW "
                             "(e.g. O0,O2,O3,O0-sink,O0-plain,O0-nn_optimizer,O0-oihw_gradients); "
                             "the first is compared with PyTorch, all of them with the first")
    parser.add_argument("--optimizer", choices=tuple(OPTIMIZERS), default="adam",
                        help="the training step's optimizer, in every framework: adam (the reference's, train.py's "
                             "default) or nesterov (momentum SGD, as the configs/ recipes)")
    parser.add_argument("--isa", choices=("native", "avx2"), default="native",
                        help="instruction set: native (what the CPU has, or ONEDNN_MAX_CPU_ISA if you set it), or "
                             "avx2 (every framework capped at AVX2, as on a CPU without AVX-512; onnxruntime has no "
                             "such switch and is left out)")
    parser.add_argument("--train_py", action="store_true",
                        help="also time a real train.py run per training size and round (generated data, the same "
                             "batch and threads; its second epoch's steps, taking turns with the training workers), "
                             "next to the benchmark's training step")
    parser.add_argument("--output", default="benchmark.json")
    parser.add_argument("--worker", choices=WORKERS, help=argparse.SUPPRESS)
    parser.add_argument("--side_by_side", action="store_true", help=argparse.SUPPRESS)  # a worker taking turns
    parser.add_argument("--onnx_path", default="", help=argparse.SUPPRESS)  # the onnxruntime workers' file
    return parser.parse_args(argv)


def run_worker(args: argparse.Namespace) -> object:
    """One measurement in this process (benchmark.py --worker ...), as JSON-ready data for the parent."""
    if args.worker == "macs":
        from src.model_utils.config import load_config
        classes = load_config([], prog="benchmark.py").class_num
        return {str(size): forward_macs(args.model_name, size, classes) for size in args.sizes}
    if args.worker == "onnx-export":
        return export_onnx_here(args.model_name, args.sizes[0], args.batch_size[0], args.onnx_path)
    if args.worker.startswith("gemm-"):
        return asdict(measure_gemm_here(args.worker[len("gemm-"):], args.gemm_size, args.threads,
                                        warmup_steps(args.warmup, 1), args.repeats, args.conv_implementation))
    return asdict(measure_here(args.worker, args.modes[0], args.model_name, args.sizes[0], args.batch_size[0],
                               args.threads, warmup_steps(args.warmup, args.steps or 1), args.repeats, args.steps or 1,
                               args.conv_implementation, args.inference_network, args.recipes[0], args.onnx_path,
                               args.optimizer, worker_turns() if args.side_by_side else None))


def measure_models(args: argparse.Namespace, frameworks: List[str], macs: Dict[int, int],
                   onnx_files: Dict[Tuple[int, int], str], work_folder: str) -> List[Measurement]:
    """Every (framework, mode, size, batch, recipe) measurement over --rounds rounds, each in its own worker
    process; those of one (mode, size, batch) take turns timing by timing (measure_side_by_side).

    Several rounds repeat the whole set over the run; each (framework, mode, size, batch, recipe) pools its timings
    over the rounds. onnxruntime measures inference only. train.py (--train_py), a whole run, takes
    turns with its size's training workers, stopped between its turns."""
    measurements: Dict[tuple, Measurement] = {}
    for round_number in range(1, args.rounds + 1):
        for size, batch, mode in itertools.product(args.sizes, args.batch_size, args.modes):
            steps = args.steps or (5 if size <= 64 else 1)
            runs = [WorkerRun(framework, mode, args.model_name, size, batch, warmup_steps(args.warmup, steps),
                              args.repeats, steps, args.conv_implementation, args.inference_network, recipe,
                              onnx_files.get((size, batch), "") if framework == "onnxruntime" else "", args.optimizer)
                    for framework in frameworks if mode == "eval" or framework != "onnxruntime"
                    for recipe in (args.recipes if framework == "mindspore" and mode == "train" else ["O0"])]
            train_py = (TrainPyRun(args.model_name, size, batch, steps, args.repeats, work_folder, args.optimizer)
                        if mode == "train" and args.train_py else None)
            print(f"measuring {', '.join(run.describe() for run in runs)}{' and train.py' if train_py else ''} {mode} "
                  f"{size}x{size} batch {batch}, taking turns (round {round_number} of {args.rounds}) ...",
                  file=sys.stderr, flush=True)
            measured = measure_side_by_side(runs, args.threads, train_py)
            for measurement in measured:  # a measurement's recipe is set for MindSpore's training only
                key = (measurement.framework, mode, size, batch, measurement.recipe)
                measurement = replace(measurement, round_images_per_second=[measurement.images_per_second],
                                      flops_per_image=flops_per_image(macs[size], mode))
                if key in measurements:
                    measurement = merge_rounds(measurements[key], measurement)
                measurements[key] = measurement
    return list(measurements.values())


def merge_rounds(earlier: Measurement, later: Measurement) -> Measurement:
    """One measurement's rounds pooled: the timings and their starts, each round's rate, the time it waited for the
    others' turns and the CPU it used meanwhile."""
    idle_cpu = (None if earlier.idle_cpu_seconds is None or later.idle_cpu_seconds is None
                else earlier.idle_cpu_seconds + later.idle_cpu_seconds)
    return replace(later, seconds_per_step=earlier.seconds_per_step + later.seconds_per_step,
                   timing_start_times=earlier.timing_start_times + later.timing_start_times,
                   round_images_per_second=earlier.round_images_per_second + later.round_images_per_second,
                   idle_seconds=earlier.idle_seconds + later.idle_seconds, idle_cpu_seconds=idle_cpu)


def main() -> int:
    args = parse_args()
    if args.worker:
        print(json.dumps(run_worker(args)))
        return 0
    output = Path(args.output)
    if not output.parent.is_dir():  # found out now, not after minutes of measuring
        raise UserError(f"--output {output}: folder {output.parent} does not exist")
    frameworks = args.frameworks
    if args.isa == "avx2":  # the workers inherit it; set before any of them starts
        os.environ.update(AVX2_CAP)
        if "onnxruntime" in frameworks:
            print("--isa avx2: onnxruntime has no switch to cap its instruction set: measuring without it",
                  file=sys.stderr)
            frameworks = [f for f in frameworks if f != "onnxruntime"]
    torch_version = _import_version("torch")
    if "torch" in frameworks and (torch_version is None or _import_version("torchvision") is None):
        print("PyTorch/torchvision not usable: measuring MindSpore only", file=sys.stderr)
        frameworks = [f for f in frameworks if f != "torch"]
    onnxruntime_version = None
    if "onnxruntime" in frameworks and "eval" in args.modes:  # it measures inference only
        onnxruntime_version = _import_version("onnxruntime")
        if onnxruntime_version is None:
            print("onnxruntime not usable: measuring inference without it", file=sys.stderr)
    if onnxruntime_version is None:
        frameworks = [f for f in frameworks if f != "onnxruntime"]
    gemm_backends = [b for b in GEMM_BACKENDS if b != "torch" or torch_version is not None]

    def measure_gemms(phase: str) -> list:
        gemms = []
        for backend in gemm_backends:
            print(f"measuring GEMM {backend} ({phase}) ...", file=sys.stderr, flush=True)
            gemms.append(measure_gemm_in_subprocess(backend, args.gemm_size, args.threads,
                                                    warmup_steps(args.warmup, 1), args.repeats, phase,
                                                    args.conv_implementation))
        return gemms

    print(f"counting {args.model_name} FLOPs ...", file=sys.stderr, flush=True)
    macs = forward_macs_in_subprocess(args.model_name, args.sizes, args.threads)
    with tempfile.TemporaryDirectory(prefix="benchmark-") as work_folder:
        onnx_files = {}
        if "onnxruntime" in frameworks:
            for size, batch in itertools.product(args.sizes, args.batch_size):
                print(f"exporting ONNX {size}x{size} batch {batch} for onnxruntime ...", file=sys.stderr, flush=True)
                onnx_files[(size, batch)] = export_onnx_in_subprocess(
                    args.model_name, size, batch, str(Path(work_folder) / f"{size}-{batch}.onnx"), args.threads)
        # GEMM both before and after the models: the machine has slow phases, and the two rounds show drift across
        # the run; the reference pools both rounds' timings, so one phase doesn't decide it.
        gemms = measure_gemms("before")
        measurements = measure_models(args, frameworks, macs, onnx_files, work_folder)
    gemms += measure_gemms("after")
    environment = {"date": datetime.date.today().isoformat(), "machine": platform.machine(),
                   "processor": _cpu_name(), "cores": str(os.cpu_count()), "python": platform.python_version(),
                   "mindspore": importlib.metadata.version("mindspore"), "model": args.model_name,
                   "isa": "avx2 (" + ", ".join(f"{k}={v}" for k, v in AVX2_CAP.items()) + ")"
                   if args.isa == "avx2" else "native", "transparent_hugepage": _transparent_hugepages()}
    if "train" in args.modes:
        environment["optimizer"] = args.optimizer
    ran = {(m.conv_implementation, m.onednn_max_cpu_isa) for m in measurements if m.framework == "mindspore"}
    if ran:  # what the MindSpore workers resolved (the same in each)
        environment["mindspore_convolutions"] = ", ".join(sorted(r[0] for r in ran))
        environment["ONEDNN_MAX_CPU_ISA"] = ", ".join(sorted(r[1] for r in ran))
    inference = {m.inference_network for m in measurements if m.framework == "mindspore" and m.mode == "eval"}
    if inference:
        environment["mindspore_inference"] = ", ".join(sorted(inference))
    if torch_version:
        environment["torch"] = torch_version
    if "onnxruntime" in frameworks:
        environment["onnxruntime"] = onnxruntime_version
    print(" ".join(f"{k}={v}" for k, v in environment.items()))
    print(table(measurements, gemms, args.model_name))
    write_text_atomic(output, json.dumps(to_json(measurements, environment, gemms, macs), indent=2) + "\n")
    return 0


def _import_version(module: str):
    """The module's version, or None when it does not import (torchvision's CUDA wheels next to a CPU-only torch
    fail with a RuntimeError, not an ImportError)."""
    try:
        return getattr(importlib.import_module(module), "__version__", "unknown")
    except Exception as exc:  # noqa: BLE001 (any import failure means: not usable here)
        print(f"{module} does not import ({type(exc).__name__}: {str(exc)[:200]})", file=sys.stderr)
        return None


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _transparent_hugepages() -> str:
    """The kernel's transparent-huge-page mode (always, madvise or never): with huge pages, PyTorch's training step
    at 32x32 ran 1.09x to 1.25x as fast as without, MindSpore's 1.02x to 1.05x (docs/performance.md)."""
    try:
        return Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().split("[", 1)[1].split("]", 1)[0]
    except (OSError, IndexError):
        return "unknown"


if __name__ == "__main__":
    run_cli(main)
