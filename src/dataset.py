"""CIFAR-10 (binary version) pipelines with mindspore.dataset, and checks of the folder layout.

Training follows the reference recipe: RandomCrop 32 pad 4, RandomHorizontalFlip, Resize, Rescale,
Normalize, HWC2CHW, plus the optional augmentation of src.augmentation (all off by default). Evaluation has no random op, so it gives the same images in the same order every
run (the reference flips test images at random: a bug not copied here).
"""
import os
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

import numpy as np
import mindspore as ms
import mindspore.dataset as ds
from mindspore.dataset import vision
from mindspore.dataset.transforms import TypeCast

from src.augmentation import Augmentation, BatchAugmenter
from src.errors import UserError

TRAIN_FILES = tuple(f"data_batch_{index}.bin" for index in range(1, 6))
TEST_FILE = "test_batch.bin"
RECORD_BYTES = 1 + 32 * 32 * 3  # label byte, then the R, G and B planes
RECORDS_PER_FILE = 10000  # MindSpore's reader refuses any other count
FILE_BYTES = RECORD_BYTES * RECORDS_PER_FILE
SYNTHETIC_MARKER = "SYNTHETIC_DATA.txt"
DIGITS_MARKER = "DIGITS_PROXY.txt"

CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2023, 0.1994, 0.2010)

LAYOUT_HINT = ("expected the extracted CIFAR-10 binary folder (cifar-10-batches-bin) holding data_batch_1.bin .. "
               "data_batch_5.bin for training and test_batch.bin for evaluation")


def cifar_files(folder: str, training: bool) -> List[Path]:
    """The .bin files a training or evaluation run reads from folder, checked for presence and size.

    Raises UserError naming the folder or file and the expected layout.
    """
    path = Path(folder)
    if not path.is_dir():
        raise UserError(f"data folder {path} does not exist; {LAYOUT_HINT}")
    names = TRAIN_FILES if training else (TEST_FILE,)
    files = [path / name for name in names if (path / name).is_file()]
    if not files:
        wanted = "data_batch_1.bin .. data_batch_5.bin" if training else TEST_FILE
        raise UserError(f"data folder {path} has no {wanted}; {LAYOUT_HINT}")
    for file in files:
        size = file.stat().st_size
        if size < FILE_BYTES:
            raise UserError(f"{file} is truncated ({size:,} bytes; a CIFAR-10 batch file holds {FILE_BYTES:,}): "
                            "extract or download the dataset again")
    return files


def is_synthetic(folder: str) -> bool:
    """True for a folder written by src.synthetic_data (it carries a marker file)."""
    return (Path(folder) / SYNTHETIC_MARKER).is_file()


# The CIFAR-format folders that are not CIFAR-10, by the marker file their writer leaves: (the label every output
# carries, what the data is).
NOT_CIFAR10 = {SYNTHETIC_MARKER: ("SYNTHETIC data", "generated coloured squares"),
               DIGITS_MARKER: ("DIGITS proxy data", "scikit-learn's handwritten digits")}


def not_cifar10_kind(folder: str) -> Tuple[str, str]:
    """(label, description) of a CIFAR-format folder that is not CIFAR-10 (from its marker file); ("", "") for
    CIFAR-10."""
    for marker, kind in NOT_CIFAR10.items():
        if (Path(folder) / marker).is_file():
            return kind
    return "", ""


def shard_indices(total: int, training: bool, rank_size: int = 1, rank_id: int = 0, num_samples: int = 0,
                  seed: int = 1, epoch: int = 0) -> np.ndarray:
    """Record indices one rank reads in one epoch.

    The first num_samples records (all when 0) are used; training shuffles them with a permutation
    fixed by (seed, epoch), the same on every rank, and cuts it to a multiple of rank_size so each rank
    runs the same number of steps. Shards are disjoint and, for evaluation, cover every record once
    (MindSpore's own sharding pads short shards with repeated records, which would skew the metrics).
    """
    if not 0 <= rank_id < rank_size:
        raise ValueError(f"rank_id {rank_id} outside 0..{rank_size - 1}")
    count = min(num_samples, total) if num_samples else total
    indices = np.arange(count, dtype=np.int64)
    if training:
        indices = np.random.default_rng([seed, epoch]).permutation(indices)
        indices = indices[:count - count % rank_size]
    return indices[rank_id::rank_size]


def eval_transforms(target_hw: Tuple[int, int], source_hw: Tuple[int, int] = (32, 32)) -> list:
    """Evaluation preprocessing of an RGB uint8 HWC image of source_hw pixels: Resize (bilinear) to
    target_hw unless already that size, Rescale 1/255, Normalize with the reference mean/std, HWC2CHW.

    create_dataset (CIFAR images are 32x32) and predict.py (any image) both use it.
    """
    transforms = []
    if tuple(source_hw) != tuple(target_hw):
        transforms.append(vision.Resize(tuple(int(v) for v in target_hw)))
    transforms += [
        vision.Rescale(1.0 / 255.0, 0.0),
        vision.Normalize(list(CIFAR10_MEAN), list(CIFAR10_STD)),
        vision.HWC2CHW(),
    ]
    return transforms


def augmentation_seed(seed: int, epoch: int) -> int:
    """Seed of the random crops, flips and auto_augment policy ops in one epoch: a resumed run repeats them
    exactly."""
    return int(np.random.default_rng([seed, epoch, 1]).integers(0, 2**31 - 1))


def create_dataset(data_path: str, do_train: bool, batch_size: int = 32, image_size: Tuple[int, int] = (224, 224),
                   rank_size: int = 1, rank_id: int = 0, num_samples: int = 0, num_parallel_workers: int = 8,
                   seed: int = 1, epoch: int = 0, skip_batches: int = 0,
                   augment: Optional[Augmentation] = None) -> ds.Dataset:
    """A batched CIFAR-10 pipeline of (image float32 NCHW, label int32) for one epoch.

    data_path: the folder with data_batch_*.bin (training) or test_batch.bin (evaluation).
    skip_batches: batches to drop from the start, for resuming mid-epoch with the same augmentation.
    augment: training augmentation beyond the reference recipe (None: none); evaluation ignores it. With MixUp or
    CutMix the labels are soft: float32 (batch, class_num).
    Raises UserError when the folder does not hold the expected files.
    """
    files = cifar_files(data_path, training=do_train)
    indices = shard_indices(len(files) * RECORDS_PER_FILE, do_train, rank_size, rank_id, num_samples, seed, epoch)
    if len(indices) == 0 or (do_train and len(indices) < batch_size):
        raise UserError(f"{data_path}: {len(indices)} images for this device, fewer than one batch of {batch_size}; "
                        "raise train_num_samples or lower batch_size")
    workers = max(1, min(num_parallel_workers, os.cpu_count() or 1))  # more workers than cores raises
    if do_train:
        # mindspore.dataset draws its random numbers from this global seed.
        ds.config.set_seed(augmentation_seed(seed, epoch))
    dataset = ds.Cifar10Dataset(str(data_path), usage="train" if do_train else "test",
                                sampler=ds.SubsetSampler(indices.tolist()), num_parallel_workers=workers)
    augment = augment if do_train and augment is not None else Augmentation()
    transforms = []
    if do_train:
        transforms += [vision.RandomCrop((32, 32), (4, 4, 4, 4)), vision.RandomHorizontalFlip(prob=0.5)]
        transforms += augment.policy_ops()  # on the 32x32 uint8 image, as torchvision's CIFAR recipes
    transforms += eval_transforms(image_size)  # resizing 32x32 to 32x32 is skipped: it is the identity
    dataset = dataset.map(operations=TypeCast(ms.int32), input_columns="label")
    dataset = dataset.map(operations=transforms, input_columns="image", num_parallel_workers=workers)
    if augment.per_batch:
        # Random erasing, MixUp and CutMix on the normalized CHW batch, keyed by the batch's index.
        dataset = dataset.batch(batch_size, drop_remainder=True, num_parallel_workers=workers,
                                per_batch_map=BatchAugmenter(augment, seed, epoch, rank_id),
                                input_columns=["image", "label"])
    else:
        dataset = dataset.batch(batch_size, drop_remainder=do_train)
    if skip_batches:
        # Skipped after map and batch so the random ops still draw for them: the rest of the epoch then
        # sees the same crops, flips and policy ops as an uninterrupted run (the batch-level draws depend
        # on the batch's index alone).
        dataset = dataset.skip(skip_batches)
    return dataset


def class_names(class_num: int) -> Sequence[str]:
    """CIFAR-10's class names for 10 classes, else class_0 .. class_{n-1}."""
    return CIFAR10_CLASSES if class_num == len(CIFAR10_CLASSES) else tuple(f"class_{i}" for i in range(class_num))
