"""``bpslaunch keygen PATH``: write a fresh cluster key file.

Usage::

    bpslaunch keygen ~/.bps/cluster.key     # mode 0600; never overwrites; makes ~/.bps (0700)
    # copy it to every host of the cluster (like an ssh key), then on each:
    BPS_SECRET_FILE=~/.bps/cluster.key DMLC_ROLE=... bpslaunch ...

``bpslaunch local`` and ``bpslaunch netem`` make their own key per job.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from bps.common.auth import AuthError, write_key_file


def make_parents(path: str) -> list[str]:
    """Create the missing folders above ``path``, each mode 0700 (whatever the umask);
    returns those it made. Existing ones are left as they are.

        >>> make_parents("/tmp/a/b/cluster.key")      # doctest: +SKIP
        ['/tmp/a', '/tmp/a/b']
    """
    missing = []
    parent = os.path.dirname(path)
    while parent and not os.path.exists(parent):
        missing.append(parent)
        parent = os.path.dirname(parent)
    for folder in reversed(missing):
        os.mkdir(folder, 0o700)
        os.chmod(folder, 0o700)
    return list(reversed(missing))


def main(args: Sequence[str]) -> int:
    """Write the key file; returns the exit code (1 when PATH exists or is not writable)."""
    parser = argparse.ArgumentParser(
        prog="bpslaunch keygen",
        description="Write a new cluster key (CURVE keypair) that every scheduler, server "
                    "and worker of one cluster reads from BPS_SECRET_FILE.")
    parser.add_argument("path", help="where to write the key file (must not exist)")
    ns = parser.parse_args(list(args))
    path = os.path.abspath(os.path.expanduser(ns.path))
    try:
        make_parents(path)
        key = write_key_file(path)
    except AuthError as exc:
        print(f"bpslaunch keygen: error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"bpslaunch keygen: error: cannot write {path}: {exc.strerror}", file=sys.stderr)
        return 1
    print(f"wrote the cluster key to {path} (mode 0600, public key {key.public.decode()}).\n"
          f"Copy it to every host of the cluster and start every scheduler, server and "
          f"worker with BPS_SECRET_FILE={path}")
    return 0
