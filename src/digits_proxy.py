"""scikit-learn's 1,797 handwritten digits written as a CIFAR-format folder: real images that ship in a package,
for comparing recipes where CIFAR-10 cannot be downloaded. Not CIFAR-10: outputs label it DIGITS proxy data.

The 8x8 grey images (values 0-16) are scaled to 0-255, resized bilinearly to 32x32 and copied to R, G and B.
A stratified split (fixed seed) keeps 500 images for test_batch.bin and 1,297 for data_batch_1.bin. MindSpore's
reader needs 10,000 records per file, so each file repeats its images in order: the first 1,297 training records
(train_num_samples: 1297) and the first 500 test records (eval_num_samples: 500) hold each image once.
"""
from pathlib import Path

import cv2
import numpy as np

from src.dataset import DIGITS_MARKER, RECORD_BYTES, RECORDS_PER_FILE, TEST_FILE, TRAIN_FILES
from src.errors import UserError
from src.synthetic_data import write_cifar_folder

TEST_IMAGES = 500
TRAIN_IMAGES = 1797 - TEST_IMAGES


def _load_digits():
    try:
        from sklearn.datasets import load_digits  # the images ship inside the package: no download
        from sklearn.model_selection import train_test_split
    except ImportError as error:
        raise UserError("the digits proxy needs scikit-learn: pip install -r requirements-dev.txt") from error
    digits = load_digits()
    return train_test_split(digits.images, digits.target, test_size=TEST_IMAGES, stratify=digits.target,
                            random_state=0)


def digit_records(images: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """(count, 3073) CIFAR records of 8x8 digit images (0-16), repeated in order to fill a 10,000-record file."""
    records = np.empty((len(images), RECORD_BYTES), np.uint8)
    records[:, 0] = labels
    for index, image in enumerate(images):
        grey = cv2.resize((image * (255.0 / 16.0)).astype(np.float32), (32, 32), interpolation=cv2.INTER_LINEAR)
        plane = np.clip(np.rint(grey), 0, 255).astype(np.uint8).reshape(-1)
        records[index, 1:] = np.tile(plane, 3)
    return records[np.arange(RECORDS_PER_FILE) % len(records)]


def write_digits_cifar(folder: str) -> Path:
    """Writes data_batch_1.bin (1,297 training digits) and test_batch.bin (500 test digits) into folder, with a
    marker file; does nothing when folder already holds them."""
    target = Path(folder)
    if (target / DIGITS_MARKER).is_file():
        return target
    train_images, test_images, train_labels, test_labels = _load_digits()
    records = {TRAIN_FILES[0]: digit_records(train_images, train_labels),
               TEST_FILE: digit_records(test_images, test_labels)}
    return write_cifar_folder(
        folder, records, DIGITS_MARKER,
        f"DIGITS proxy data written by src/digits_proxy.py: scikit-learn's handwritten digits (0-9) as 32x32 RGB in\n"
        f"CIFAR-10's binary format; {TRAIN_IMAGES} training and {TEST_IMAGES} test images, repeated to fill each\n"
        "file. Not CIFAR-10: accuracy on it says nothing about CIFAR-10.\n")
