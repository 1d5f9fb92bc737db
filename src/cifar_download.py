"""Downloads the CIFAR-10 binary archive, checks its MD5 and extracts it into the data folder.

Nothing half-done is left under a final name: the archive is downloaded through src.download (a temporary
name, removed unless its MD5 matches), and the extracted folder is moved into place in one rename.
"""
import logging
import os
import shutil
import tarfile
import tempfile
import urllib.parse
from pathlib import Path
from typing import Iterator

from src.dataset import TRAIN_FILES
from src.download import download
from src.errors import UserError
from src.file_hash import file_digest

ARCHIVE_FOLDER = "cifar-10-batches-bin"  # the folder inside the official archive


def file_md5(path: Path) -> str:
    return file_digest(path, "md5")


def _checked_members(tar: tarfile.TarFile, folder: Path) -> Iterator[tarfile.TarInfo]:
    """The archive's members, one by one as they are read, each checked to be a plain file or folder that lands
    inside folder; else TarError.

    tarfile's "data" filter does this and more, but Python 3.10 has it only from 3.10.12 and 3.11 from 3.11.4;
    before them extractall(filter=...) raises TypeError. CIFAR-10's archive holds no links or devices, so they
    are refused outright. Lazy, so that extractall decompresses the archive once: members before a bad one are
    already extracted, into the staging folder the caller removes."""
    root = folder.resolve()
    for member in tar:
        target = (root / member.name).resolve()
        if not (member.isfile() or member.isdir()) or (target != root and root not in target.parents):
            raise tarfile.TarError(f"member {member.name!r} is a link or a device, or lands outside the folder it "
                                   "is extracted into")
        yield member


def extract_cifar_archive(archive: Path, data_path: Path) -> Path:
    """Extracts the archive's cifar-10-batches-bin folder to data_path, in one rename at the end.

    A folder, not a file, so src.atomic_file does not fit: it is extracted into a private .extract-* folder next
    to data_path (same file system) and renamed as a whole.
    """
    staging = Path(tempfile.mkdtemp(prefix=".extract-", dir=data_path.parent))
    try:
        try:
            with tarfile.open(archive, "r:gz") as tar:
                # The filter also drops set-uid bits and keeps Python 3.12+ from warning, where it exists.
                data_filter = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
                tar.extractall(staging, _checked_members(tar, staging), **data_filter)
        except (tarfile.TarError, OSError, EOFError) as exc:
            raise UserError(f"{archive} could not be extracted ({exc}); delete it and download again") from None
        found = [p for p in staging.rglob(TRAIN_FILES[0])]
        if not found:
            raise UserError(f"{archive} holds no {TRAIN_FILES[0]}: not the CIFAR-10 binary archive; delete it and "
                            "check dataset_url")
        if data_path.exists() and not any(data_path.iterdir()):
            data_path.rmdir()
        os.rename(found[0].parent, data_path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return data_path


def download_cifar10(data_path: str, url: str, md5: str, logger: logging.Logger) -> Path:
    """Fetches and extracts CIFAR-10 so that data_path holds data_batch_*.bin and test_batch.bin."""
    target = Path(data_path)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise UserError(f"data_path {target} exists but holds no data_batch_*.bin: empty it or point data_path at a "
                        "new folder so CIFAR-10 can be downloaded there, or set --download false")
    target.parent.mkdir(parents=True, exist_ok=True)
    archive = target.parent / Path(urllib.parse.urlparse(url).path).name
    if not archive.name.endswith((".tar.gz", ".tgz")):
        archive = target.parent / "cifar-10-binary.tar.gz"
    if archive.is_file():
        if file_md5(archive) != md5.lower():
            raise UserError(f"{archive} is there but its MD5 is not {md5}: delete it so it is downloaded again")
    else:
        logger.info("downloading CIFAR-10 from %s to %s", url, archive)
        download(url, archive, "md5", md5, logger,
                 fix_unreachable="download and extract it by hand into data_path, or check dataset_url",
                 expected_file="not the CIFAR-10 binary archive",
                 fix_mismatch="try again or check dataset_url/dataset_md5")
    logger.info("extracting %s to %s", archive, target)
    return extract_cifar_archive(archive, target)
