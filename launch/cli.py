"""The ``bpslaunch`` command.

Usage::

    bpslaunch CMD...                                   # run the role DMLC_ROLE names
    bpslaunch local --workers 2 --servers 1 -- CMD...  # whole cluster on loopback
    bpslaunch netem --nodes 4 --servers 1 --rate 100mbit -- CMD...  # emulated slow network
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    """Dispatch to the sub-command; returns the process exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "local":
        from bps.launch.local import main as run
        return run(args[1:])
    if args and args[0] == "netem":
        from bps.launch.netem import main as run
        return run(args[1:])
    from bps.launch.role import main as run
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
