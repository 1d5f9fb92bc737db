"""Digests of files read in chunks (large archives and checkpoints never sit in memory whole)."""
import hashlib
from pathlib import Path

CHUNK_BYTES = 1 << 20


def file_digest(path: Path, algorithm: str) -> str:
    """Hex digest of path's bytes with hashlib's algorithm ('md5', 'sha256', ...)."""
    digest = hashlib.new(algorithm)
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(CHUNK_BYTES), b""):
            digest.update(chunk)
    return digest.hexdigest()
