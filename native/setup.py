"""Builds libonednn_conv.so next to the resnet_onednn_conv package.

Compiler: $CXX, else g++. A failed compile (no compiler, headers missing) does not fail the install: the error is kept in
resnet_onednn_conv/BUILD_ERROR.txt and the project falls back to MindSpore's own convolutions.
"""
import hashlib
import os
import subprocess
from importlib import metadata
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "onednn_conv.cc"


def _installed_file(distribution: str, suffix: str) -> Path:
    """A file of an installed build requirement (its headers and library live outside site-packages)."""
    for entry in metadata.distribution(distribution).files or []:
        if str(entry).endswith(suffix):
            return Path(entry.locate()).resolve()
    raise FileNotFoundError(f"{suffix} not found in the {distribution} package")


def compile_library(output: Path) -> None:
    header = _installed_file("onednn-devel-cpu-gomp", "oneapi/dnnl/dnnl.hpp")
    # Link-time stand-in with the same soname (libdnnl.so.3); the rpath points at MindSpore's copy.
    library = _installed_file("onednn-cpu-gomp", "/libdnnl.so.3")
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()
    # -fno-math-errno: sqrt without errno, which lets the optimizer's loop vectorise (nothing here reads errno).
    command = [os.environ.get("CXX", "g++"), "-O2", "-fno-math-errno", "-std=c++17", "-shared", "-fPIC", "-pthread",
               f"-I{header.parents[2]}",
               f'-DONEDNN_CONV_SOURCE_DIGEST="{digest}"', str(SOURCE), "-o", str(output), str(library),
               "-Wl,-rpath,$ORIGIN/../mindspore/lib"]
    subprocess.run(command, check=True, capture_output=True, text=True)


class BuildWithLibrary(build_py):
    def run(self) -> None:
        super().run()
        package_dir = Path(self.build_lib) / "resnet_onednn_conv"
        error_file = package_dir / "BUILD_ERROR.txt"
        library = package_dir / "libonednn_conv.so"
        library.unlink(missing_ok=True)  # pip builds in native/build/: never ship an earlier build's library
        try:
            compile_library(library)
            error_file.unlink(missing_ok=True)
        except (OSError, subprocess.CalledProcessError) as error:
            details = getattr(error, "stderr", "") or ""
            error_file.write_text(f"{error}\n{details}")
            print(f"WARNING: libonednn_conv.so was not built ({error}); MindSpore's convolutions will be used")


class PlatformDistribution(Distribution):
    def has_ext_modules(self) -> bool:  # a platform wheel: it carries a compiled library
        return True


setup(cmdclass={"build_py": BuildWithLibrary}, distclass=PlatformDistribution)
