"""Shared fixtures: a generated CIFAR-format dataset, a runner for the top-level scripts, and the suite's memory
keeping (each module's freed memory given back; heavy measurements in a process of their own)."""
import contextlib
import csv
import ctypes
import fcntl
import gc
import multiprocessing
import tempfile
import os
import signal
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional

# In-process tests run MindSpore's own convolutions, which need oneDNN capped at AVX2 on AVX-512 machines
# (see README); set before MindSpore runs a conv. Scripts the tests start choose for themselves (script_env).
# (The marker variable carries this to pytest-xdist's workers, which inherit the environment set here.)
ISA_SET_BY_TESTS = "ONEDNN_MAX_CPU_ISA" not in os.environ or os.environ.get("TESTS_SET_ONEDNN_ISA") == "1"
if ISA_SET_BY_TESTS:
    os.environ.update(ONEDNN_MAX_CPU_ISA="AVX2", TESTS_SET_ONEDNN_ISA="1")

# Importing src sets GLOG_v for this process (src/__init__.py); scripts the tests start must set it themselves.
GLOG_SET_BY_USER = "GLOG_v" in os.environ

import numpy as np  # noqa: E402
import pytest  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


@pytest.fixture(scope="module", autouse=True)
def give_freed_memory_back():
    """After each module, hands the memory its tests freed back to the system. glibc keeps freed blocks in its
    per-thread arenas, and MindSpore's many threads spread them over many: without this a test process holds
    what its biggest module ever used (5 GB after test_checkpoint_formats, 1.3 GB after trimming), next to the
    other process's and the launchers' workers.

    MindSpore 2.10 memoises the argument counts of each function it compiles in graph mode (an lru_cache of up to
    4096 functions in mindspore/graph/api.py), which keeps every such function alive, and through a closure the
    cells it uses: ms.grad of a test's closure (test_onednn_conv) kept its convolutions to the interpreter's
    shutdown, where their Cell.__del__ found MindSpore's module globals already None and printed a few hundred
    'Exception ignored' lines. Cleared here (the counts are recomputed on demand), they are freed with the rest."""
    yield
    api = sys.modules.get("mindspore.graph.api")  # a module that never imported MindSpore does not import it here
    arguments_cache = getattr(api, "_get_func_args_info_cached", None)
    if hasattr(arguments_cache, "cache_clear"):  # gone in another MindSpore: nothing to clear
        arguments_cache.cache_clear()
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass


@pytest.fixture(autouse=True)
def mindspore_mode_restored():
    """Each test leaves MindSpore in the execution mode it found (PyNative after collection): a test that switches
    to graph mode must not leak it into the next file, where a network changed after its first call would keep
    running its first compiled graph (test_checkpoint_formats swaps layers of a network it has run)."""
    import mindspore as ms
    mode = ms.get_context("mode")
    yield
    ms.set_context(mode=mode)


# A folder per test run for memory_heavy's lock file and torch's compile cache (importing torchvision creates
# torch's cache folder, /tmp/torchinductor_<user> by default): made by the run's main process when pytest starts
# (not at import: a script importing this module's helpers would leave one behind), and inherited through the
# environment by its xdist workers and any pytest or script a test starts; that process removes it at the end.
RUN_FOLDER = "RESNET_TESTS_RUN_FOLDER"
MEMORY_LOCK = "RESNET_TESTS_MEMORY_LOCK"
_owned_run_folder: Optional[str] = None


def pytest_configure(config) -> None:
    global _owned_run_folder
    if RUN_FOLDER not in os.environ:
        _owned_run_folder = tempfile.mkdtemp(prefix="resnet-tests-")
        os.environ[RUN_FOLDER] = _owned_run_folder
        os.environ[MEMORY_LOCK] = str(Path(_owned_run_folder) / "memory.lock")
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(_owned_run_folder) / "torchinductor"))


def pytest_unconfigure(config) -> None:
    if _owned_run_folder:
        shutil.rmtree(_owned_run_folder, ignore_errors=True)
        for name in (RUN_FOLDER, MEMORY_LOCK):
            os.environ.pop(name, None)


# The files whose tests run memory_heavy blocks. Under `-n 2 --dist loadfile` they form one unit of work, run first
# by one process: as separate files they ran at the same time in both processes, and each waited for the other's
# turn (552 s of waiting in 879 s, in a run of those files and test_train_eval.py).
MEMORY_HEAVY_FILES = ("test_launchers.py", "test_torch_parity.py", "test_ckpt_reader.py")


# The other files of 30 s or more, longest first (each file's wall time in a whole run, `-n 2 --dist loadfile`, on a
# 2-core Zen 3). pytest-xdist hands a process its next file when that process is nearly done with its last one, so
# the run ends well balanced only if its last files are short: ordered by test count (pytest-xdist's own order), the
# files with few but long tests came last (test_device_recipe.py among them), and one process ran alone for the
# last 69 s. Files not named here follow, in name order. A stale list costs time, never a result.
LONG_FILES = ("test_device_recipe.py", "test_onednn_conv.py", "test_train_eval.py", "test_benchmark.py",
              "test_recipes.py", "test_convert_pth.py", "test_ema.py", "test_native_optimizer.py", "test_cifar_stem.py",
              "test_export.py", "test_home_semantics.py", "test_augmentation.py", "test_checkpoint_formats.py",
              "test_predict.py", "test_fused_inference.py", "test_pretrained.py", "test_output_lock.py",
              "test_disk_full.py", "test_profiling.py")


def file_rank(name: str) -> int:
    """Where a test file's tests go in the run: the memory-heavy files, then LONG_FILES in order, then the rest."""
    if name in MEMORY_HEAVY_FILES:
        return 0
    return 1 + LONG_FILES.index(name) if name in LONG_FILES else 1 + len(LONG_FILES)


def pytest_collection_modifyitems(session, config, items) -> None:
    """Files in file_rank's order, each file's tests together and in order: the longest units of work start first,
    so the short ones fill the end of the run."""
    items.sort(key=lambda item: file_rank(item.path.name))


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # optional: pytest without xdist runs too
def pytest_xdist_make_scheduler(config, log):
    """--dist loadfile with the memory-heavy files as one unit, handed out in the collection's order (above), not
    reordered by test count; any other --dist as pytest-xdist makes it."""
    if config.getvalue("dist") != "loadfile":
        return None
    config.option.loadscopereorder = False  # pytest-xdist (3.8 here) sorts units by test count unless told
    from xdist.scheduler import LoadFileScheduling

    class MemoryHeavyFilesTogether(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            scope = super()._split_scope(nodeid)
            return "memory-heavy files" if Path(scope).name in MEMORY_HEAVY_FILES else scope
    return MemoryHeavyFilesTogether(config, log)


@contextlib.contextmanager
def memory_heavy() -> Iterator[None]:
    """Runs its block while no other test process of this run is inside such a block: the parts of the suite
    that need several GB at once (msrun jobs, the deep parity networks, the filled page cache) take turns, so
    that the two test processes together stay well inside the machine's memory."""
    with open(os.environ[MEMORY_LOCK], "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def in_fresh_process(function: Callable[..., Any], *args: Any) -> Any:
    """function(*args) run in a new Python process, its result returned. MindSpore keeps compiled graphs and
    their memory for the life of a process, so measurements that build many networks (the torchvision parity
    of ResNet-18..152: up to 6 GB) run where that memory goes back when they end, one at a time."""
    with memory_heavy(), multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(function, args)


# Small, fast settings for end-to-end runs: 32x32 input, few images.
FAST_ARGS = ["--image_height", "32", "--image_width", "32", "--num_parallel_workers", "2", "--log_interval", "1"]


@pytest.fixture(scope="session")
def cifar_dir(tmp_path_factory) -> Path:
    """A full-size synthetic CIFAR-10 binary folder (data_batch_1..5.bin, test_batch.bin), made once."""
    from src.synthetic_data import write_synthetic_cifar
    return write_synthetic_cifar(str(tmp_path_factory.mktemp("data") / "cifar-10-batches-bin"), seed=0)


def script_env(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """The environment for a script a test starts: this one, without the ISA cap the tests set for themselves
    and the GLOG_v their import of src set."""
    env = dict(os.environ)
    if ISA_SET_BY_TESTS:
        env.pop("ONEDNN_MAX_CPU_ISA", None)
        env.pop("TESTS_SET_ONEDNN_ISA", None)
    if not GLOG_SET_BY_USER:
        env.pop("GLOG_v", None)
    env.update(extra or {})
    return env


def cpu_has_avx512() -> bool:
    """Whether oneDNN can run its avx512_core code here: AVX-512 F, CD, BW, VL and DQ."""
    try:
        with open("/proc/cpuinfo") as handle:
            flags = next((line.split(":", 1)[1].split() for line in handle if line.startswith("flags")), [])
    except OSError:
        return False
    return {"avx512f", "avx512cd", "avx512bw", "avx512vl", "avx512dq"} <= set(flags)


def avx2_capped_case(*values: Any, id: str) -> Any:
    """A parametrized case that caps oneDNN at AVX2 beside an uncapped one: without AVX-512 the two run the same
    kernels on the same 8-channel blocks, so there it is skipped rather than run twice."""
    return pytest.param(*values, id=id, marks=pytest.mark.skipif(
        not cpu_has_avx512(), reason="no AVX-512: the uncapped case runs the same AVX2 kernels"))


def native_channel_block(isa: Optional[str]) -> int:
    """The channel block of the native library's blocked layouts with ONEDNN_MAX_CPU_ISA=isa (None: no cap)."""
    return 16 if isa is None and cpu_has_avx512() else 8


def run_with_onednn_log(args: List[str], isa: Optional[str] = None) -> str:
    """The standard output of `python ARGS` (from the repository root, which must succeed) with ONEDNN_VERBOSE=1
    and oneDNN capped at isa (None: no cap): the script's own lines and oneDNN's."""
    env = {key: value for key, value in script_env().items() if key != "ONEDNN_MAX_CPU_ISA"}
    env["ONEDNN_VERBOSE"] = "1"
    if isa:
        env["ONEDNN_MAX_CPU_ISA"] = isa
    process = subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True,
                             timeout=300)
    assert process.returncode == 0, process.stderr[-3000:]
    return process.stdout


def onednn_exec_fields(output: str) -> List[List[str]]:
    """oneDNN's exec lines in output (from run_with_onednn_log), split into fields."""
    return [line.split(",") for line in output.splitlines() if line.startswith("onednn_verbose") and ",exec," in line]


def onednn_exec_log(args: List[str], isa: Optional[str] = None, marker: str = "") -> List[List[str]]:
    """oneDNN's exec lines, split into fields, from run_with_onednn_log(args, isa); with a marker, only the lines
    printed after it."""
    output = run_with_onednn_log(args, isa)
    return onednn_exec_fields(output.split(marker, 1)[1] if marker else output)


def run_script(script: str, args: List[str], cwd: Optional[Path] = None, timeout: float = 600,
               env: Optional[Dict[str, str]] = None) -> subprocess.CompletedProcess:
    """Runs python SCRIPT ARGS from the repository root (or cwd) and returns the finished process."""
    return subprocess.run([sys.executable, str(REPO / script), *args], cwd=str(cwd or REPO), env=script_env(env),
                          capture_output=True, text=True, timeout=timeout)


def assert_one_line_error(process: subprocess.CompletedProcess, *fragments: str) -> str:
    """The process failed with exit code 2 and a single 'error: ...' line naming every fragment."""
    assert process.returncode == 2, (process.returncode, process.stdout[-2000:], process.stderr[-2000:])
    assert "Traceback" not in process.stderr, process.stderr[-3000:]
    errors = [line for line in process.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, process.stderr[-3000:]
    for fragment in fragments:
        assert fragment in errors[0], (fragment, errors[0])
    return errors[0]


def one_line_user_error(excinfo, *fragments: str) -> str:
    """The raised exception is a UserError whose message is one line naming every fragment."""
    from src.errors import UserError
    message = str(excinfo.value)
    assert excinfo.type is UserError
    assert "\n" not in message and "\r" not in message, message
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    return message


def read_ckpt_entries(path) -> dict:
    """Every entry of a .ckpt, read the way the project reads them: mindspore.load_checkpoint refuses files larger
    than MemFree, so the suite would depend on how full the page cache is (src/weights/files.py)."""
    from src.weights.files import read_ckpt
    return read_ckpt(Path(path))


def flip_one_byte(data: bytes) -> bytes:
    """data with its middle byte inverted: the same length, another checksum."""
    middle = len(data) // 2
    return data[:middle] + bytes([data[middle] ^ 0xFF]) + data[middle + 1:]


def temp_files(folder: Path) -> List[str]:
    """Paths under folder (recursively, relative to it) of src.atomic_file's temporary files and of the private
    folders named after them: half-written work, which no write may leave behind."""
    from src.atomic_file import TEMP_PREFIX
    if not folder.exists():
        return []
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.name.startswith(TEMP_PREFIX))


def rel_diff(actual: np.ndarray, expected: np.ndarray) -> float:
    """max|actual - expected| / max|expected| (the relative measure of the parity and kernel tests)."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    return float(np.abs(actual - expected).max() / max(float(np.abs(expected).max()), 1e-30))


def randomise_batchnorm(module, rng, batches_tracked: bool = True) -> None:
    """Non-trivial affine parameters and running statistics for every torch BatchNorm2d in module (and a
    random num_batches_tracked), so that every converted field matters."""
    import torch
    with torch.no_grad():
        for sub in module.modules():
            if isinstance(sub, torch.nn.BatchNorm2d):
                c = sub.num_features
                sub.weight.copy_(torch.from_numpy(rng.uniform(0.5, 1.5, c).astype(np.float32)))
                sub.bias.copy_(torch.from_numpy(rng.normal(0.0, 0.2, c).astype(np.float32)))
                sub.running_mean.copy_(torch.from_numpy(rng.normal(0.0, 0.2, c).astype(np.float32)))
                sub.running_var.copy_(torch.from_numpy(rng.uniform(0.5, 2.0, c).astype(np.float32)))
                if batches_tracked:
                    sub.num_batches_tracked.fill_(int(rng.integers(0, 1000)))


def read_metrics(folder: Path):
    """(column names, rows as dicts) of folder/metrics.csv."""
    with open(folder / "metrics.csv", newline="") as handle:
        reader = csv.DictReader(handle)
        return reader.fieldnames, list(reader)


def checkpoint_arrays(path: Path):
    return {name: value.asnumpy() for name, value in read_ckpt_entries(path).items()
            if not isinstance(value, str)}


def max_difference(path_a: Path, path_b: Path) -> float:
    """The largest absolute difference between two checkpoints' arrays (they must hold the same names)."""
    a, b = checkpoint_arrays(path_a), checkpoint_arrays(path_b)
    assert a.keys() == b.keys()
    return max(float(np.max(np.abs(a[k].astype(np.float64) - b[k].astype(np.float64)))) if a[k].size else 0.0
               for k in a)


def start_training(args, log_path: Path) -> subprocess.Popen:
    """train.py ARGS started in the background, its output going to log_path."""
    log = open(log_path, "w")
    return subprocess.Popen([sys.executable, str(REPO / "train.py"), *args], cwd=REPO, stdout=log,
                            stderr=subprocess.STDOUT, env=script_env())


def wait_for_line(log_path: Path, text: str, process: subprocess.Popen, timeout: float = 300) -> None:
    """Returns once text is in log_path; fails if the process ends first or timeout passes."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if text in log_path.read_text():
            return
        assert process.poll() is None, log_path.read_text()[-3000:]
        time.sleep(0.1)
    raise AssertionError(f"{text!r} not seen in {log_path}")


def sigterm_training(args, log_path: Path, line: str) -> None:
    """Starts train.py ARGS (output to log_path), sends SIGTERM once line is logged and checks it stopped with
    128 + SIGTERM, having saved its resume point."""
    process = start_training(args, log_path)
    wait_for_line(log_path, line, process)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=120) == 128 + signal.SIGTERM, log_path.read_text()[-3000:]


def final_digest(log: str) -> str:
    """The one 'final weights sha256' a single-process train.py run logs."""
    found = re.findall(r"final weights sha256 ([0-9a-f]{64})", log)
    assert len(found) == 1, log[-3000:]
    return found[0]
