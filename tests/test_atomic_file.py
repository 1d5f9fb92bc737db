"""src.atomic_file on real files: the final name appears only complete and with its permissions, a failure
(KeyboardInterrupt included) keeps the previous file and leaves nothing behind, and two processes writing the
same name do not collide."""
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, temp_files
from src.atomic_file import TEMP_PREFIX, atomic_write, current_umask, temp_path, write_text_atomic


def mode_of(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def umask_027():
    """The process's umask set to 0o027 for the test (a value that masks something in every class)."""
    previous = os.umask(0o027)
    yield 0o027
    os.umask(previous)


def test_the_temporary_name_is_hidden_per_process_and_ends_with_the_final_name(tmp_path):
    temp = temp_path(tmp_path / "resnet18-last.ckpt")
    assert temp == tmp_path / f"{TEMP_PREFIX}{os.getpid()}-resnet18-last.ckpt"
    assert temp.name.startswith(".") and temp.suffix == ".ckpt"


def test_a_write_gets_the_final_name_with_a_plain_opens_permissions(tmp_path, umask_027):
    final = tmp_path / "metrics.csv"
    with atomic_write(final) as temp:
        assert temp.parent == tmp_path and temp != final
        temp.write_text("epoch\n1\n")
        assert not final.exists()  # nothing under the final name before the block ends
    assert final.read_text() == "epoch\n1\n"
    assert mode_of(final) == 0o666 & ~0o027 == 0o640
    plain = tmp_path / "plain.txt"
    plain.write_text("x")
    assert mode_of(final) == mode_of(plain)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.csv", "plain.txt"]


@pytest.mark.parametrize("mode, apply_umask, expected", [(0o444, True, 0o440), (0o400, False, 0o400),
                                                         (0o644, False, 0o644)])
def test_requested_permissions(tmp_path, umask_027, mode, apply_umask, expected):
    final = tmp_path / "model.mindir"
    with atomic_write(final, mode, apply_umask=apply_umask) as temp:
        temp.write_bytes(b"graph")
        os.chmod(temp, 0o600)  # as a library might leave it
    assert mode_of(final) == expected and final.read_bytes() == b"graph"
    assert temp_files(tmp_path) == []


def test_mode_none_keeps_the_writers_permissions(tmp_path):
    final = tmp_path / "copy.bin"
    with atomic_write(final, mode=None) as temp:
        temp.write_bytes(b"data")
        os.chmod(temp, 0o604)
    assert mode_of(final) == 0o604


def test_a_read_only_final_file_is_replaced(tmp_path):
    final = tmp_path / "model.ckpt"
    with atomic_write(final, 0o400, apply_umask=False) as temp:
        temp.write_bytes(b"first")
    with atomic_write(final, 0o400, apply_umask=False) as temp:
        temp.write_bytes(b"second")
    assert final.read_bytes() == b"second" and mode_of(final) == 0o400


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_an_exception_keeps_the_previous_file_and_leaves_nothing(tmp_path, error):
    final = tmp_path / "eval_result.json"
    write_text_atomic(final, '{"top1": 0.5}\n')
    with pytest.raises(error):
        with atomic_write(final) as temp:
            temp.write_text('{"top1": 0.')  # half a file, then the failure
            raise error("stop")
    assert final.read_text() == '{"top1": 0.5}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eval_result.json"]


def test_an_exception_before_anything_was_written_creates_nothing(tmp_path):
    with pytest.raises(ValueError):
        with atomic_write(tmp_path / "never.png"):
            raise ValueError("no figure")
    assert list(tmp_path.iterdir()) == []


def test_a_block_that_writes_nothing_fails_and_creates_nothing(tmp_path):
    with pytest.raises(FileNotFoundError):
        with atomic_write(tmp_path / "empty.txt"):
            pass
    assert list(tmp_path.iterdir()) == []


def test_a_leftover_of_a_killed_process_with_this_pid_is_replaced(tmp_path):
    final = tmp_path / "weights.pth"
    stale = temp_path(final)
    stale.write_bytes(b"half of an old write")
    stale.chmod(0o400)
    with atomic_write(final) as temp:
        assert not temp.exists()
        temp.write_bytes(b"new")
    assert final.read_bytes() == b"new" and temp_files(tmp_path) == []


def test_a_hard_link_onto_a_link_of_the_same_file_leaves_no_temporary_name(tmp_path):
    source, final = tmp_path / "epoch001.ckpt", tmp_path / "last.ckpt"
    source.write_bytes(b"weights")
    for _ in range(2):  # the second time, final is already a link to source: the rename itself does nothing
        with atomic_write(final, mode=None) as temp:
            os.link(source, temp)
    assert final.read_bytes() == b"weights" and final.stat().st_ino == source.stat().st_ino
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch001.ckpt", "last.ckpt"]


def test_current_umask_reads_without_changing_it(umask_027):
    assert current_umask() == 0o027
    assert current_umask() == 0o027


# Each writer writes half its content, waits until the other has too (both are then inside the block, on their
# temporary names), writes the rest and finishes.
WRITER = """
import os, sys, time
from pathlib import Path
from src.atomic_file import atomic_write
final, me, other = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
content = (me * 100_000).encode()
with atomic_write(final) as temp:
    with open(temp, "wb") as out:
        out.write(content[: len(content) // 2])
        out.flush()
        (final.parent / f"ready-{me}").write_text(str(temp))
        deadline = time.monotonic() + 60
        while not (final.parent / f"ready-{other}").exists():
            if time.monotonic() > deadline:
                sys.exit("the other writer never got ready")
            time.sleep(0.01)
        out.write(content[len(content) // 2:])
"""


def test_two_processes_writing_the_same_name_do_not_collide(tmp_path):
    folder = tmp_path / "out"
    folder.mkdir()
    final = folder / "metrics.csv"
    writers = [subprocess.Popen([sys.executable, "-c", WRITER, str(final), me, other], cwd=REPO)
               for me, other in (("a", "b"), ("b", "a"))]
    codes = [writer.wait(timeout=120) for writer in writers]
    assert codes == [0, 0]
    temps = {(folder / f"ready-{me}").read_text() for me in "ab"}
    assert len(temps) == 2  # each process wrote its own temporary file
    assert final.read_bytes() in (b"a" * 100_000, b"b" * 100_000)  # one whole file, not a mix
    assert sorted(p.name for p in folder.iterdir()) == ["metrics.csv", "ready-a", "ready-b"]


def test_write_text_atomic(tmp_path):
    final = tmp_path / "benchmark.json"
    assert write_text_atomic(final, "{}\n") == final
    assert final.read_text(encoding="utf-8") == "{}\n"
    assert temp_files(tmp_path) == []
