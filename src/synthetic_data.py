"""A generated dataset in CIFAR-10's binary format, for first runs and tests without the real data.

Each image is noise with a square whose colour depends on the class, at a random place and size, so a
network can learn it in a few hundred steps. It is not CIFAR-10: runs on it say so in their output.
"""
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from src.dataset import RECORDS_PER_FILE, SYNTHETIC_MARKER, TEST_FILE, TRAIN_FILES

# One RGB colour per class, far apart from each other.
PALETTE = np.array([[230, 25, 75], [60, 180, 75], [255, 225, 25], [0, 130, 200], [245, 130, 48],
                    [145, 30, 180], [70, 240, 240], [240, 50, 230], [128, 128, 0], [255, 255, 255]], np.int16)


def synthetic_records(count: int, rng: np.random.Generator) -> np.ndarray:
    """count CIFAR binary records (label byte + R, G, B planes) as a (count, 3073) uint8 array."""
    labels = rng.permutation(np.arange(count) % len(PALETTE))
    background = rng.integers(0, 256, size=(count, 1, 1, 1), dtype=np.int16)
    images = background + rng.normal(0, 40, size=(count, 3, 32, 32)).astype(np.int16)
    size = rng.integers(10, 20, size=count)
    top = rng.integers(0, 32 - size + 1)
    left = rng.integers(0, 32 - size + 1)
    axis = np.arange(32)
    rows = (axis[None, :] >= top[:, None]) & (axis[None, :] < (top + size)[:, None])
    cols = (axis[None, :] >= left[:, None]) & (axis[None, :] < (left + size)[:, None])
    square = rows[:, :, None] & cols[:, None, :]  # (count, 32, 32)
    colour = PALETTE[labels][:, :, None, None] + rng.normal(0, 15, size=(count, 3, 1, 1)).astype(np.int16)
    images = np.where(square[:, None, :, :], colour, images)
    records = np.empty((count, 1 + 3 * 32 * 32), np.uint8)
    records[:, 0] = labels
    records[:, 1:] = np.clip(images, 0, 255).reshape(count, -1)
    return records


def write_synthetic_cifar(folder: str, seed: int = 0) -> Path:
    """Writes data_batch_1..5.bin, test_batch.bin and a marker file into folder (created atomically).

    Files are full size (10,000 records each), as MindSpore's Cifar10Dataset requires.
    """
    target = Path(folder)
    target.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    # A folder, not a file, so src.atomic_file does not fit: the files go into a private .synthetic-* folder next
    # to target (same file system), which gets target's name in one rename; a rename refuses a non-empty target
    # folder, so ranks generating the data at once keep the first complete one.
    staging = Path(tempfile.mkdtemp(prefix=".synthetic-", dir=target.parent))
    try:
        for name in TRAIN_FILES + (TEST_FILE,):
            synthetic_records(RECORDS_PER_FILE, rng).tofile(staging / name)
        (staging / SYNTHETIC_MARKER).write_text(
            "Synthetic data written by src/synthetic_data.py: coloured squares on noise in CIFAR-10's binary\n"
            "format. Not CIFAR-10: accuracy on it says nothing about CIFAR-10.\n", encoding="utf-8")
        try:
            os.rename(staging, target)  # atomic; fails if another process got there first
        except OSError:
            if not (target / SYNTHETIC_MARKER).is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
