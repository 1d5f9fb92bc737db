"""torchvision's ResNet trained in PyTorch with the SGD core of a recipe config, on a CIFAR-format folder: the
PyTorch twin of a train.py run, to tell a port's fault from a recipe's behaviour.

    python scripts/torch_sgd_twin.py --config_path configs/cifar10_resnet50_cifar_stem.yaml \
        --data_path data/digits-cifar-bin --output_path output/twin [train.py keys: --epoch_size 12 --lr 0.025 ...]

It reads the configuration as train.py does (default_config.yaml, the config file, then `--key value` overrides)
and trains torchvision's model of that name and stem (the CIFAR stem: conv1 3x3 stride 1, no max pool) with what
that configuration sets among: momentum SGD (Nesterov), weight decay (on every parameter, or not on BatchNorm and
biases), the learning-rate schedule (the same per-step array as train.py's, from src/lr_schedule.py), label
smoothing, batch size, seed, train_num_samples / eval_num_samples, and the reference's random crop (padding 4),
horizontal flip and normalisation. Anything else a configuration can switch on (Adam, AutoAugment and the other
augmentations, mixup/cutmix, EMA, gradient clipping, other input sizes) is refused: the twin would not be one.
Writes OUTPUT/metrics.csv as train.py does (src/metrics_file.py), with epoch, lr, train_loss, top1 and epoch_seconds
filled in.
"""
import argparse
import os
import sys
import time
from pathlib import Path
from typing import List, Tuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from src.dataset import CIFAR10_MEAN, CIFAR10_STD, RECORD_BYTES, TEST_FILE, TRAIN_FILES  # noqa: E402
from src.errors import UserError  # noqa: E402
from src.lr_schedule import schedule_from_config  # noqa: E402
from src.metrics_file import MetricsFile  # noqa: E402
from src.model_utils.config import load_config  # noqa: E402

# Keys whose non-default values the twin does not reproduce, with the value that switches them off.
NOT_IN_TWIN = {"auto_augment": "none", "random_erasing": 0.0, "mixup_alpha": 0.0, "cutmix_alpha": 0.0,
               "ema_decay": 0.0, "grad_clip_norm": 0.0}


def check_twin_config(config) -> None:
    """Refuses a configuration the twin cannot train as train.py would."""
    if config.optimizer != "momentum":
        raise UserError(f"optimizer {config.optimizer!r}: the twin runs momentum SGD only")
    for key, off in NOT_IN_TWIN.items():
        if getattr(config, key) != off:
            raise UserError(f"{key} {getattr(config, key)!r}: not in the twin; run it with --{key} {off}")
    if (config.image_height, config.image_width) != (32, 32):
        raise UserError("image_height/image_width: the twin trains at 32x32 only")


def read_cifar_records(paths: List[Path], count: int) -> Tuple[np.ndarray, np.ndarray]:
    """The first count records (0: all) of CIFAR-10 binary files in order: (count, 3, 32, 32) float32 images in 0-1
    and int64 labels."""
    chunks = []
    for path in paths:
        raw = np.fromfile(path, np.uint8)
        if raw.size == 0 or raw.size % RECORD_BYTES:
            raise UserError(f"{path}: not a CIFAR-10 binary file (records of {RECORD_BYTES} bytes)")
        chunks.append(raw.reshape(-1, RECORD_BYTES))
    records = np.concatenate(chunks)
    if count > len(records):
        raise UserError(f"{paths[0].parent}: {len(records)} records, fewer than the {count} asked for")
    records = records[:count or len(records)]
    return records[:, 1:].reshape(-1, 3, 32, 32).astype(np.float32) / 255.0, records[:, 0].astype(np.int64)


def crop_and_flip(images: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """The reference's RandomCrop(32, padding=4) and RandomHorizontalFlip on a batch of 0-1 images, before it is
    normalised: the padding is black, as torchvision's and train.py's crop pad the image itself."""
    padded = np.pad(images, ((0, 0), (0, 0), (4, 4), (4, 4)))
    out = np.empty_like(images)
    for index, image in enumerate(padded):
        top, left = rng.integers(0, 9, 2)
        patch = image[:, top:top + 32, left:left + 32]
        out[index] = patch[:, :, ::-1] if rng.random() < 0.5 else patch
    return out


def build_torch_resnet(model_name: str, stem: str, num_classes: int):
    import torch.nn as nn
    import torchvision

    net = getattr(torchvision.models, model_name)(num_classes=num_classes)
    if stem == "cifar":
        net.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
        nn.init.kaiming_normal_(net.conv1.weight, mode="fan_out", nonlinearity="relu")
        net.maxpool = nn.Identity()
    return net


def train(config, data_path: Path, output_path: Path, threads: int) -> List[dict]:
    import torch

    torch.manual_seed(config.seed)
    torch.set_num_threads(threads)
    rng = np.random.default_rng(config.seed)
    mean = np.asarray(CIFAR10_MEAN, np.float32)[:, None, None]
    std = np.asarray(CIFAR10_STD, np.float32)[:, None, None]
    train_files = [data_path / name for name in TRAIN_FILES if (data_path / name).is_file()]
    if not train_files or not (data_path / TEST_FILE).is_file():
        raise UserError(f"{data_path}: no {TRAIN_FILES[0]} or {TEST_FILE}; pass --data_path with a CIFAR-10 binary "
                        "folder")
    train_x, train_y = read_cifar_records(train_files, config.train_num_samples)
    test_x, test_y = read_cifar_records([data_path / TEST_FILE], config.eval_num_samples)
    test_x = (test_x - mean) / std  # training batches are normalised after their crop and flip
    net = build_torch_resnet(config.model_name, config.stem, config.class_num)
    steps = len(train_x) // config.batch_size  # train.py drops the last partial batch
    rates = schedule_from_config(config, steps)
    decayed = [p for p in net.parameters() if p.dim() > 1] if config.no_weight_decay_bn_bias else list(net.parameters())
    rest = [p for p in net.parameters() if config.no_weight_decay_bn_bias and p.dim() <= 1]
    groups = [{"params": decayed, "weight_decay": config.weight_decay}] + ([{"params": rest, "weight_decay": 0.0}]
                                                                           if rest else [])
    optimizer = torch.optim.SGD(groups, lr=float(rates[0]), momentum=config.momentum, nesterov=bool(config.nesterov))
    loss_fn = torch.nn.CrossEntropyLoss(label_smoothing=config.label_smoothing)
    metrics, step = MetricsFile(str(output_path / "metrics.csv")), 0
    for epoch in range(1, config.epoch_size + 1):
        start, total = time.perf_counter(), 0.0
        net.train()
        order = rng.permutation(len(train_x))
        for batch in range(steps):
            index = order[batch * config.batch_size:(batch + 1) * config.batch_size]
            for group in optimizer.param_groups:
                group["lr"] = float(rates[step])
            images = (crop_and_flip(train_x[index], rng) - mean) / std
            loss = loss_fn(net(torch.from_numpy(images)), torch.from_numpy(train_y[index]))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total += loss.item()
            step += 1
        net.eval()
        with torch.no_grad():
            predicted = np.concatenate([net(torch.from_numpy(test_x[i:i + 100])).argmax(1).numpy()
                                        for i in range(0, len(test_x), 100)])
        metrics.append({"epoch": epoch, "lr": float(rates[step - 1]), "train_loss": total / steps,
                        "top1": float(np.mean(predicted == test_y)), "epoch_seconds": time.perf_counter() - start})
        print(" ".join(f"{k} {v}" for k, v in metrics.rows[-1].items() if v), flush=True)
    return metrics.rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data_path", type=Path, required=True)
    parser.add_argument("--output_path", type=Path, required=True)
    parser.add_argument("--threads", type=int, default=0, help="PyTorch's intra-op threads (0: every CPU)")
    args, overrides = parser.parse_known_args()
    try:
        config = load_config(overrides)
        check_twin_config(config)
        args.output_path.mkdir(parents=True, exist_ok=True)
        threads = args.threads or len(os.sched_getaffinity(0))
        train(config, args.data_path, args.output_path, threads)
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
