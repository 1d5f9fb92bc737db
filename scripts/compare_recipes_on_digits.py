"""Top-1 of the reference recipe and the recipe configs, side by side, on the DIGITS proxy (not CIFAR-10).

    python scripts/compare_recipes_on_digits.py [--epochs 12] [--seed 1] [--runs NAME,...]

CIFAR-10 cannot be downloaded everywhere, and a full recipe takes days on a CPU. This writes scikit-learn's
handwritten digits as a CIFAR-format folder (src/digits_proxy.py: 1,297 training and 500 test images, 32x32) and
runs train.py (or its PyTorch twin) once per run below, one after the other, with the same data, seed, input size
and number of epochs:

    reference_imagenet   default_config.yaml (the reference recipe: Adam, constant lr), ImageNet stem
    reference_cifar      the same with the CIFAR stem
    recipe_cifar         configs/cifar10_resnet50_cifar_stem.yaml (EMA on)
    recipe_imagenet      the same config with the ImageNet stem
    cpu_fast_resnet18    configs/cifar10_resnet18_cpu_fast.yaml
    recipe_cifar_sgd     recipe_cifar without AutoAugment, random erasing and EMA (its SGD core)
    torch_recipe_cifar_sgd  the same in PyTorch (scripts/torch_sgd_twin.py, torchvision's ResNet-50): tells the
                         port's behaviour from the recipe's
    reference_imagenet_batch64  reference_imagenet at batch 64 with the lr scaled linearly (a CPU default candidate)
    reference_imagenet_batch64_lr1e-3  the same with the reference's lr (Adam is often left unscaled)

Every run is shortened to --epochs epochs at 32x32 (schedules follow epoch_size, so a cosine or one-cycle schedule
still runs its whole course) and takes batches of at most 32 (64 for the reference_imagenet_batch64 runs), its
learning rate scaled linearly (the recipes' 128 and 256 would leave 10 and 5 steps an epoch); an EMA keeps the same
share of the run: its window (1 / (1 - ema_decay) steps) is scaled by the proxy's steps over the full CIFAR-10 run's
steps. The table (final top-1 of the raw and EMA weights, best raw top-1 over the epochs) is printed and written to
OUTPUT/comparison.md and comparison.json; each run's log, metrics.csv and checkpoints are in OUTPUT/NAME. A run whose
folder already holds a finished run of the same command is reused. Accuracy on 500 digit images moves by about a
point between seeds: read small gaps as ties.
"""
import argparse
import csv
import json
import math
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from src.atomic_file import write_text_atomic  # noqa: E402
from src.digits_proxy import TEST_IMAGES, TRAIN_IMAGES, write_digits_cifar  # noqa: E402
from src.errors import UserError  # noqa: E402
from src.model_utils.config import load_config  # noqa: E402

CIFAR10_TRAIN_IMAGES = 50000
# 1,297 images make 10 steps an epoch at the recipes' batch of 128 and 5 at 256: their warmups and schedules, made
# for 391 steps an epoch, would run in a handful of steps (the ResNet-50 recipe diverged in its 10 warmup steps).
# On the proxy every run takes batches of at most 32 (the reference's), 40 steps an epoch.
PROXY_BATCH_SIZE = 32
RESNET50_CIFAR_STEM = "configs/cifar10_resnet50_cifar_stem.yaml"
RESNET18_CPU_FAST = "configs/cifar10_resnet18_cpu_fast.yaml"

TRAIN = "train.py"
TORCH_TWIN = "scripts/torch_sgd_twin.py"
SGD_CORE = ["--auto_augment", "none", "--random_erasing", "0", "--ema_decay", "0"]


@dataclass(frozen=True)
class Run:
    config_file: Optional[str]  # None: default_config.yaml alone
    extra: Sequence[str]  # train.py arguments on top of the config
    what: str
    script: str = TRAIN
    max_batch: int = PROXY_BATCH_SIZE  # larger batches shrink to it, their lr scaled linearly


RUNS = {
    "reference_imagenet": Run(None, ["--model_name", "resnet50", "--stem", "imagenet"],
                              "reference recipe, ResNet-50, ImageNet stem"),
    "reference_cifar": Run(None, ["--model_name", "resnet50", "--stem", "cifar"],
                           "reference recipe, ResNet-50, CIFAR stem"),
    "recipe_cifar": Run(RESNET50_CIFAR_STEM, [], "cifar10_resnet50_cifar_stem.yaml (CIFAR stem)"),
    "recipe_imagenet": Run(RESNET50_CIFAR_STEM, ["--stem", "imagenet"],
                           "cifar10_resnet50_cifar_stem.yaml with the ImageNet stem"),
    "cpu_fast_resnet18": Run(RESNET18_CPU_FAST, [], "cifar10_resnet18_cpu_fast.yaml (ResNet-18, CIFAR stem)"),
    "recipe_cifar_sgd": Run(RESNET50_CIFAR_STEM, SGD_CORE,
                            "recipe_cifar without AutoAugment, random erasing, EMA (MindSpore)"),
    "torch_recipe_cifar_sgd": Run(RESNET50_CIFAR_STEM, SGD_CORE, "the same in PyTorch (torchvision's ResNet-50)",
                                  script=TORCH_TWIN),
    "reference_imagenet_batch64": Run(None, ["--model_name", "resnet50", "--stem", "imagenet", "--batch_size", "64",
                                             "--lr", "0.002"],
                                      "reference recipe at batch 64, lr 0.002 (scaled linearly), ImageNet stem",
                                      max_batch=64),
    "reference_imagenet_batch64_lr1e-3": Run(None, ["--model_name", "resnet50", "--stem", "imagenet",
                                                    "--batch_size", "64"],
                                             "reference recipe at batch 64, lr 0.001 (the reference's), ImageNet stem",
                                             max_batch=64),
}


def recipe_settings(config_file: Optional[str], extra: Sequence[str] = ()) -> Dict:
    """The run's configuration as train.py reads it (default_config.yaml overlaid by config_file, then extra)."""
    return load_config((["--config_path", str(ROOT / config_file)] if config_file else []) + list(extra)).to_dict()


def proxy_ema_decay(settings: Dict, epochs: int, max_batch: int = PROXY_BATCH_SIZE) -> float:
    """The recipe's ema_decay with its window scaled from the full CIFAR-10 run's steps to the proxy's."""
    decay = float(settings.get("ema_decay", 0.0))
    if decay <= 0:
        return 0.0
    full_steps = math.ceil(CIFAR10_TRAIN_IMAGES / int(settings["batch_size"])) * int(settings["epoch_size"])
    proxy_steps = (TRAIN_IMAGES // proxy_batch_and_lr(settings, max_batch)[0]) * epochs
    window = max(2.0, (1.0 / (1.0 - decay)) * proxy_steps / full_steps)
    return round(1.0 - 1.0 / window, 4)


def proxy_batch_and_lr(settings: Dict, max_batch: int = PROXY_BATCH_SIZE) -> Tuple[int, float]:
    """The batch size a run uses on the proxy (at most max_batch) and its learning rate, scaled linearly with the
    batch (Goyal et al., 2017) when the batch shrinks."""
    batch = int(settings["batch_size"])
    if batch <= max_batch:
        return batch, float(settings["lr"])
    return max_batch, float(settings["lr"]) * max_batch / batch


def run_command(name: str, args: argparse.Namespace) -> List[str]:
    run = RUNS[name]
    settings = recipe_settings(run.config_file, run.extra)
    batch, lr = proxy_batch_and_lr(settings, run.max_batch)
    command = [sys.executable, str(ROOT / run.script)]
    if run.config_file:
        command += ["--config_path", str(ROOT / run.config_file)]
    command += list(run.extra) + [
        "--data_path", str(args.data_path), "--download", "false", "--synthetic_data", "false",
        "--train_num_samples", str(TRAIN_IMAGES), "--eval_num_samples", str(TEST_IMAGES),
        "--image_height", "32", "--image_width", "32", "--epoch_size", str(args.epochs), "--eval_interval", "1",
        "--seed", str(args.seed), "--log_interval", "1000", "--keep_checkpoint_max", "1",
        "--output_path", str(args.output_path / name)]
    if batch != int(settings["batch_size"]):
        command += ["--batch_size", str(batch), "--lr", f"{lr:g}"]
    if float(settings.get("ema_decay", 0.0)) > 0:
        command += ["--ema_decay", str(proxy_ema_decay(settings, args.epochs, run.max_batch))]
    return command


def read_metrics(path: Path) -> List[Dict[str, str]]:
    if not path.is_file():
        return []
    with path.open(newline="", encoding="utf-8") as handle:
        return list(csv.DictReader(handle))


def finished(folder: Path, command: List[str], epochs: int) -> bool:
    marker = folder / "compare_command.json"
    return (marker.is_file() and json.loads(marker.read_text(encoding="utf-8")) == command[1:]
            and len(read_metrics(folder / "metrics.csv")) == epochs)


def run_one(name: str, args: argparse.Namespace) -> Dict:
    folder = args.output_path / name
    command = run_command(name, args)
    if finished(folder, command, args.epochs):
        print(f"{name}: reusing the finished run in {folder}", flush=True)
    else:
        print(f"{name}: {' '.join(command[1:])}", flush=True)
        folder.mkdir(parents=True, exist_ok=True)
        log = folder / "compare_run.log"
        with log.open("w", encoding="utf-8") as handle:
            # env: Python's os.environ, not the C-level environment, where importing MindSpore (here through
            # src.dataset) has set OMP_NUM_THREADS=1 and more: passed on, train.py would use one thread.
            code = subprocess.call(command, cwd=ROOT, env=dict(os.environ), stdout=handle, stderr=subprocess.STDOUT)
        if code != 0:
            tail = log.read_text(encoding="utf-8", errors="replace").strip().splitlines()[-1:]
            raise UserError(f"run {name} failed (exit {code}): {tail[0] if tail else ''}; whole log: {log}")
        write_text_atomic(folder / "compare_command.json", json.dumps(command[1:]))
    rows = read_metrics(folder / "metrics.csv")
    last = rows[-1]
    ema = last.get("ema_top1") or ""
    return {
        "run": name, "what": RUNS[name].what, "final_top1": float(last["top1"]),
        "final_ema_top1": float(ema) if ema else None,
        "best_top1": max(float(row["top1"]) for row in rows if row["top1"]),
    }


def markdown_table(results: List[Dict], args: argparse.Namespace) -> str:
    lines = [f"DIGITS proxy (scikit-learn's handwritten digits as 32x32 CIFAR-format images: {TRAIN_IMAGES} training, "
             f"{TEST_IMAGES} test; NOT CIFAR-10), {args.epochs} epochs, seed {args.seed}.", "",
             "| run | what | final top-1 | final top-1, EMA | best top-1 |",
             "|---|---|---|---|---|"]
    for result in results:
        ema = "-" if result["final_ema_top1"] is None else f"{result['final_ema_top1']:.3f}"
        lines.append(f"| {result['run']} | {result['what']} | {result['final_top1']:.3f} | {ema} | "
                     f"{result['best_top1']:.3f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--runs", default=",".join(RUNS), help="comma separated, from: " + ", ".join(RUNS))
    parser.add_argument("--data_path", type=Path, default=ROOT / "data" / "digits-cifar-bin")
    parser.add_argument("--output_path", type=Path, default=ROOT / "output" / "digits_proxy")
    args = parser.parse_args()
    try:
        names = [name.strip() for name in args.runs.split(",") if name.strip()]
        unknown = [name for name in names if name not in RUNS]
        if unknown or not names:
            raise UserError(f"--runs: unknown run {', '.join(unknown) or '(none)'}; choose from {', '.join(RUNS)}")
        if args.epochs < 1:
            raise UserError("--epochs must be at least 1")
        write_digits_cifar(str(args.data_path))
        results = [run_one(name, args) for name in names]
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    table = markdown_table(results, args)
    args.output_path.mkdir(parents=True, exist_ok=True)
    write_text_atomic(args.output_path / "comparison.md", table)
    write_text_atomic(args.output_path / "comparison.json", json.dumps(results, indent=2) + "\n")
    print(table, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
