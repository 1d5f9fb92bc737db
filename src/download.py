"""Downloading a file with a hash check: the CIFAR-10 archive (MD5) and pretrained weights (SHA-256).

The bytes stream into src.atomic_file's temporary name while they are hashed; the file gets its final name only
when it arrived whole and its digest matches, else it is removed and the failure is one UserError line.
"""
import hashlib
import http.client
import logging
import urllib.error
import urllib.request
from pathlib import Path

from src.atomic_file import atomic_write
from src.errors import UserError

CHUNK_BYTES = 1 << 20
ALGORITHM_NAMES = {"md5": "MD5", "sha256": "SHA-256"}


def shown_digest(expected: str, algorithm: str = "sha256") -> str:
    """expected as messages show it: a digest as is, a prefix of one marked as such."""
    full = hashlib.new(algorithm).digest_size * 2
    return expected if len(expected) == full else f"{expected}... (a prefix)"


def download(url: str, destination: Path, algorithm: str, expected: str, logger: logging.Logger,
             timeout: float = 60.0, *, allow_prefix: bool = False, fix_unreachable: str, expected_file: str,
             fix_mismatch: str) -> str:
    """Downloads url to destination, kept only if it arrived whole (as long as the server said) and its digest
    (hashlib's algorithm, e.g. 'md5', 'sha256') matches expected. Returns the hex digest.

    expected: the whole hex digest (any case); with allow_prefix, a prefix of it ('' keeps any file), as SHA-256
    pins are. The failure messages end with the caller's advice: fix_unreachable when the server cannot be
    reached or the file cannot be written; expected_file (what else the file may be: 'not the published one')
    and fix_mismatch when the digest differs. Raises UserError, leaving no file behind.
    """
    destination = Path(destination)
    expected_lower = expected.lower()
    label = ALGORITHM_NAMES.get(algorithm, algorithm)
    try:
        with atomic_write(destination) as temp:
            digest = hashlib.new(algorithm)
            with urllib.request.urlopen(url, timeout=timeout) as response, open(temp, "wb") as out:
                total = int(response.headers.get("Content-Length") or 0)
                done, next_report = 0, 0.1
                for chunk in iter(lambda: response.read(CHUNK_BYTES), b""):
                    out.write(chunk)
                    digest.update(chunk)
                    done += len(chunk)
                    if total and done / total >= next_report:
                        logger.info("downloaded %.0f%% of %s (%.1f MB)", 100 * done / total, url, total / 2 ** 20)
                        next_report += 0.1
            if total and done != total:
                raise UserError(f"download of {url} stopped after {done} of {total} bytes and was removed; try again")
            actual = digest.hexdigest()
            matches = actual.startswith(expected_lower) if allow_prefix else actual == expected_lower
            if not matches:
                shown = shown_digest(expected, algorithm) if allow_prefix else expected
                raise UserError(f"download of {url} has {label} {actual}, expected {shown}: the file is damaged or "
                                f"{expected_file} and was removed; {fix_mismatch}")
    except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", None) or str(exc) or type(exc).__name__
        raise UserError(f"could not download {url} to {destination}: {reason}; {fix_unreachable}") from None
    return actual
