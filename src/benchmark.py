"""Throughput of ResNet training steps and inference forward passes, MindSpore (this project's code)
against PyTorch/torchvision, each measurement in its own process so thread pools don't interfere."""
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Dict, List, Sequence

import numpy as np

REPO = Path(__file__).resolve().parents[1]


@dataclass
class Measurement:
    framework: str
    mode: str  # train or eval
    image_size: int
    batch_size: int
    threads: int
    seconds_per_step: List[float]

    @property
    def images_per_second(self) -> float:
        return self.batch_size / statistics.median(self.seconds_per_step)


def _time_steps(run_step: Callable[[], None], warmup: int, repeats: int, steps: int) -> List[float]:
    """Seconds per step of each repeat (steps steps each), after warmup steps (which include compilation)."""
    for _ in range(warmup):
        run_step()
    timings = []
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(steps):
            run_step()
        timings.append((time.perf_counter() - started) / steps)
    return timings


def mindspore_step(mode: str, model_name: str, image_size: int, batch_size: int,
                   total_steps: int) -> Callable[[], None]:
    """One training step (TrainOneStepCell with Adam, as train.py builds it) or one inference forward."""
    import mindspore as ms
    from src.lr_schedule import schedule_from_config
    from src.model_utils.config import load_config
    from src.resnet import build_resnet
    from src.trainer import build_optimizer, build_train_step
    from src.utils import apply_cpu_speed_setting

    apply_cpu_speed_setting()
    ms.set_seed(1)
    ms.set_context(mode=ms.GRAPH_MODE)
    config = load_config([], prog="benchmark.py")
    net = build_resnet(model_name, config.class_num)
    rng = np.random.default_rng(0)
    images = ms.Tensor(rng.standard_normal((batch_size, 3, image_size, image_size), np.float32))
    labels = ms.Tensor(rng.integers(0, config.class_num, batch_size).astype(np.int32))
    if mode == "eval":
        net.set_train(False)
        return lambda: net(images).asnumpy()
    learning_rates = schedule_from_config(config.replace(epoch_size=1, warmup_epochs=0), total_steps)
    optimizer = build_optimizer(config, net.trainable_params(), learning_rates)
    train_step = build_train_step(net, optimizer, config, "O0", None)
    return lambda: train_step(images, labels).asnumpy()


def torch_step(mode: str, model_name: str, image_size: int, batch_size: int) -> Callable[[], None]:
    """The same step in PyTorch with torchvision's model: Adam(lr 1e-3, weight_decay 1e-5), cross-entropy."""
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
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-3, weight_decay=1e-5)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step() -> None:
        optimizer.zero_grad()
        loss_fn(net(images), labels).backward()
        optimizer.step()
    return step


def measure_here(framework: str, mode: str, model_name: str, image_size: int, batch_size: int, threads: int,
                 warmup: int, repeats: int, steps: int) -> Measurement:
    """Runs one measurement in this process."""
    if framework == "torch":
        import torch
        torch.set_num_threads(threads)
        run_step = torch_step(mode, model_name, image_size, batch_size)
    else:
        run_step = mindspore_step(mode, model_name, image_size, batch_size, warmup + repeats * steps)
    timings = _time_steps(run_step, warmup, repeats, steps)
    return Measurement(framework, mode, image_size, batch_size, threads, timings)


def measure_in_subprocess(framework: str, mode: str, model_name: str, image_size: int, batch_size: int, threads: int,
                          warmup: int, repeats: int, steps: int) -> Measurement:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), GLOG_v=os.environ.get("GLOG_v", "3"))
    args = [sys.executable, str(REPO / "benchmark.py"), "--worker", framework, "--modes", mode, "--model_name",
            model_name, "--sizes", str(image_size), "--batch_size", str(batch_size), "--threads", str(threads),
            "--warmup", str(warmup), "--repeats", str(repeats), "--steps", str(steps)]
    process = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True)
    if process.returncode != 0:
        raise RuntimeError(f"{framework} {mode} {image_size}: worker failed:\n{process.stderr[-3000:]}")
    return Measurement(**json.loads(process.stdout.strip().splitlines()[-1]))


def table(measurements: Sequence[Measurement]) -> str:
    """Markdown table: images/s of each framework and the MindSpore/PyTorch ratio."""
    def rate(found: Dict[str, Measurement], framework: str) -> str:
        return f"{found[framework].images_per_second:.1f}" if framework in found else "-"

    rows = ["| mode | input | batch | threads | MindSpore img/s | PyTorch img/s | MindSpore / PyTorch |",
            "|---|---|---|---|---|---|---|"]
    keys = sorted({(m.mode, m.image_size) for m in measurements}, key=lambda k: (k[0] != "train", k[1]))
    for mode, size in keys:
        found = {m.framework: m for m in measurements if (m.mode, m.image_size) == (mode, size)}
        ratio = "-"
        if "mindspore" in found and "torch" in found:
            ratio = f"{found['mindspore'].images_per_second / found['torch'].images_per_second:.2f}x"
        first = next(iter(found.values()))
        rows.append(f"| {mode} | {size}x{size} | {first.batch_size} | {first.threads} | {rate(found, 'mindspore')} | "
                    f"{rate(found, 'torch')} | {ratio} |")
    return "\n".join(rows)


def to_json(measurements: Sequence[Measurement], environment: Dict[str, str]) -> Dict:
    return {"environment": environment,
            "measurements": [dict(asdict(m), images_per_second=m.images_per_second) for m in measurements]}
