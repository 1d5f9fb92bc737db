"""Writing a file atomically: the one way this project writes its outputs (checkpoints, converted weights,
exports, downloads, metrics.csv, JSON, plots).

    with atomic_write(path) as temp:
        anything_that_writes(temp)      # ms.save_checkpoint, torch.save, savefig, a download loop, ...

The block writes temp, a hidden name in path's folder (same file system, so the rename is atomic):
.partial-<PID>-<NAME>. It ends with the final name, so a library that reads the suffix (MindSpore's .ckpt and
.mindir checks, matplotlib's format) sees the final one, and the PID keeps processes (ranks) writing the same
name apart. When the block ends normally, the file is flushed to disk (fsync), given its permissions, renamed
onto path, and the folder is synced. When it raises (KeyboardInterrupt included), temp is removed and the
exception goes on: nothing half-written ever has the final name, and nothing is left behind.

Permissions: by default those a plain open() gives, 0o666 & ~umask. mode sets others, masked by the umask like
open()'s, or exactly as given with apply_umask=False; mode=None keeps what the writer made (a hard link keeps
its source's). This module imports nothing from the project.
"""
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional, Union

TEMP_PREFIX = ".partial-"  # every temporary file of the project starts with it: .partial-<PID>-<NAME>


def temp_path(path: Union[str, Path]) -> Path:
    """The temporary name this process writes path under: .partial-<PID>-<NAME> in path's folder."""
    final = Path(path)
    return final.with_name(f"{TEMP_PREFIX}{os.getpid()}-{final.name}")


def current_umask() -> int:
    """The process's umask. Reading it means setting it: for that instant it is 0o077, so a file another
    thread creates meanwhile is at most more private, never more open."""
    umask = os.umask(0o077)
    os.umask(umask)
    return umask


def _fsync_folder(folder: Path) -> None:
    """Makes the rename durable. Some file systems cannot sync a folder: the file is in place all the same."""
    try:
        handle = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(handle)
    except OSError:
        pass
    finally:
        os.close(handle)


@contextmanager
def atomic_write(path: Union[str, Path], mode: Optional[int] = 0o666, *, apply_umask: bool = True
                 ) -> Iterator[Path]:
    """Yields the temporary path to write; on a normal exit it becomes path (fsync, permissions, rename, folder
    fsync), on an exception it is removed. See the module's docstring for mode and apply_umask."""
    final = Path(path)
    temp = temp_path(final)
    temp.unlink(missing_ok=True)  # left by a killed process that had this PID
    try:
        yield temp
        with open(temp, "rb") as written:
            os.fsync(written.fileno())
        if mode is not None:
            os.chmod(temp, mode & ~current_umask() if apply_umask else mode)
        os.replace(temp, final)
        _fsync_folder(final.parent)
    finally:
        # After a failure; after the rename a no-op, except where temp was a hard link to final's file: then
        # the rename did nothing (POSIX) and this removes the extra name.
        temp.unlink(missing_ok=True)


def write_text_atomic(path: Union[str, Path], text: str, encoding: str = "utf-8") -> Path:
    """path.write_text(text), atomically."""
    with atomic_write(path) as temp:
        temp.write_text(text, encoding=encoding)
    return Path(path)
