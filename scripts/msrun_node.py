"""msrun (python -m mindspore.parallel.cluster.run) for one node of a job, as run_distribute_train.sh uses it.

    python scripts/msrun_node.py MSRUN_ARGUMENTS...      msrun with the changes below
    python scripts/msrun_node.py --check-master ADDR PORT NODE_RANK
                                                          exit 2 with one 'error:' line if ADDR/PORT cannot work

Four changes to msrun 2.10's own behaviour:
- The job's scheduler starts on the node with --node_rank 0 alone. msrun starts one on every node that finds
  --master_addr among its own addresses: on separate machines that is the master node only, but two nodes that
  share a host (two launchers on one machine, containers on the host network) would both start one, and the
  second fails on the taken port, failing its node's run after training ended well.
- When the launcher dies (kill -9), this node's workers and scheduler are stopped: the node is lost, and the
  other nodes end as they do for a lost node. Without this they would train on unseen, as orphans.
- When this node's scheduler fails (it ends the job when a node stops sending heartbeats), this node's workers
  are stopped at once. msrun looks at the scheduler only after its workers end, and a worker can spend another
  20 s retrying the vanished scheduler (MS_HEARTBEAT_RETRY_TIMEOUT) before it gives up.
- When a worker ends non-zero (an error, a kill, a stop by SIGTERM), msrun stops the others and then waits for the
  scheduler, which waits MS_NODE_TIMEOUT (30 s) for the workers that are gone. On a node that holds every worker
  of the job the scheduler is stopped as soon as the workers have ended: nobody is left for it to serve. This
  wrapper then exits with the first failed worker's exit code (128 + the signal for a killed one), and last
  prints that worker's `error:` line, so that a user error ends with its one line and exit code 2, as train.py's.
"""
import os
import shutil
import signal
import socket
import sys
import threading
import time


def check_master(addr: str, port: str, node_rank: int) -> None:
    """Exits 2 with one line if MASTER_ADDR does not resolve, or, on node 0 (which starts the scheduler there),
    if it is not this machine's address or MASTER_PORT is taken. Other nodes cannot check more before the job:
    the master may not be up yet."""
    def refuse(message: str) -> None:
        print(f"error: {message}", file=sys.stderr, flush=True)
        sys.exit(2)

    if not port.isdigit() or not 1024 <= int(port) <= 65535:
        refuse(f"MASTER_PORT must be a port number from 1024 to 65535, got '{port}'")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(addr, int(port), type=socket.SOCK_STREAM)[0]
    except (socket.gaierror, UnicodeError) as exc:
        refuse(f"MASTER_ADDR '{addr}' does not resolve ({exc}); give the master node's IP address or host name")
    if node_rank != 0:
        return
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as a server does: TIME_WAIT is no conflict
        try:
            probe.bind(address)
        except OSError as exc:
            if exc.errno == 98:  # EADDRINUSE
                refuse(f"MASTER_PORT {port} is in use on {addr} (another job's scheduler?); choose a free port")
            refuse(f"MASTER_ADDR {addr} is not an address of this machine ({exc.strerror}): NODE_RANK=0 runs on "
                   f"the node at MASTER_ADDR")


def run_msrun() -> None:
    omp_threads = os.environ.get("OMP_NUM_THREADS")  # the user's, before MindSpore's import changes it
    from mindspore.parallel.cluster import run  # imported here: --check-master must not wait for MindSpore

    # MindSpore's import sets OMP_NUM_THREADS=1 in the C-level environment, which msrun's workers inherit: each
    # would then run the native convolutions on one thread whatever the machine has (src/onednn_conv.py
    # native_thread_count). The workers get the user's setting instead.
    if omp_threads is None:
        os.unsetenv("OMP_NUM_THREADS")
    else:
        os.putenv("OMP_NUM_THREADS", omp_threads)

    manager = getattr(run, "_ProcessManager", None)
    if manager is None:  # another msrun layout: msrun as it is (its address rule decides)
        print("warning: msrun has no _ProcessManager here; running it unchanged", file=sys.stderr, flush=True)
        run.main()
        return

    managers = []  # msrun's main makes the one NodeManager: kept for its failure report

    class NodeManager(manager):  # pylint: disable=too-few-public-methods
        def __init__(self, args):
            super().__init__(args)
            managers.append(self)
            if args.node_rank >= 0:
                self.is_master = args.node_rank == 0
            # (local rank, exit code) of the first worker seen to end non-zero; or the scheduler failed first.
            self.failure_lock = threading.Lock()
            self.first_failure = None
            self.scheduler_failed = False
            threading.Thread(target=self._stop_all_if_the_launcher_dies, args=(os.getppid(),), daemon=True).start()

        def _kill_workers(self):
            for worker in list(self.cgn_processes):  # each in its own process group, as msrun kills them
                try:
                    os.killpg(worker.pid, signal.SIGKILL)
                except ProcessLookupError:  # ended meanwhile
                    pass

        def _stop_all_if_the_launcher_dies(self, launcher_pid):
            """A launcher killed with SIGKILL (it cannot pass that on) would leave this node's processes training
            on unseen: that is the node lost, so they go too, and the other nodes fail the job as for a lost node."""
            while os.getppid() == launcher_pid:
                time.sleep(0.5)
            self._kill_workers()
            for process in [getattr(self, "msn_process", None), *getattr(self, "tail_cgn_processes", [])]:
                if process is not None and process.poll() is None:
                    process.kill()
            if os.environ.get("RESNET_SHIM_DIR"):  # the launcher's `python` wrapper, which its EXIT trap would remove
                shutil.rmtree(os.environ["RESNET_SHIM_DIR"], ignore_errors=True)
            os._exit(1)  # pylint: disable=protected-access

        def join_processes(self):
            if getattr(self, "msn_process", None) is not None:
                threading.Thread(target=self._stop_workers_if_scheduler_fails, daemon=True).start()
            threading.Thread(target=self._stop_scheduler_once_a_worker_fails, daemon=True).start()
            super().join_processes()

        def _stop_workers_if_scheduler_fails(self):
            while self.msn_process.poll() is None:
                time.sleep(0.5)
            with self.failure_lock:
                if self.msn_process.returncode == 0 or self.first_failure is not None:
                    return  # a clean end, or a worker failed first (and this wrapper then stopped the scheduler)
                self.scheduler_failed = True
            print(f"msrun_node: the scheduler failed (exit code {self.msn_process.returncode}); stopping this "
                  f"node's workers", file=sys.stderr, flush=True)
            self._kill_workers()  # msrun's join loop then sees them end and reports the job as failed

        def _stop_scheduler_once_a_worker_fails(self):
            """Records the first worker to end non-zero (not one stopped because the scheduler failed). msrun then
            stops the others; once they have ended, the scheduler of a job whose workers are all on this node is
            stopped too instead of waiting out MS_NODE_TIMEOUT for them (other nodes' workers still need it)."""
            workers = dict(self.proc_rank_map)
            while True:
                codes = {local_rank: process.poll() for local_rank, process in workers.items()}
                failed = [(local_rank, code) for local_rank, code in codes.items() if code not in (None, 0)]
                if failed:
                    break
                if all(code == 0 for code in codes.values()):
                    return
                time.sleep(0.1)  # msrun polls every second: this sees the first failure before its kills
            with self.failure_lock:
                if self.scheduler_failed:
                    return
                self.first_failure = failed[0]
            scheduler = getattr(self, "msn_process", None)
            if scheduler is None or self.local_worker_num != self.worker_num:
                return
            while any(process.poll() is None for process in workers.values()):
                time.sleep(0.1)
            scheduler.kill()

        def failure_report(self):
            """(exit code, one line) for the first worker that ended non-zero: its last 'error:' line with its rank,
            else its exit code or signal and its log; None when no worker failed first."""
            if self.first_failure is None:
                return None
            local_rank, code = self.first_failure
            rank, log_path = self._get_node_id_and_log_path(local_rank)
            rank = local_rank if rank is None else rank
            try:
                with open(log_path, errors="replace") as log:
                    errors = [line.rstrip() for line in log if line.startswith("error: ")]
            except OSError:
                errors = []
            if errors:
                return code, f"error: rank {rank}: {errors[-1][len('error: '):]}"
            how = f"was killed by signal {-code}" if code < 0 else f"exited with {code}"
            return code, f"msrun: rank {rank} {how}; its log: {log_path}"

    run._ProcessManager = NodeManager  # pylint: disable=protected-access
    try:
        run.main()
    except RuntimeError as exc:  # msrun's "Distributed job exited with exception ...": its traceback adds nothing
        print(f"msrun: {exc}", file=sys.stderr, flush=True)
        report = managers[0].failure_report() if managers else None
        if report is None:
            sys.exit(1)
        code, line = report
        print(line, file=sys.stderr, flush=True)
        sys.exit(code if code > 0 else 128 - code)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--check-master"]:
        if len(sys.argv) != 5:
            sys.exit("usage: msrun_node.py --check-master ADDR PORT NODE_RANK")
        check_master(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        run_msrun()
