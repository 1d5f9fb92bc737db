"""Training and inference throughput of this project's ResNet (MindSpore) next to torchvision's (PyTorch).

python benchmark.py [--sizes 32,224] [--modes train,eval] [--batch_size 32] [--repeats 3] [--output FILE]

Each (framework, mode, input size) runs in its own process: warmup steps (compilation included) are not
timed, then --repeats timings of --steps steps; the table reports the median. Results go to stdout as a
markdown table and to --output as JSON.
"""
import argparse
import datetime
import json
import os
import platform
import sys
from pathlib import Path

from src.benchmark import measure_here, measure_in_subprocess, table, to_json


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="32,224", help="input sizes, comma separated")
    parser.add_argument("--modes", default="train,eval", help="train, eval or both")
    parser.add_argument("--frameworks", default="mindspore,torch", help="mindspore, torch or both")
    parser.add_argument("--model_name", default="resnet50")
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=0, help="steps per repeat (0: 5 at 32x32, 1 at larger sizes)")
    parser.add_argument("--output", default="benchmark.json")
    parser.add_argument("--worker", choices=["mindspore", "torch"], help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main() -> int:
    args = parse_args()
    sizes = [int(size) for size in args.sizes.split(",")]
    modes = args.modes.split(",")
    if args.worker:  # one measurement, printed as JSON for the parent process
        measurement = measure_here(args.worker, modes[0], args.model_name, sizes[0], args.batch_size, args.threads,
                                   args.warmup, args.repeats, args.steps or 1)
        print(json.dumps(dict(vars(measurement))))
        return 0
    frameworks = args.frameworks.split(",")
    if "torch" in frameworks:
        try:
            import torch  # noqa: F401
            import torchvision  # noqa: F401
        except ImportError:
            print("PyTorch/torchvision not installed: measuring MindSpore only", file=sys.stderr)
            frameworks = [f for f in frameworks if f != "torch"]
    measurements = []
    for size in sizes:
        for mode in modes:
            for framework in frameworks:
                steps = args.steps or (5 if size <= 64 else 1)
                print(f"measuring {framework} {mode} {size}x{size} ...", file=sys.stderr, flush=True)
                measurements.append(measure_in_subprocess(framework, mode, args.model_name, size, args.batch_size,
                                                          args.threads, args.warmup, args.repeats, steps))
    import mindspore
    environment = {"date": datetime.date.today().isoformat(), "machine": platform.machine(),
                   "processor": _cpu_name(), "cores": str(os.cpu_count()), "python": platform.python_version(),
                   "mindspore": mindspore.__version__, "model": args.model_name,
                   "ONEDNN_MAX_CPU_ISA": os.environ.get("ONEDNN_MAX_CPU_ISA", "AVX2 (project default)")}
    if "torch" in frameworks:
        import torch
        environment["torch"] = torch.__version__
    print(" ".join(f"{k}={v}" for k, v in environment.items()))
    print(table(measurements))
    Path(args.output).write_text(json.dumps(to_json(measurements, environment), indent=2) + "\n")
    return 0


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":
    sys.exit(main())
