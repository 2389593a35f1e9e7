"""Every test process and every cluster it starts share one cluster key (CURVE), made
here in a private temporary directory when pytest starts: processes started one by one
(not through ``bpslaunch local``, which makes its own) find it in ``BPS_SECRET_FILE``.

Tests marked ``cuda`` skip where torch sees no CUDA device."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

_saved: dict[str, str | None] = {}


def pytest_configure(config: pytest.Config) -> None:
    from bps.common.auth import write_key_file

    folder = tempfile.mkdtemp(prefix="bps-test-key-")  # mode 0700
    path = os.path.join(folder, "cluster.key")
    write_key_file(path)
    _saved.update(folder=folder, previous=os.environ.get("BPS_SECRET_FILE"))
    os.environ["BPS_SECRET_FILE"] = path
    os.environ.pop("BPS_INSECURE", None)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``cuda`` skip, with the reason, where torch sees no CUDA device."""
    cuda_tests = [item for item in items if item.get_closest_marker("cuda")]
    if not cuda_tests:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; torch.cuda.is_available() is False")
    for item in cuda_tests:
        item.add_marker(skip)


def pytest_unconfigure(config: pytest.Config) -> None:
    if "folder" not in _saved:
        return
    if _saved["previous"] is None:
        os.environ.pop("BPS_SECRET_FILE", None)
    else:
        os.environ["BPS_SECRET_FILE"] = _saved["previous"]
    shutil.rmtree(_saved["folder"], ignore_errors=True)


@pytest.fixture
def cluster_key() -> str:
    """The path of the tests' cluster key file."""
    return os.environ["BPS_SECRET_FILE"]


@pytest.fixture
def membership_job(cluster_key: str):
    """``membership_job(min_workers)``: a :class:`tests.harness.scheduler_job.Job` (a
    scheduler in a thread with ``BPS_MIN_WORKERS=min_workers``, three workers and a
    server as bare clients, welcomed); each is closed at the test's end."""
    from tests.harness.scheduler_job import Job, scheduler_env

    made: list[Job] = []

    def make(min_workers: int) -> Job:
        made.append(Job(scheduler_env(cluster_key, min_workers)))
        return made[-1]

    yield make
    for each in made:
        each.close()


@pytest.fixture
def cluster(tmp_path):
    """``cluster(workers, servers, timeout=30.0, heartbeat_timeout=4.0)``: a
    :class:`tests.harness.roles.Cluster` of roles to start one by one in ``tmp_path``; every
    process it started is killed at the test's end."""
    from tests.harness.roles import HEARTBEAT_TIMEOUT, Cluster

    made: list[Cluster] = []

    def make(workers: int, servers: int, timeout: float = 30.0,
             heartbeat_timeout: float = HEARTBEAT_TIMEOUT) -> Cluster:
        made.append(Cluster(tmp_path, workers, servers, timeout, heartbeat_timeout))
        return made[-1]

    yield make
    for c in made:
        c.kill_all()
