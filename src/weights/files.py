"""Weight files: reading and writing this project's .ckpt and PyTorch .pth files, and SHA-256 pins.

Writes are atomic (src.atomic_file): a file is written under a temporary name and renamed into place, so a
crash never leaves a half-written file under the final name; .ckpt files carry a CRC so that damage is detected
on read. Every failure a user can cause (missing, empty, damaged or foreign file, too little memory, a SHA-256
that does not match) is a UserError of one line.

.ckpt files are read record by record (read_ckpt), in about the memory their tensors need. MindSpore 2.10's
load_checkpoint reads the whole file, then refuses it when it is larger than MemFree
(os.sysconf('SC_AVPHYS_PAGES')), which leaves out the page cache: on a machine that has run for a while it
calls a good checkpoint too large. A .ckpt is a run of protobuf records (one Checkpoint.Value each, written
one after the other, a tensor over 512 MB in several), then an optional 17-byte 'crc_num' trailer holding the
CRC-32 of everything before it. So this reader parses one record at a time into the tensors' final buffers,
checks the CRC as it goes, and needs only MemAvailable (free memory plus what the kernel can reclaim). Three
failures are told apart: the file is damaged (CRC mismatch, cut off, a record that does not parse after good
ones), it is not a MindSpore checkpoint (its first record is not one), or there is not enough memory (with the
numbers).

.pth files are read with torch.load(weights_only=True), so nothing in them is executed; a bare state_dict or
one wrapped in {'state_dict': ...} / {'model': ...}, with DataParallel/DDP 'module.' prefixes removed.

MindSpore and torch are imported inside the functions that use them: convert_pth.py imports this module and
refuses bad options without waiting for either framework to load.
"""
import binascii
import logging
import math
import os
import re
import shutil
import warnings
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Callable, Dict, Iterator, List, Mapping, Optional, Tuple

import numpy as np
from google.protobuf.message import DecodeError

from src.atomic_file import atomic_write
from src.errors import UserError
from src.file_hash import file_digest

# ------------------------------------------------------------------------------------------------ writing

CHECKPOINT_MODE = 0o400  # MindSpore makes the checkpoints it saves owner-read-only, whatever the umask


def save_checkpoint_atomic(source: Any, path: str, append_dict: Optional[Dict[str, Any]] = None,
                           check: Optional[Callable[[Path], None]] = None) -> Path:
    """Saves source (a Cell or a list of {'name', 'data'}) to path (a .ckpt) atomically (src.atomic_file), read-only
    (0400) as MindSpore leaves it; check, when given, runs on the written file before the rename.

    The file carries a CRC so that damage is detected on load.
    """
    import mindspore as ms
    final = Path(path)
    if final.suffix != ".ckpt":
        raise ValueError(f"{final}: a checkpoint's name must end in .ckpt (MindSpore would add it)")
    final.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(final, CHECKPOINT_MODE, apply_umask=False) as temp:
        try:
            with _mindspore_save_failure_unlogged():
                ms.save_checkpoint(source, str(temp), append_dict=append_dict, crc_check=True)
        finally:
            temp.with_suffix(".tmp").unlink(missing_ok=True)  # MindSpore's own temporary name, after a failure
        if check is not None:
            check(temp)
    return final


class _DropSaveFailure(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Failed to save the checkpoint file")


@contextmanager
def _mindspore_save_failure_unlogged() -> Iterator[None]:
    """Keeps MindSpore from logging its own CRITICAL 'Failed to save the checkpoint file ... Maybe don't have the
    permission ... or the disk space is insufficient' line: save_checkpoint re-raises the exception, which ends as
    one precise error line (src.atomic_file) or a traceback. MindSpore's logger is private (mindspore.log), so
    where it is not found the line is simply printed."""
    try:
        from mindspore.log import _get_logger
        ms_logger = _get_logger()
    except (ImportError, AttributeError):
        yield
        return
    dropped = _DropSaveFailure()
    ms_logger.addFilter(dropped)
    try:
        yield
    finally:
        ms_logger.removeFilter(dropped)


def link_or_copy_atomic(source: Path, destination: Path) -> None:
    """Makes destination a copy of source (a hard link where possible), replacing it in one rename. The
    permissions are those of the link (source's) or of the copy (as a plain open() gives)."""
    with atomic_write(destination, mode=None) as temp:
        try:
            os.link(source, temp)
        except OSError:
            shutil.copyfile(source, temp)


def save_torch_state_dict_atomic(weights: Mapping[str, np.ndarray], path: str,
                                 check: Optional[Callable[[Path], None]] = None) -> Path:
    """torch.save of the arrays as tensors to path atomically (src.atomic_file), with a plain open()'s
    permissions; check, when given, runs on the written file before the rename."""
    import torch
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    state = {name: torch.from_numpy(np.array(value)) for name, value in weights.items()}  # owned, writable copies
    with atomic_write(final) as temp:
        with open(temp, "wb") as out:
            torch.save(state, out)
        if check is not None:
            check(temp)
    return final


# ------------------------------------------------------------------------------------------------ SHA-256 pins

_HEX_DIGEST = re.compile(r"^[0-9a-f]{8,64}$")


def normalise_sha256(expected: str, key: str = "checkpoint_sha256") -> str:
    """expected in lower case ('' when unset); UserError unless it is 8 to 64 hex digits."""
    text = (expected or "").strip().lower()
    if text and not _HEX_DIGEST.match(text):
        raise UserError(f"config key '{key}' must be a SHA-256 or a prefix of one (8 to 64 hex digits), got "
                        f"{expected!r}")
    return text


def file_sha256(path: Path) -> str:
    return file_digest(path, "sha256")


def verify_sha256(path: Path, expected: str, fix: str = "use the pinned file or correct --checkpoint_sha256") -> str:
    """Checks that path's SHA-256 starts with expected (a full digest or a prefix); returns the digest, '' when
    expected is empty. Raises UserError naming the file, both digests and fix."""
    expected = normalise_sha256(expected)
    if not expected:
        return ""
    digest = file_sha256(Path(path))
    if not digest.startswith(expected):
        shown = expected if len(expected) == 64 else f"{expected}... (a prefix)"
        raise UserError(f"{path} has SHA-256 {digest}, expected {shown}: it is damaged or not the pinned file; {fix}")
    return digest


# ------------------------------------------------------------------------------------------------ reading

def check_file_given(path: str) -> Path:
    file = Path(path)
    if not path:
        raise UserError("no checkpoint given: pass --checkpoint_path FILE.ckpt")
    if not file.is_file():
        raise UserError(f"checkpoint {file} does not exist")
    return file


TORCH_SUFFIXES = (".pth", ".pt", ".tar", ".bin")


def is_torch_file(path: Path) -> bool:
    """A PyTorch file, by its first bytes (torch.save's zip archive or a legacy pickle) or its suffix."""
    with open(path, "rb") as handle:
        head = handle.read(4)
    return head == b"PK\x03\x04" or head[:1] == b"\x80" or Path(path).suffix.lower() in TORCH_SUFFIXES


def read_checkpoint(path: str, sha256: str = "") -> Dict[str, Any]:
    """All entries of a MindSpore checkpoint (Parameters and appended values). Raises UserError.

    sha256: when set, the file's SHA-256 must start with it (checked before the file is parsed).
    """
    file = check_file_given(path)
    if file.stat().st_size == 0:
        raise UserError(f"checkpoint {file} is empty (0 bytes): the write was interrupted; use another checkpoint")
    verify_sha256(file, sha256)
    entries = read_ckpt(file)  # not ms.load_checkpoint: it refuses files larger than MemFree (see read_ckpt)
    if not entries:
        raise UserError(f"checkpoint {file} holds no parameters; use a .ckpt written by train.py")
    return entries


# ------------------------------------------------------------------------------------------ .ckpt records

CRC_MARKER = b"crc_num"
CRC_TRAILER_SIZE = len(CRC_MARKER) + 10  # the marker, then the CRC-32 as 10 big-endian bytes
VALUE_FIELD_KEY = 0x0A  # Checkpoint.value: field 1, length-delimited
MB = 1024 * 1024
FIX = "use another copy, or a .ckpt written by train.py, convert_pth.py, the models zoo or mindcv"
NOT_THE_FILE = "close other programs or use a machine with more memory (the file itself is not at fault)"

_NUMPY_TYPES = {"Int8": np.int8, "UInt8": np.uint8, "Int16": np.int16, "UInt16": np.uint16, "Int32": np.int32,
                "UInt32": np.uint32, "Int64": np.int64, "UInt64": np.uint64, "Float16": np.float16,
                "Float32": np.float32, "Float64": np.float64, "Bool": np.bool_,
                "BFloat16": np.uint16,  # numpy has no bfloat16: read as bits, widened to float32 (exact)
                "str": np.uint8}  # UTF-32 text


class _Malformed(Exception):
    """Bytes that are not what a .ckpt holds at that offset."""

    def __init__(self, offset: int, reason: str) -> None:
        super().__init__(f"{reason} at byte {offset}")
        self.offset = offset


def available_memory() -> Optional[int]:
    """MemAvailable from /proc/meminfo in bytes (free memory plus reclaimable cache), None where unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _read_varint(handle: BinaryIO, offset: int) -> Tuple[int, bytes]:
    raw = bytearray()
    while True:
        byte = handle.read(1)
        if not byte:
            raise _Malformed(offset, "the file ends inside a record header")
        raw += byte
        if not byte[0] & 0x80:
            break
        if len(raw) > 9:
            raise _Malformed(offset, "a record length that is not a number")
    return sum((part & 0x7F) << (7 * shift) for shift, part in enumerate(raw)), bytes(raw)


def _records(handle: BinaryIO, end: int) -> Iterator[Tuple[int, bytes, bytes]]:
    """(offset, header bytes, body bytes) of each top-level Checkpoint.Value record before end."""
    offset = 0
    while offset < end:
        key = handle.read(1)
        if key[0] != VALUE_FIELD_KEY:
            raise _Malformed(offset, f"an unexpected byte 0x{key[0]:02x} where a record starts")
        length, varint = _read_varint(handle, offset)
        header = key + varint
        body_start = offset + len(header)
        if body_start + length > end:
            raise _Malformed(offset, f"a record of {length} bytes that runs past the end of the data ({end} bytes)")
        body = handle.read(length)
        yield offset, header, body
        del body  # one record in memory at a time
        offset = body_start + length


def _parse_value(offset: int, body: bytes, value_type: type) -> Any:
    """body as a Checkpoint.Value (value_type: MindSpore's protobuf class of it)."""
    value = value_type()
    try:
        value.ParseFromString(body)
    except (DecodeError, RuntimeError, ValueError) as exc:
        raise _Malformed(offset, f"a record that does not parse ({exc})") from None
    if not value.HasField("tensor"):
        raise _Malformed(offset, f"a record '{value.tag}' that holds no tensor (a MapTensor is not read here)")
    return value


class _Entry:
    """One checkpoint entry, filled from one record or from several consecutive ones with its name (slices),
    straight into its final buffer."""

    def __init__(self, value: Any, offset: int) -> None:
        self.name, self.offset, self.tensor_type = value.tag, offset, value.tensor.tensor_type
        if self.tensor_type not in _NUMPY_TYPES:
            raise _Malformed(offset, f"entry '{self.name}' of unknown type '{self.tensor_type}'")
        self.dtype = np.dtype(_NUMPY_TYPES[self.tensor_type])
        dims, content = list(value.tensor.dims), value.tensor.tensor_content
        if self.tensor_type == "str":
            self.shape = [len(content)]
        else:  # MindSpore writes a scalar's shape as [0]; an empty tensor has that shape and no data
            self.shape = [] if dims == [0] and content else dims
        self.buffer = np.empty(math.prod(self.shape) * self.dtype.itemsize, np.uint8)
        self.filled = 0

    def add(self, content: bytes, offset: int) -> None:
        end = self.filled + len(content)
        if end > self.buffer.size:
            raise _Malformed(offset, f"entry '{self.name}' with more data than its shape {self.shape} holds")
        self.buffer[self.filled:end] = np.frombuffer(content, np.uint8)
        self.filled = end

    def finish(self) -> Any:
        """The Parameter (or str) that mindspore.load_checkpoint gives for this entry."""
        if self.filled != self.buffer.size:
            raise _Malformed(self.offset, f"entry '{self.name}' with {self.filled} bytes of data for shape "
                                          f"{self.shape} ({self.buffer.size} bytes)")
        if self.tensor_type == "str":
            return str(self.buffer.view(f"U{self.buffer.size // 4}")[0]) if self.buffer.size else ""
        array = self.buffer.view(self.dtype).reshape(self.shape)
        if self.tensor_type == "BFloat16":
            array = (array.astype(np.uint32) << 16).view(np.float32)
        import mindspore as ms
        return ms.Parameter(ms.Tensor.from_numpy(array), name=self.name)


def _crc_trailer(handle: BinaryIO, size: int) -> Optional[int]:
    """The CRC-32 the file's trailer records, None for a file written without one."""
    if size < CRC_TRAILER_SIZE:
        return None
    handle.seek(size - CRC_TRAILER_SIZE)
    trailer = handle.read(CRC_TRAILER_SIZE)
    handle.seek(0)
    if trailer[:len(CRC_MARKER)] != CRC_MARKER:
        return None
    return int.from_bytes(trailer[len(CRC_MARKER):], "big")


def _read_entries(handle: BinaryIO, end: int) -> Tuple[Dict[str, Any], int]:
    """(entries, the CRC-32 of the bytes before end)."""
    from mindspore.train.checkpoint_pb2 import Checkpoint
    entries: Dict[str, Any] = {}
    crc = 0
    entry: Optional[_Entry] = None
    for offset, header, body in _records(handle, end):
        crc = binascii.crc32(body, binascii.crc32(header, crc))
        value = _parse_value(offset, body, Checkpoint.Value)
        if entry is None or entry.name != value.tag:
            if entry is not None:
                entries[entry.name] = entry.finish()
            entry = _Entry(value, offset)
        entry.add(value.tensor.tensor_content, offset)
    if entry is not None:
        entries[entry.name] = entry.finish()
    return entries, crc


def read_ckpt(path: Path) -> Dict[str, Any]:
    """Every entry of a MindSpore .ckpt (name -> Parameter, or str for appended strings), as
    mindspore.load_checkpoint gives them, checked against the file's CRC when it has one. Raises UserError."""
    size = path.stat().st_size
    available = available_memory()
    if available is not None and size > available:
        raise UserError(f"not enough memory to read checkpoint {path}: it holds {size / MB:.0f} MB and only "
                        f"{available / MB:.0f} MB is available (MemAvailable); {NOT_THE_FILE}")
    with open(path, "rb") as handle:
        expected_crc = _crc_trailer(handle, size)
        end = size - CRC_TRAILER_SIZE if expected_crc is not None else size
        try:
            entries, crc = _read_entries(handle, end)
        except MemoryError:
            available = available_memory()
            shown = f"{available / MB:.0f} MB" if available is not None else "an unknown amount"
            raise UserError(f"not enough memory to read checkpoint {path} ({size / MB:.0f} MB): an allocation "
                            f"failed with {shown} available; {NOT_THE_FILE}") from None
        except _Malformed as exc:
            if exc.offset == 0 and expected_crc is None:
                raise UserError(f"{path} is not a MindSpore checkpoint (found {exc}); {FIX}") from None
            raise UserError(f"checkpoint {path} is damaged: {exc} of {size} (cut off or overwritten); {FIX}") from None
    if expected_crc is not None and expected_crc != crc:
        raise UserError(f"checkpoint {path} is damaged: its data does not match the CRC-32 it was saved with; {FIX}")
    return entries


# ------------------------------------------------------------------------------------------------- .pth

WRAPPER_KEYS = ("state_dict", "model", "model_state_dict", "net")


@dataclass
class TorchStateDict:
    """The tensors of a .pth by torch name ('module.' removed), and what was done to get them."""
    arrays: Dict[str, np.ndarray]
    notes: List[str] = field(default_factory=list)


def _tensor_to_numpy(name: str, value: Any, path: str) -> np.ndarray:
    tensor = value.detach().cpu()
    if str(tensor.dtype) == "torch.bfloat16":  # numpy has no bfloat16; float32 holds every bfloat16 exactly
        tensor = tensor.float()
    try:
        return tensor.numpy()
    except (TypeError, RuntimeError) as exc:  # quantized, sparse or other layouts numpy cannot take
        raise UserError(f"{path}: tensor {name} ({tensor.dtype}, {tensor.layout}) cannot be converted "
                        f"({' '.join(str(exc).split())[:120]}); save a plain float state_dict") from None


def _unwrap(loaded: object, path: str) -> TorchStateDict:
    """The tensors of a loaded .pth: a bare state_dict or one wrapped in {'state_dict': ...} / {'model': ...},
    with DataParallel/DDP 'module.' prefixes removed. Raises UserError for anything else."""
    state, notes = loaded, []
    for _ in range(2):  # e.g. {'model': {'state_dict': ...}}
        if isinstance(state, Mapping):
            key = next((key for key in WRAPPER_KEYS if isinstance(state.get(key), Mapping)), None)
            if key is not None:
                others = [str(other) for other in state if other != key]
                notes.append(f"took the weights from the '{key}' entry" +
                             (f" (ignored: {', '.join(others[:6])}{', ...' if len(others) > 6 else ''})"
                              if others else ""))
                state = state[key]
    if not isinstance(state, Mapping) or not state:
        raise UserError(f"{path} holds no state_dict (a mapping of parameter names to tensors); save one with "
                        "torch.save(model.state_dict(), path)")
    arrays: Dict[str, np.ndarray] = {}
    skipped, prefixed, widened = [], 0, 0
    for key, value in state.items():
        if not hasattr(value, "detach"):
            skipped.append(str(key))  # e.g. an epoch number or optimizer settings next to the weights
            continue
        widened += str(getattr(value, "dtype", "")) == "torch.bfloat16"
        name = str(key)
        if name.startswith("module."):  # DataParallel / DistributedDataParallel
            name, prefixed = name[len("module."):], prefixed + 1
        if name in arrays:
            raise UserError(f"{path} holds {name} twice (with and without the 'module.' prefix); save the "
                            "state_dict of one model")
        arrays[name] = _tensor_to_numpy(name, value, path)
    if not arrays:
        raise UserError(f"{path} holds no tensors; save one with torch.save(model.state_dict(), path)")
    if prefixed:
        notes.append(f"removed the DataParallel/DDP prefix 'module.' from {prefixed} names")
    if widened:
        notes.append(f"converted {widened} bfloat16 tensors to float32 (exact; numpy has no bfloat16)")
    if skipped:
        notes.append(f"ignored {len(skipped)} entries that are not tensors: {', '.join(skipped[:6])}")
    return TorchStateDict(arrays, notes)


def _damaged_zip_member(path: str) -> Optional[str]:
    """The first member of a zip-format .pth whose CRC does not match, else None.

    torch.load does not check the CRCs, so bytes overwritten inside a tensor would load silently.
    """
    try:
        with zipfile.ZipFile(path) as archive:
            return archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError, NotImplementedError):
        return "(the archive's directory)"


def load_torch_state_dict(path: str) -> TorchStateDict:
    """Reads a PyTorch .pth with torch.load(weights_only=True): nothing in the file is executed.

    Raises UserError for a missing file, a file that needs arbitrary unpickling, or a damaged one.
    """
    try:
        import torch
    except ImportError:
        raise UserError(f"reading {path} needs PyTorch: pip install torch (requirements-dev.txt)") from None
    if not Path(path).is_file():
        raise UserError(f"PyTorch checkpoint {path} does not exist" +
                        (" (it is a folder)" if Path(path).is_dir() else "") + "; check --pth_path")
    if Path(path).stat().st_size == 0:
        raise UserError(f"PyTorch checkpoint {path} is empty (0 bytes): the write was interrupted; use another copy")
    if zipfile.is_zipfile(path):
        member = _damaged_zip_member(path)
        if member is not None:
            raise UserError(f"{path} is damaged: {member} does not match its CRC; use another copy")
    try:
        with warnings.catch_warnings():  # e.g. "Detected pickle protocol 4": noise on the way to an error line
            warnings.simplefilter("ignore")
            loaded = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - torch raises UnpicklingError, RuntimeError, EOFError, KeyError ...
        text = " ".join(str(exc).split())
        if re.search(r"unsupported global", text, re.IGNORECASE):
            # The weights-only unpickler met a reference to a Python class or function: loading it would
            # run code from the file. Name what it asked for, never import it.
            found = re.search(r"GLOBAL\s+([\w.]+)", text)
            what = f" (it references {found.group(1)})" if found else ""
            raise UserError(f"{path} needs arbitrary code to unpickle{what}: it stores Python objects, not only "
                            "tensors, and was not loaded; if you trust it, re-save it with "
                            "torch.save(model.state_dict(), path)") from None
        raise UserError(f"{path} is damaged or not a PyTorch checkpoint ({type(exc).__name__}); use another "
                        "copy of a file written by torch.save") from None
    return _unwrap(loaded, path)
