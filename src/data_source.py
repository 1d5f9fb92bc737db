"""Finds the data a run needs, generating (synthetic_data) or downloading (download) it when missing."""
import logging
from dataclasses import dataclass
from pathlib import Path

from src.cifar_download import download_cifar10
from src.dataset import (NOT_CIFAR10, SYNTHETIC_MARKER, TEST_FILE, TRAIN_FILES, cifar_files, is_synthetic,
                         not_cifar10_kind)
from src.errors import UserError
from src.synthetic_data import write_synthetic_cifar


@dataclass(frozen=True)
class DataSource:
    train_path: str
    eval_path: str
    label: str = ""  # "" for CIFAR-10, else how outputs name the data (src.dataset.NOT_CIFAR10)
    what: str = ""  # what that data is

    @property
    def synthetic(self) -> bool:
        return self.label == NOT_CIFAR10[SYNTHETIC_MARKER][0]

    @property
    def tag(self) -> str:
        """Appended to result lines: empty for CIFAR-10."""
        return f" [{self.label}, not CIFAR-10]" if self.label else ""

    def describe(self) -> str:
        kind = f"{self.label} ({self.what}, not CIFAR-10)" if self.label else "CIFAR-10"
        return f"{kind}: train {self.train_path}, eval {self.eval_path}"


def _has_any(folder: str, names) -> bool:
    return any((Path(folder) / name).is_file() for name in names)


def prepare_data(config, logger: logging.Logger, training: bool = True) -> DataSource:
    """Resolves data_path / eval_data_path, making the data when it is missing and the config allows it.

    synthetic_data: true writes a generated CIFAR-format dataset at data_path; otherwise download: true
    fetches the real archive there. Raises UserError when the files are missing and can't be made.
    """
    data_path = config.data_path
    eval_path = config.eval_data_path or data_path
    wanted = TRAIN_FILES if training else (TEST_FILE,)
    needed_folder = data_path if training else eval_path
    if not _has_any(needed_folder, wanted) and needed_folder == data_path:
        if config.synthetic_data:
            logger.info("generating a synthetic CIFAR-format dataset in %s (not CIFAR-10)", data_path)
            write_synthetic_cifar(data_path, seed=config.seed)
        elif config.download:
            download_cifar10(data_path, config.dataset_url, config.dataset_md5, logger)
    if training:
        cifar_files(data_path, training=True)
    cifar_files(eval_path, training=False)
    if config.synthetic_data and not is_synthetic(data_path):
        raise UserError(f"synthetic_data is true but {data_path} holds other data; point data_path at an empty or "
                        "synthetic folder, or set synthetic_data false")
    kind = not_cifar10_kind(eval_path)
    if training and not kind[0]:
        kind = not_cifar10_kind(data_path)
    return DataSource(data_path, eval_path, *kind)
