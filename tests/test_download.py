"""Downloading CIFAR-10: src.cifar_download against a real local HTTP server, and train.py end to end.

Nothing here reaches the internet: every archive is generated in the test (real tar.gz files) and served
from an http.server bound to 127.0.0.1 on a free port.
"""
import hashlib
import io
import logging
import random
import socket
import tarfile
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np
import pytest

from conftest import FAST_ARGS, assert_one_line_error, flip_one_byte, run_script, temp_files
from local_http import LocalServer, no_proxy_for_localhost  # noqa: F401 (an autouse fixture)
from src.cifar_download import ARCHIVE_FOLDER, download_cifar10, extract_cifar_archive, file_md5
from src.dataset import FILE_BYTES, RECORD_BYTES, RECORDS_PER_FILE, TEST_FILE, TRAIN_FILES
from src.errors import UserError

ALL_FILES = (*TRAIN_FILES, TEST_FILE)
ARCHIVE_NAME = "cifar-10-binary.tar.gz"
LOGGER = logging.getLogger("test_download")


# ---------------------------------------------------------------- helpers: archives and a local server

def make_archive(files: Dict[str, bytes], folder: str = ARCHIVE_FOLDER, compresslevel: int = 6,
                 links: Optional[Dict[str, str]] = None) -> bytes:
    """A gzip'd tar holding folder/NAME for each NAME -> content (folder '' puts them at the top), and a
    symbolic link folder/NAME -> TARGET for each of links."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz", compresslevel=compresslevel) as tar:
        if folder:
            info = tarfile.TarInfo(folder)
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(info)
        for name, content in files.items():
            info = tarfile.TarInfo(f"{folder}/{name}" if folder else name)
            info.size, info.mode = len(content), 0o644
            tar.addfile(info, io.BytesIO(content))
        for name, target in (links or {}).items():
            info = tarfile.TarInfo(f"{folder}/{name}" if folder else name)
            info.type, info.linkname = tarfile.SYMTYPE, target
            tar.addfile(info)
    return buffer.getvalue()


def small_cifar_files(seed: int = 0) -> Dict[str, bytes]:
    """Six small files with distinct random content, named like the real ones."""
    rng = random.Random(seed)
    return {name: rng.randbytes(1000 + index) for index, name in enumerate(ALL_FILES)}


def full_size_batch(file_index: int) -> bytes:
    """A CIFAR-10 batch file MindSpore accepts: 10,000 records, label bytes 0..9, a few non-zero pixels."""
    records = np.zeros((RECORDS_PER_FILE, RECORD_BYTES), dtype=np.uint8)
    records[:, 0] = (np.arange(RECORDS_PER_FILE) + file_index) % 10
    records[:, 1 + file_index] = 200  # one bright pixel so the files differ
    return records.tobytes()


def md5_of(data: bytes) -> str:
    return hashlib.md5(data).hexdigest()


def free_port() -> int:
    """A port nothing listens on (bound, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def server():
    local = LocalServer(default_name=ARCHIVE_NAME)
    yield local
    local.close()


@pytest.fixture(params=["tarfile as installed", "tarfile without extraction filters"])
def tarfile_filters(request, monkeypatch):
    """Extraction on this Python, and as on Pythons before 3.10.12 and 3.11.4, whose tarfile has no extraction
    filters (extractall takes no filter there)."""
    if request.param == "tarfile without extraction filters":
        monkeypatch.delattr(tarfile, "data_filter", raising=False)


@pytest.fixture
def data_path(tmp_path) -> Path:
    return tmp_path / "data" / ARCHIVE_FOLDER


def leftovers(folder: Path) -> List[str]:
    """Names in folder (recursively) that look like half-done work: temporary files or .extract-* folders."""
    if not folder.exists():
        return []
    return sorted(set(temp_files(folder)) | {str(p.relative_to(folder)) for p in folder.rglob(".extract-*")})


# ---------------------------------------------------------------- download_cifar10 against the local server

def test_download_extracts_archive_with_identical_bytes(server, data_path, tarfile_filters):
    files = small_cifar_files()
    archive_bytes = make_archive(files)
    url = server.serve(archive_bytes)

    result = download_cifar10(str(data_path), url, md5_of(archive_bytes), LOGGER)

    assert Path(result) == data_path
    assert sorted(p.name for p in data_path.iterdir()) == sorted(ALL_FILES)
    for name, content in files.items():
        assert (data_path / name).read_bytes() == content, name
    archive = data_path.parent / ARCHIVE_NAME
    assert archive.is_file() and archive.read_bytes() == archive_bytes  # kept next to data_path
    assert sorted(p.name for p in data_path.parent.iterdir()) == sorted([ARCHIVE_FOLDER, ARCHIVE_NAME])
    assert leftovers(data_path.parent) == []
    assert server.requests == [f"/{ARCHIVE_NAME}"]


def test_kept_archive_with_right_md5_is_reused_without_download(server, data_path):
    files = small_cifar_files(seed=1)
    archive_bytes = make_archive(files)
    data_path.parent.mkdir(parents=True)
    (data_path.parent / ARCHIVE_NAME).write_bytes(archive_bytes)

    # Upper-case MD5 as some sites print it; the server has nothing to serve, so a request would fail.
    download_cifar10(str(data_path), server.url(), md5_of(archive_bytes).upper(), LOGGER)

    assert server.requests == []
    for name, content in files.items():
        assert (data_path / name).read_bytes() == content, name


def test_empty_existing_data_folder_is_filled(server, data_path):
    files = small_cifar_files(seed=2)
    archive_bytes = make_archive(files)
    data_path.mkdir(parents=True)  # e.g. made by hand before the first run

    download_cifar10(str(data_path), server.serve(archive_bytes), md5_of(archive_bytes), LOGGER)

    assert sorted(p.name for p in data_path.iterdir()) == sorted(ALL_FILES)
    assert leftovers(data_path.parent) == []


def test_archive_name_falls_back_when_url_has_no_archive_name(server, data_path):
    archive_bytes = make_archive(small_cifar_files(seed=3))
    url = server.serve(archive_bytes, name="download")

    download_cifar10(str(data_path), url, md5_of(archive_bytes), LOGGER)

    assert (data_path.parent / ARCHIVE_NAME).read_bytes() == archive_bytes
    assert (data_path / TRAIN_FILES[0]).is_file()


def test_corrupted_download_is_refused_and_removed(server, data_path):
    good = make_archive(small_cifar_files())
    url = server.serve(flip_one_byte(good))

    with pytest.raises(UserError) as info:
        download_cifar10(str(data_path), url, md5_of(good), LOGGER)

    message = str(info.value)
    assert url in message and "MD5" in message and md5_of(good) in message
    assert "\n" not in message
    assert server.requests == [f"/{ARCHIVE_NAME}"]
    assert not data_path.exists()
    assert list(data_path.parent.iterdir()) == []  # no archive, no temporary file, no staging folder


@pytest.mark.parametrize("failure", ["404", "refused"])
def test_unreachable_archive_is_a_user_error(server, data_path, failure):
    if failure == "404":
        url = server.url()  # nothing served there
    else:
        url = f"http://127.0.0.1:{free_port()}/{ARCHIVE_NAME}"

    with pytest.raises(UserError) as info:
        download_cifar10(str(data_path), url, "0" * 32, LOGGER)

    message = str(info.value)
    assert url in message and "dataset_url" in message and "\n" not in message
    if failure == "404":
        assert "Not Found" in message
        assert server.requests == [f"/{ARCHIVE_NAME}"]
    assert not data_path.exists()
    assert list(data_path.parent.iterdir()) == []


def test_archive_without_training_files_is_refused(server, data_path):
    files = {name: content for name, content in small_cifar_files().items() if name != TRAIN_FILES[0]}
    archive_bytes = make_archive(files)

    with pytest.raises(UserError) as info:
        download_cifar10(str(data_path), server.serve(archive_bytes), md5_of(archive_bytes), LOGGER)

    assert TRAIN_FILES[0] in str(info.value) and "delete it" in str(info.value)
    assert not data_path.exists()
    assert leftovers(data_path.parent) == []
    # The archive passed its MD5 check, so it is kept; the message tells the user to delete it.
    assert sorted(p.name for p in data_path.parent.iterdir()) == [ARCHIVE_NAME]


def test_archive_that_is_not_gzip_is_refused(server, data_path):
    not_gzip = b"<html>this is a login page, not an archive</html>"

    with pytest.raises(UserError) as info:
        download_cifar10(str(data_path), server.serve(not_gzip), md5_of(not_gzip), LOGGER)

    assert "could not be extracted" in str(info.value) and "\n" not in str(info.value)
    assert not data_path.exists()
    assert leftovers(data_path.parent) == []


@pytest.mark.parametrize("escape", ["../../escaped.bin", "link to a file outside"])
def test_archive_member_escaping_the_folder_is_refused(server, data_path, tmp_path, tarfile_filters, escape):
    files = small_cifar_files()
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"outside")
    if escape == "link to a file outside":
        archive_bytes = make_archive(files, links={"escaped.bin": str(outside)})
    else:
        files[escape] = b"outside"
        archive_bytes = make_archive(files)

    with pytest.raises(UserError) as info:
        download_cifar10(str(data_path), server.serve(archive_bytes), md5_of(archive_bytes), LOGGER)

    assert "could not be extracted" in str(info.value)
    assert not data_path.exists()
    assert [p for p in tmp_path.rglob("escaped.bin")] == []
    assert leftovers(data_path.parent) == []


def bytes_read_by_this_process() -> int:
    """rchar of /proc/self/io: every byte this process has read, from files or sockets."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("/proc/self/io has no rchar line")


@pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="needs Linux's /proc/self/io")
def test_extraction_reads_the_archive_once(data_path, tarfile_filters):
    """The member check must not decompress the archive on its own before extractall does (162 MB for CIFAR-10)."""
    files = {name: random.Random(index).randbytes(4 << 20) for index, name in enumerate(ALL_FILES)}
    archive = data_path.parent / ARCHIVE_NAME
    archive.parent.mkdir(parents=True)
    archive.write_bytes(make_archive(files, compresslevel=1))  # random bytes: the archive is about 24 MB

    before = bytes_read_by_this_process()
    extract_cifar_archive(archive, data_path)
    read = bytes_read_by_this_process() - before

    assert archive.stat().st_size <= read < 1.5 * archive.stat().st_size
    assert {p.name: p.read_bytes() for p in data_path.iterdir()} == files


def test_existing_archive_with_wrong_md5_is_not_replaced_silently(server, data_path):
    good = make_archive(small_cifar_files())
    url = server.serve(good)
    data_path.parent.mkdir(parents=True)
    stale = data_path.parent / ARCHIVE_NAME
    stale.write_bytes(b"half of an old download")

    with pytest.raises(UserError) as info:
        download_cifar10(str(data_path), url, md5_of(good), LOGGER)

    message = str(info.value)
    assert str(stale) in message and "delete it" in message and md5_of(good) in message
    assert server.requests == []  # the server was never contacted
    assert stale.read_bytes() == b"half of an old download"  # left for the user to look at
    assert not data_path.exists()


def test_data_path_holding_other_files_is_refused_before_downloading(server, data_path):
    url = server.serve(make_archive(small_cifar_files()))
    data_path.mkdir(parents=True)
    (data_path / "notes.txt").write_text("mine")

    with pytest.raises(UserError) as info:
        download_cifar10(str(data_path), url, "0" * 32, LOGGER)

    assert str(data_path) in str(info.value) and "--download false" in str(info.value)
    assert server.requests == []
    assert sorted(p.name for p in data_path.iterdir()) == ["notes.txt"]


def test_a_prefix_of_the_md5_is_not_enough(server, data_path):
    """dataset_md5 is the whole digest: unlike a SHA-256 pin, a prefix of it does not pass."""
    archive_bytes = make_archive(small_cifar_files())
    url = server.serve(archive_bytes)

    with pytest.raises(UserError) as info:
        download_cifar10(str(data_path), url, md5_of(archive_bytes)[:8], LOGGER)

    assert "MD5" in str(info.value) and md5_of(archive_bytes) in str(info.value)
    assert list(data_path.parent.iterdir()) == []


def test_truncated_download_is_refused_and_removed(server, data_path):
    archive_bytes = make_archive(small_cifar_files())
    url = server.serve(archive_bytes, declared_length=len(archive_bytes) + 1000)

    with pytest.raises(UserError) as info:
        download_cifar10(str(data_path), url, md5_of(archive_bytes), LOGGER)

    assert url in str(info.value) and "stopped after" in str(info.value) and "\n" not in str(info.value)
    assert list(data_path.parent.iterdir()) == []


def test_file_md5_matches_hashlib(tmp_path):
    content = random.Random(5).randbytes(3 * (1 << 20) + 17)  # more than one read chunk
    path = tmp_path / "blob"
    path.write_bytes(content)
    assert file_md5(path) == md5_of(content)


# ---------------------------------------------------------------- train.py end to end

@pytest.fixture(scope="module")
def full_size_archives(tmp_path_factory):
    """(good archive bytes, its MD5, {name: file bytes}) with six full-size batch files, made once."""
    files = {name: full_size_batch(index) for index, name in enumerate(ALL_FILES)}
    good = make_archive(files, compresslevel=1)
    folder = tmp_path_factory.mktemp("archives")
    (folder / ARCHIVE_NAME).write_bytes(good)
    digests = {name: md5_of(content) for name, content in files.items()}
    return good, md5_of(good), digests


def train_args(tmp_path: Path, url: str, md5: str) -> List[str]:
    return ["--data_path", str(tmp_path / "data" / ARCHIVE_FOLDER), "--dataset_url", url, "--dataset_md5", md5,
            "--output_path", str(tmp_path / "out"), "--model_name", "resnet18", "--epoch_size", "1",
            "--batch_size", "8", "--train_num_samples", "16", "--eval_num_samples", "8", *FAST_ARGS]


@pytest.mark.slow
def test_train_downloads_missing_data_then_trains(server, tmp_path, full_size_archives):
    good, md5, digests = full_size_archives
    url = server.serve(good)

    process = run_script("train.py", train_args(tmp_path, url, md5), env={"no_proxy": "127.0.0.1,localhost"})

    assert process.returncode == 0, (process.stdout[-2000:], process.stderr[-3000:])
    assert server.requests == [f"/{ARCHIVE_NAME}"]
    data = tmp_path / "data" / ARCHIVE_FOLDER
    assert sorted(p.name for p in data.iterdir()) == sorted(ALL_FILES)
    for name in ALL_FILES:
        assert (data / name).stat().st_size == FILE_BYTES
        assert file_md5(data / name) == digests[name], name
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == sorted([ARCHIVE_FOLDER, ARCHIVE_NAME])
    metrics = (tmp_path / "out" / "metrics.csv").read_text().splitlines()
    assert len(metrics) >= 2  # header and the one epoch
    assert list((tmp_path / "out").glob("*.ckpt"))


@pytest.mark.slow
def test_train_with_corrupted_download_fails_in_one_line(server, tmp_path, full_size_archives):
    good, md5, _ = full_size_archives
    url = server.serve(flip_one_byte(good))

    process = run_script("train.py", train_args(tmp_path, url, md5), env={"no_proxy": "127.0.0.1,localhost"})

    line = assert_one_line_error(process, "MD5", url)
    assert md5 in line
    assert server.requests == [f"/{ARCHIVE_NAME}"]
    data_parent = tmp_path / "data"
    assert not (data_parent / ARCHIVE_FOLDER).exists()
    assert not data_parent.exists() or list(data_parent.iterdir()) == []  # no archive, temporary file or folder
    assert list(tmp_path.rglob("*.ckpt")) == []
    assert not (tmp_path / "out" / "metrics.csv").exists()
