"""The ``bpslaunch`` command: a table of targets, one module each, picked by the first argument.

Usage::

    bpslaunch CMD...                                   # run the role DMLC_ROLE names
    srun bpslaunch CMD...                              # a worker of a SLURM/torchrun job
    bpslaunch local --workers 2 --servers 1 -- CMD...  # whole cluster on loopback
    bpslaunch netem --nodes 4 --servers 1 --rate 100mbit -- CMD...  # emulated slow network
    bpslaunch keygen PATH                              # the cluster's key file

:data:`TARGETS` maps each sub-command's name to its :class:`Target`: the module whose
``main(args) -> int`` runs it (imported only when chosen), its synopsis, its one-line help
and its examples. A first argument that names none of them is the role's command
(:data:`ROLE`, :mod:`bps.launch.role`). ``bpslaunch --help`` (or ``bpslaunch`` alone with
no ``DMLC_ROLE`` set) prints :data:`USAGE`, which :func:`usage` builds from the table::

    >>> TARGETS["keygen"].synopsis
    'keygen PATH'
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from bps.common.env import EnvError, dmlc_role, launch_style


@dataclass(frozen=True)
class Target:
    """One way to run ``bpslaunch``.

    ``module`` holds ``main(args) -> int`` (the arguments after the target's name, the
    exit code back); ``synopsis`` follows ``bpslaunch`` on the usage line, ``summary`` is
    its one-line help and ``examples`` its paragraph of ``bpslaunch --help`` (may be
    empty)::

        Target("bps.launch.keygen", "keygen PATH", "write a cluster key file")
    """

    module: str
    synopsis: str
    summary: str
    examples: str = ""

    def run(self, args: Sequence[str]) -> int:
        """Import the module and run its ``main`` with ``args``; returns the exit code."""
        return importlib.import_module(self.module).main(list(args))


ROLE = Target(
    "bps.launch.role", "CMD...", "run the role that DMLC_ROLE names", """\
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
""")
"""The default target: a first argument that is not in :data:`TARGETS` starts CMD."""

TARGETS: Mapping[str, Target] = {
    "local": Target(
        "bps.launch.local", "local [OPTIONS] -- CMD...",
        "a whole cluster on this machine (loopback)", """\
local: scheduler, servers and workers on loopback ports (a fresh key per job)
  bpslaunch local --workers 2 --servers 1 -- python examples/mnist.py --compressor onebit
"""),
    "netem": Target(
        "bps.launch.netem", "netem [OPTIONS] -- CMD...",
        "a whole cluster on emulated hosts (root)", """\
netem: one network namespace per host, links shaped with tc
  bpslaunch netem --nodes 4 --servers 4 --rate 100mbit -- python examples/mnist.py
"""),
    "keygen": Target(
        "bps.launch.keygen", "keygen PATH", "write a cluster key file (BPS_SECRET_FILE)"),
}
"""The sub-commands, by the name that ``bpslaunch NAME ...`` gives."""


def usage(role: Target = ROLE, targets: Mapping[str, Target] = TARGETS) -> str:
    """``bpslaunch --help``: a usage line per target, then each one's examples, then where
    the options of the targets whose synopsis has ``[OPTIONS]`` are listed.

    >>> usage().splitlines()[0]
    'usage: bpslaunch CMD...                     run the role that DMLC_ROLE names'
    """
    every = [role, *targets.values()]
    width = max(len(t.synopsis) for t in every) + 2
    lines = [f"{'usage:' if i == 0 else '':6} bpslaunch {t.synopsis:{width}}{t.summary}"
             for i, t in enumerate(every)]
    paragraphs = ["\n".join(lines) + "\n", *(t.examples for t in every if t.examples)]
    with_options = [name for name, t in targets.items() if "[OPTIONS]" in t.synopsis]
    named = [f"`bpslaunch {name} --help`" for name in with_options]
    listed = " and ".join([", ".join(named[:-1]), named[-1]] if len(named) > 1 else named)
    paragraphs.append(f"{listed} list their options.\n")
    return "\n".join(paragraphs)


USAGE = usage()


def main(argv: list[str] | None = None) -> int:
    """Dispatch to the target the first argument names, else the role; returns the exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] in (["-h"], ["--help"]):
        print(USAGE, end="")
        return 0
    if not args and _role_unset():
        print(USAGE, end="", file=sys.stderr)
        return 2
    target = TARGETS.get(args[0]) if args else None
    if target is not None:
        return target.run(args[1:])
    return ROLE.run(args)


def _role_unset() -> bool:
    try:
        return dmlc_role() is None and launch_style() is None
    except EnvError:
        return False  # a bad DMLC_ROLE: the role mode reports it


if __name__ == "__main__":
    sys.exit(main())
