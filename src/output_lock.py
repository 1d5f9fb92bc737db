"""One training run per output folder: train.py holds an exclusive lock on OUTPUT_PATH/.train.lock for as long as
it runs, and a second train.py on the same folder is refused in one line before it writes anything there (its
train.log included).

The lock is fcntl.flock on the file: the kernel releases it when its holder ends in any way (kill -9 included),
so a crashed run never blocks the next one. The file holds the holder's PID, for the refusal message only. Under a
launcher only rank 0, the rank that writes the outputs, takes it; the other ranks and msrun's scheduler share the
folder with it. This module imports nothing from the project but src.errors.
"""
import fcntl
import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, List, Optional, Union

from src.errors import UserError

LOCK_NAME = ".train.lock"


def lock_holder(path: Path) -> Optional[int]:
    """The PID written in the lock file, None when it holds none (or cannot be read)."""
    try:
        text = path.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return int(text) if text.isdigit() else None


def _open_locked(path: Path) -> Optional[int]:
    """A descriptor of path holding its exclusive flock, or None where the file system cannot lock. Raises
    BlockingIOError while another process holds it."""
    while True:
        handle = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(handle)
            raise
        except OSError:  # ENOLCK, EOPNOTSUPP: a file system without flock (some network mounts)
            os.close(handle)
            return None
        # The holder before us removes the file as it releases: if it did so between our open and our flock, we
        # hold a lock on a name that no longer exists, and a third process could lock a new file. Start over.
        try:
            if os.stat(path).st_ino == os.fstat(handle).st_ino:
                return handle
        except FileNotFoundError:
            pass
        os.close(handle)


@contextmanager
def output_folder_lock(output_path: Union[str, Path], rank: int = 0, script: str = "train.py") -> Iterator[None]:
    """Holds output_path's lock for the block (rank 0 only; other ranks pass through).

    Raises UserError, naming the folder and the running process's PID, when another process holds it, and when
    the folder cannot be written. Creates the folder. Where the file system cannot lock, prints a warning and runs unlocked.
    """
    if rank != 0:
        yield
        return
    folder = Path(output_path)
    path = folder / LOCK_NAME
    try:
        folder.mkdir(parents=True, exist_ok=True)
        handle = _open_locked(path)
    except BlockingIOError:
        holder = lock_holder(path)
        who = f"PID {holder}" if holder is not None else "a process whose PID is not known yet"
        raise UserError(f"output folder {folder} is in use by another {script} ({who}): wait for it to finish, "
                        "or pass another --output_path") from None
    except OSError as exc:  # the first write to output_path: not a folder, read-only, no permission
        raise UserError(f"cannot write in output folder {folder} ({exc.strerror or exc}): pass another "
                        "--output_path, or make it writable") from None
    if handle is None:
        print(f"warning: cannot lock {path} on this file system: a second {script} on {folder} would not be "
              "refused", file=sys.stderr, flush=True)
        yield
        return
    try:
        try:
            os.ftruncate(handle, 0)
            os.write(handle, f"{os.getpid()}\n".encode("ascii"))
        except OSError:  # a full disk: the PID is for the message only, the lock holds without it
            pass
        yield
    finally:
        # Removed while still locked, so that no one can lock this file after we let go (see _open_locked).
        try:
            os.unlink(path)
        except OSError:
            pass
        os.close(handle)


def main(argv: Optional[List[str]] = None) -> int:
    """python -m src.output_lock OUTPUT_PATH: exits 2 with the refusal line while a train.py runs on OUTPUT_PATH.

    For the distributed launcher, which writes msrun's logs into OUTPUT_PATH/msrun_log (msrun truncates them)
    before its rank 0 takes the lock: a running job's logs are not overwritten.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        raise UserError("usage: python -m src.output_lock OUTPUT_PATH")
    with output_folder_lock(args[0]):
        pass
    return 0


if __name__ == "__main__":
    from src.errors import run_cli
    run_cli(main)
