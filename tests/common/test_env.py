"""ClusterEnv: the defaults, and an error naming each malformed variable."""

from __future__ import annotations

import re

import pytest

from bps.common.env import ClusterEnv, EnvError
from tests.harness.env_vars import BASE


def test_env_defaults() -> None:
    env = ClusterEnv.from_environ(BASE)
    assert (env.role, env.num_workers, env.num_servers, env.worker_id) == ("worker", 4, 2, 3)
    assert env.scheduler_address == "tcp://10.0.0.1:9000"
    assert (env.partition_bytes, env.min_compress_bytes) == (4096000, 65536)
    assert (env.timeout, env.heartbeat_interval, env.heartbeat_timeout) == (60.0, 1.0, 10.0)
    assert (env.local_rank, env.local_size, env.node_host) == (0, 1, "127.0.0.1")
    short = ClusterEnv.from_environ({**BASE, "BPS_TIMEOUT": "5", "BYTEPS_LOCAL_SIZE": "2",
                                     "BYTEPS_LOCAL_RANK": "1", "DMLC_NODE_HOST": "10.1.0.7"})
    assert (short.timeout, short.heartbeat_timeout, short.local_rank) == (5.0, 5.0, 1)
    assert short.node_host == "10.1.0.7"
    assert env.frame_bytes == 131072  # CURVE: payloads in frames of 128 KiB
    assert ClusterEnv.from_environ({**BASE, "BPS_INSECURE": "1"}).frame_bytes == 0
    assert env.server_threads is None  # the server follows its host's cores
    assert ClusterEnv.from_environ({**BASE, "BPS_SERVER_THREADS": "3"}).server_threads == 3
    assert (env.connections_per_server, env.io_threads, env.on_one_host) == (None, None, False)
    striped = ClusterEnv.from_environ({**BASE, "BPS_CONNECTIONS_PER_SERVER": "4",
                                       "BPS_IO_THREADS": "auto", "DMLC_PS_ROOT_URI": "127.0.0.1"})
    assert (striped.connections_per_server, striped.io_threads, striped.on_one_host) == \
        (4, None, True)
    assert env.sched_batch  # bps's own processes under SCHED_BATCH unless told otherwise
    assert not ClusterEnv.from_environ({**BASE, "BPS_SCHED_BATCH": "0"}).sched_batch


@pytest.mark.parametrize(("change", "fragment"), [
    ({"DMLC_ROLE": None}, "DMLC_ROLE is not set"),
    ({"DMLC_PS_ROOT_URI": None}, "DMLC_PS_ROOT_URI is not set"),
    ({"DMLC_PS_ROOT_PORT": "70000"}, "DMLC_PS_ROOT_PORT=70000 out of range"),
    ({"DMLC_NUM_WORKER": "two"}, "DMLC_NUM_WORKER='two' is not an integer"),
    ({"DMLC_WORKER_ID": "4"}, "DMLC_WORKER_ID=4 out of range"),
    ({"BYTEPS_LOCAL_RANK": "1"}, "BYTEPS_LOCAL_RANK=1 out of range"),
    ({"BYTEPS_PARTITION_BYTES": "0"}, "BYTEPS_PARTITION_BYTES=0 out of range"),
    ({"BPS_TIMEOUT": "nan"}, "BPS_TIMEOUT='nan'"),
    ({"BPS_HEARTBEAT_INTERVAL": "2", "BPS_HEARTBEAT_TIMEOUT": "1"}, "BPS_HEARTBEAT_TIMEOUT=1.0"),
    ({"BPS_FRAME_BYTES": "100"}, "BPS_FRAME_BYTES=100 must be 0"),
    ({"BPS_SERVER_THREADS": "0"}, "BPS_SERVER_THREADS=0 out of range"),
    ({"BPS_SCHED_BATCH": "2"}, "BPS_SCHED_BATCH=2 out of range"),
    ({"BPS_SERVER_THREADS": "many"}, "BPS_SERVER_THREADS='many' is not an integer"),
    ({"BPS_CONNECTIONS_PER_SERVER": "0"}, "BPS_CONNECTIONS_PER_SERVER=0 out of range"),
    ({"BPS_IO_THREADS": "many"}, "BPS_IO_THREADS='many' is not an integer"),
    ({"BPS_MIN_WORKERS": "0"}, "BPS_MIN_WORKERS=0 out of range"),
    ({"BPS_MIN_WORKERS": "5"}, "BPS_MIN_WORKERS=5 out of range: at most DMLC_NUM_WORKER=4"),
    ({"BPS_MIN_WORKERS": "most"}, "BPS_MIN_WORKERS='most' is not an integer"),
    ({"BPS_SPARE_SERVERS": "-1"}, "BPS_SPARE_SERVERS=-1 out of range"),
    ({"BPS_SPARE_SERVERS": "65"}, "BPS_SPARE_SERVERS=65 out of range"),
    ({"BPS_SPARE_SERVERS": "one"}, "BPS_SPARE_SERVERS='one' is not an integer"),
    ({"DMLC_ROLE": "server", "BPS_SERVER_ID": "2"}, "BPS_SERVER_ID=2 out of range"),
    ({"DMLC_ROLE": "server", "BPS_SERVER_ID": "3", "BPS_SPARE_SERVERS": "1"},
     "BPS_SERVER_ID=3 out of range"),
])
def test_env_errors_name_the_variable(change: dict, fragment: str) -> None:
    environ = {k: v for k, v in {**BASE, **change}.items() if v is not None}
    with pytest.raises(EnvError, match=re.escape(fragment)):
        ClusterEnv.from_environ(environ)


def test_spare_servers_and_their_ids() -> None:
    """Unset: servers are not replaced; a spare's id follows the servers'."""
    assert not ClusterEnv.from_environ(BASE).replaces_servers
    env = ClusterEnv.from_environ({**BASE, "BPS_SPARE_SERVERS": "0"})
    assert env.replaces_servers and env.spare_servers == 0
    spare = ClusterEnv.from_environ({**BASE, "DMLC_ROLE": "server", "BPS_SERVER_ID": "2",
                                     "BPS_SPARE_SERVERS": "1"})
    assert (spare.server_id, spare.spare_servers) == (2, 1)
