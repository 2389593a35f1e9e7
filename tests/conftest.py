"""Every test process and every cluster it starts share one cluster key (CURVE), made
here in a private temporary directory: processes started one by one (not through
``bpslaunch local``, which makes its own) find it in ``BPS_SECRET_FILE``."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest


@pytest.fixture(scope="session", autouse=True)
def cluster_key(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from bps.auth import write_key_file

    folder = tmp_path_factory.mktemp("key")
    folder.chmod(0o700)
    path = str(folder / "cluster.key")
    write_key_file(path)
    previous = os.environ.get("BPS_SECRET_FILE")
    os.environ["BPS_SECRET_FILE"] = path
    os.environ.pop("BPS_INSECURE", None)
    yield path
    if previous is None:
        os.environ.pop("BPS_SECRET_FILE", None)
    else:
        os.environ["BPS_SECRET_FILE"] = previous
