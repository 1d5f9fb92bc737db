"""Where the built convolution library is, or why it was not built (see native/setup.py)."""
from pathlib import Path

LIBRARY_PATH = Path(__file__).with_name("libonednn_conv.so")
BUILD_ERROR_PATH = Path(__file__).with_name("BUILD_ERROR.txt")
