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
its source's).

A full disk (ENOSPC), a full quota (EDQUOT) or the file-size limit (EFBIG, ulimit -f) while the block writes, or
while the file is flushed, ends as DiskFullError: a UserError of one line naming the file, its folder and what to
do, with the temporary file removed and the previous file under the final name untouched. It is recognised in the
exception's chain too, as libraries wrap it (torch.save raises a RuntimeError whose context is the OSError). This
is the one place the project translates those errors. This module imports nothing from the project but
src.errors.
"""
import errno
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional, Union

from src.errors import UserError

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


DISK_FULL_ERRNOS = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded",
                    errno.EFBIG: "file too large"}


def disk_full_cause(exc: BaseException) -> Optional[OSError]:
    """The ENOSPC, EDQUOT or EFBIG OSError behind exc (exc itself, or its __cause__/__context__ chain), else None."""
    seen = set()
    link: Optional[BaseException] = exc
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        if isinstance(link, OSError) and link.errno in DISK_FULL_ERRNOS:
            return link
        link = link.__cause__ or link.__context__
    return None


def _file_size_limit() -> Optional[int]:
    """This process's RLIMIT_FSIZE in bytes (ulimit -f), None when unlimited or unknown."""
    try:
        import resource
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    except (ImportError, OSError, ValueError):
        return None
    return None if limit == resource.RLIM_INFINITY else limit


def _megabytes(size: int) -> str:
    return f"{size / 2 ** 20:.1f} MB"


class DiskFullError(UserError):
    """A write that failed for want of space (ENOSPC, EDQUOT) or on the file-size limit (EFBIG).

    The message is '{problem}: {fix} and {then_what}': problem names the file and folder and the space left or
    the limit; then_what is the step after the fix ('run again' by default; train.py names the checkpoint to
    resume from).
    """

    def __init__(self, path: Path, cause: OSError, then_what: str = "run again") -> None:
        self.path, self.cause, self.then_what = Path(path), cause, then_what
        folder = self.path.parent
        if cause.errno == errno.EFBIG:
            limit = _file_size_limit()
            detail = (f"the file-size limit (ulimit -f) is {_megabytes(limit)}" if limit is not None
                      else "larger than the file system allows")
            self.fix = "raise the limit (ulimit -f unlimited) or write to another file system"
        else:
            try:
                detail = f"{_megabytes(shutil.disk_usage(folder).free)} free there now"
            except OSError:
                detail = cause.strerror or "no space"
            self.fix = "free space there"
        self.problem = f"{DISK_FULL_ERRNOS[cause.errno]} writing {self.path.name} in {folder} ({detail})"
        super().__init__(f"{self.problem}: {self.fix} and {then_what}")

    def with_then_what(self, then_what: str) -> "DiskFullError":
        """The same error with another step after the fix."""
        return DiskFullError(self.path, self.cause, then_what)


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
        try:
            yield temp
            with open(temp, "rb") as written:
                os.fsync(written.fileno())  # a file system that allocates late reports ENOSPC here
            if mode is not None:
                os.chmod(temp, mode & ~current_umask() if apply_umask else mode)
            os.replace(temp, final)
        except Exception as exc:
            cause = None if isinstance(exc, UserError) else disk_full_cause(exc)
            if cause is None:
                raise
            temp.unlink(missing_ok=True)  # before the message measures the free space
            raise DiskFullError(final, cause) from exc
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
