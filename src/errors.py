"""The one exception type for failures a user can cause and fix (bad data, checkpoint, config, device),
the wrapper that turns it into one line and an exit code, and the scripts' argument parser that does the
same for usage errors."""
import argparse
import gc
import sys
from typing import Callable


class UserError(Exception):
    """A failure the user can fix: the message is one line naming the file or key and what to do.

    Top-level scripts print it as a single line and exit non-zero instead of showing a traceback.
    """


def run_cli(main: Callable[[], int]) -> None:
    """Runs a script's main(); a UserError becomes one 'error: ...' line on stderr and exit code 2,
    Ctrl-C outside the training loop (which saves a checkpoint first) the line 'interrupted' and 130. The objects
    alive when main() ends are left out of the interpreter's last garbage collection."""
    try:
        code = main()
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        code = 2
    except KeyboardInterrupt:  # before training started there is nothing to save
        print("interrupted", file=sys.stderr, flush=True)
        code = 130
    # main() has closed its files and released its lock. Python's last garbage collection at exit would walk every
    # object MindSpore built (about 1.9 s of a small train.py's exit, docs/testing.md); frozen, they are left to
    # the process's end. atexit handlers (MindSpore's, logging's) still run after this.
    gc.freeze()
    sys.exit(code or 0)


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse's usage errors as a UserError: one 'error: ...' line and exit code 2 (via run_cli)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UserError(f"{message} (see python {self.prog} --help)")
