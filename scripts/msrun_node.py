"""msrun (python -m mindspore.parallel.cluster.run) for one node of a job, as run_distribute_train.sh uses it.

    python scripts/msrun_node.py MSRUN_ARGUMENTS...      msrun with the change below

One change to msrun 2.10's own behaviour:
- The job's scheduler starts on the node with --node_rank 0 alone. msrun starts one on every node that finds
  --master_addr among its own addresses: on separate machines that is the master node only, but two nodes that
  share a host (two launchers on one machine, containers on the host network) would both start one, and the
  second fails on the taken port, failing its node's run after training ended well.
"""
import sys


def run_msrun() -> None:
    from mindspore.parallel.cluster import run

    manager = getattr(run, "_ProcessManager", None)
    if manager is None:  # another msrun layout: msrun as it is (its address rule decides)
        print("warning: msrun has no _ProcessManager here; running it unchanged", file=sys.stderr, flush=True)
        run.main()
        return

    class NodeManager(manager):  # pylint: disable=too-few-public-methods
        def __init__(self, args):
            super().__init__(args)
            if args.node_rank >= 0:
                self.is_master = args.node_rank == 0

    run._ProcessManager = NodeManager  # pylint: disable=protected-access
    run.main()


if __name__ == "__main__":
    run_msrun()
