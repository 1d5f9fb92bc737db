"""A generated dataset in CIFAR-10's binary format, for first runs and tests without the real data.

Each image is noise with a square whose colour depends on the class, at a random place and size, so a
network can learn it in a few hundred steps. It is not CIFAR-10: runs on it say so in their output.
"""
import os
import shutil
import tempfile
from pathlib import Path
from typing import Dict

import numpy as np

from src.dataset import RECORD_BYTES, RECORDS_PER_FILE, SYNTHETIC_MARKER, TEST_FILE, TRAIN_FILES

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


def write_cifar_folder(folder: str, records_by_file: Dict[str, np.ndarray], marker: str, marker_text: str) -> Path:
    """Writes CIFAR binary files (name -> (10,000, 3073) uint8 records) and a marker file into folder, atomically.

    The files go into a private .staging-* folder next to folder (same file system), which gets folder's name in
    one rename; a rename refuses a non-empty target folder, so ranks writing the data at once keep the first
    complete one (src.atomic_file is for single files).
    """
    target = Path(folder)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=target.parent))
    staging.chmod(0o755)  # mkdtemp makes it private; the data folder is meant to be shared
    try:
        for name, records in records_by_file.items():
            if records.shape != (RECORDS_PER_FILE, RECORD_BYTES) or records.dtype != np.uint8:
                raise ValueError(f"{name}: records must be uint8 {(RECORDS_PER_FILE, RECORD_BYTES)}, "
                                 f"got {records.dtype} {records.shape}")
            records.tofile(staging / name)
        (staging / marker).write_text(marker_text, encoding="utf-8")
        try:
            os.rename(staging, target)  # atomic; fails if another process got there first
        except OSError:
            if not (target / marker).is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def write_synthetic_cifar(folder: str, seed: int = 0) -> Path:
    """Writes data_batch_1..5.bin, test_batch.bin and a marker file into folder (created atomically).

    Files are full size (10,000 records each), as MindSpore's Cifar10Dataset requires.
    """
    rng = np.random.default_rng(seed)
    records = {name: synthetic_records(RECORDS_PER_FILE, rng) for name in TRAIN_FILES + (TEST_FILE,)}
    return write_cifar_folder(
        folder, records, SYNTHETIC_MARKER,
        "Synthetic data written by src/synthetic_data.py: coloured squares on noise in CIFAR-10's binary\n"
        "format. Not CIFAR-10: accuracy on it says nothing about CIFAR-10.\n")
