"""The ``bpslaunch`` command: three modes, picked by the first argument.

Usage::

    bpslaunch CMD...                                   # run the role DMLC_ROLE names
    srun bpslaunch CMD...                              # a worker of a SLURM/torchrun job
    bpslaunch local --workers 2 --servers 1 -- CMD...  # whole cluster on loopback
    bpslaunch netem --nodes 4 --servers 1 --rate 100mbit -- CMD...  # emulated slow network
    bpslaunch keygen PATH                              # the cluster's key file

``bpslaunch --help`` (or ``bpslaunch`` alone with no ``DMLC_ROLE`` set) prints
:data:`USAGE`.
"""

from __future__ import annotations

import sys

from bps.common.env import EnvError, dmlc_role, launch_style

USAGE = """\
usage: bpslaunch CMD...                      run the role that DMLC_ROLE names
       bpslaunch local [OPTIONS] -- CMD...  a whole cluster on this machine (loopback)
       bpslaunch netem [OPTIONS] -- CMD...  a whole cluster on emulated hosts (root)
       bpslaunch keygen PATH                write a cluster key file (BPS_SECRET_FILE)

role from the environment (one process per machine, ps-lite's variables):
  export BPS_SECRET_FILE=~/.bps/cluster.key   # from `bpslaunch keygen`, on every host
  DMLC_ROLE=scheduler DMLC_NUM_WORKER=2 DMLC_NUM_SERVER=1 \\
      DMLC_PS_ROOT_URI=10.0.0.1 DMLC_PS_ROOT_PORT=9000 bpslaunch
  DMLC_ROLE=worker DMLC_WORKER_ID=0 DMLC_NUM_WORKER=2 DMLC_NUM_SERVER=1 \\
      DMLC_PS_ROOT_URI=10.0.0.1 DMLC_PS_ROOT_PORT=9000 bpslaunch python train.py

under torchrun, SLURM or a PyTorchJob (no DMLC_ROLE): each process a worker; local
rank 0 starts BPS_SERVERS_PER_NODE servers, node 0 the scheduler at MASTER_PORT+1
  srun --ntasks-per-node 2 bpslaunch python train.py
  torchrun --nnodes 2 --nproc-per-node 2 ... --no-python bpslaunch python train.py

local: scheduler, servers and workers on loopback ports (a fresh key per job)
  bpslaunch local --workers 2 --servers 1 -- python examples/mnist.py --compressor onebit

netem: one network namespace per host, links shaped with tc
  bpslaunch netem --nodes 4 --servers 4 --rate 100mbit -- python examples/mnist.py

`bpslaunch local --help` and `bpslaunch netem --help` list their options.
"""


def main(argv: list[str] | None = None) -> int:
    """Dispatch to the sub-command; returns the process exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] in (["-h"], ["--help"]):
        print(USAGE, end="")
        return 0
    if args and args[0] == "local":
        from bps.launch.local import main as run
        return run(args[1:])
    if args and args[0] == "netem":
        from bps.launch.netem import main as run
        return run(args[1:])
    if args and args[0] == "keygen":
        from bps.launch.keygen import main as run
        return run(args[1:])
    if not args and _role_unset():
        print(USAGE, end="", file=sys.stderr)
        return 2
    from bps.launch.role import main as run
    return run(args)


def _role_unset() -> bool:
    try:
        return dmlc_role() is None and launch_style() is None
    except EnvError:
        return False  # a bad DMLC_ROLE: the role mode reports it


if __name__ == "__main__":
    sys.exit(main())
