"""This process's resident memory (Linux): its peak since a reset, and handing freed heap back to the system."""
import ctypes
from pathlib import Path
from typing import Optional


def reset_peak_memory() -> bool:
    """Resets this process's peak resident memory (VmHWM) to its current resident memory (Linux's clear_refs 5);
    False where that can't be done."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def peak_memory_bytes() -> Optional[int]:
    """This process's peak resident memory (VmHWM) since it started or since reset_peak_memory; None off Linux."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def return_freed_heap() -> bool:
    """Hands the heap pages this process has freed back to the system (glibc's malloc_trim); False where the C
    library has no such call.

    Why: compiling a MindSpore graph frees some 30 MB of heap (ResNet-50's training step at 32x32) that glibc keeps
    resident otherwise, for the whole run. The steps allocate from MindSpore's memory pool, so it stays returned."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes = [ctypes.c_size_t]
    trim(0)
    return True
