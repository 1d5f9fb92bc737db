"""Reads a MindSpore .ckpt file record by record, in about the memory its tensors need.

MindSpore 2.10's load_checkpoint reads the whole file, then refuses it when it is larger than MemFree
(os.sysconf('SC_AVPHYS_PAGES')), which leaves out the page cache: on a machine that has run for a while it
calls a good checkpoint too large. A .ckpt is a run of protobuf records (one Checkpoint.Value each, written
one after the other, a tensor over 512 MB in several), then an optional 17-byte 'crc_num' trailer holding the
CRC-32 of everything before it. So this reader parses one record at a time into the tensors' final buffers,
checks the CRC as it goes, and needs only MemAvailable (free memory plus what the kernel can reclaim).

Three failures are told apart, each a UserError of one line: the file is damaged (CRC mismatch, cut off, a
record that does not parse after good ones), it is not a MindSpore checkpoint (its first record is not one),
or there is not enough memory (with the numbers).
"""
import binascii
import math
from pathlib import Path
from typing import Any, BinaryIO, Dict, Iterator, Optional, Tuple

import numpy as np
import mindspore as ms
from google.protobuf.message import DecodeError
from mindspore.train.checkpoint_pb2 import Checkpoint

from src.errors import UserError

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


def _parse_value(offset: int, body: bytes) -> Checkpoint.Value:
    value = Checkpoint.Value()
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

    def __init__(self, value: Checkpoint.Value, offset: int) -> None:
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
    entries: Dict[str, Any] = {}
    crc = 0
    entry: Optional[_Entry] = None
    for offset, header, body in _records(handle, end):
        crc = binascii.crc32(body, binascii.crc32(header, crc))
        value = _parse_value(offset, body)
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
