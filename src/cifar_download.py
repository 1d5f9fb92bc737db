"""Downloads the CIFAR-10 binary archive, checks its MD5 and extracts it into the data folder.

Nothing half-done is left under a final name: the archive is written as *.part and removed unless its
MD5 matches, and the extracted folder is moved into place in one rename.
"""
import hashlib
import logging
import os
import shutil
import tarfile
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from src.dataset import TRAIN_FILES
from src.errors import UserError
from src.file_hash import file_digest

ARCHIVE_FOLDER = "cifar-10-batches-bin"  # the folder inside the official archive
CHUNK_BYTES = 1 << 20


def file_md5(path: Path) -> str:
    return file_digest(path, "md5")


def download_file(url: str, destination: Path, md5: str, logger: logging.Logger, timeout: float = 60.0) -> Path:
    """Downloads url to destination, keeping it only if its MD5 is md5. Raises UserError otherwise."""
    partial = destination.with_name(destination.name + ".part")
    digest = hashlib.md5()
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response, open(partial, "wb") as out:
            total = int(response.headers.get("Content-Length") or 0)
            done, next_report = 0, 0.1
            while True:
                chunk = response.read(CHUNK_BYTES)
                if not chunk:
                    break
                out.write(chunk)
                digest.update(chunk)
                done += len(chunk)
                if total and done / total >= next_report:
                    logger.info("downloaded %.0f%% of %s (%d MB)", 100 * done / total, url, total >> 20)
                    next_report += 0.1
    except (urllib.error.URLError, OSError, ValueError) as exc:
        partial.unlink(missing_ok=True)
        reason = getattr(exc, "reason", exc)
        raise UserError(f"could not download {url} to {destination}: {reason}; download and extract it by hand "
                        "into data_path, or check dataset_url") from None
    if digest.hexdigest() != md5.lower():
        partial.unlink(missing_ok=True)
        raise UserError(f"download of {url} has MD5 {digest.hexdigest()}, expected {md5}: the file is damaged or "
                        "not the CIFAR-10 binary archive and was removed; try again or check dataset_url/dataset_md5")
    os.replace(partial, destination)
    return destination


def extract_cifar_archive(archive: Path, data_path: Path) -> Path:
    """Extracts the archive's cifar-10-batches-bin folder to data_path, in one rename at the end."""
    staging = Path(tempfile.mkdtemp(prefix=".extract-", dir=data_path.parent))
    try:
        try:
            with tarfile.open(archive, "r:gz") as tar:
                tar.extractall(staging, filter="data")  # "data" refuses absolute paths and links outside
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
        download_file(url, archive, md5, logger)
    logger.info("extracting %s to %s", archive, target)
    return extract_cifar_archive(archive, target)
