"""A role process: stopped while it exits, or finished, it leaves no traceback; a server
of a job with node agents runs under SCHED_BATCH."""

from __future__ import annotations

import subprocess
import sys

import pytest

from bps.common.env import ClusterEnv
from bps.server.role import server_batch_policy
from tests.harness.env_vars import BASE

SIGTERM_WHILE_EXITING = """
import atexit, os, signal, types
from bps.server.role import serve, setup_process
setup_process()
def stopped_by_the_launcher():
    os.kill(os.getpid(), signal.SIGTERM)
    print("exit finished", flush=True)
atexit.register(stopped_by_the_launcher)
try:
    serve(types.SimpleNamespace(role="none", sched_batch=False))
except ValueError:
    pass
"""


def test_a_role_stopped_while_it_exits_ends_without_a_traceback() -> None:
    """bpslaunch sends SIGTERM to every role when one fails; a server already running its
    exit callbacks finishes them instead of printing a SystemExit traceback."""
    result = subprocess.run([sys.executable, "-c", SIGTERM_WHILE_EXITING],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "exit finished" in result.stdout, result.stderr
    assert "Traceback" not in result.stderr, result.stderr


ROLE_THAT_ENDS = """
import atexit, logging
from bps.server.role import end_process, setup_process
setup_process()
atexit.register(lambda: print("finalized", flush=True))
print("buffered line")  # stdout is a pipe here: block-buffered, not yet written
logging.getLogger("bps.server").info("last log line")
end_process(7)
"""


def test_a_finished_role_keeps_its_output_and_code_but_skips_finalization() -> None:
    """A scheduler or server that has finished flushes what it printed and logged and
    exits with its code, without the interpreter's finalization (atexit included)."""
    result = subprocess.run([sys.executable, "-c", ROLE_THAT_ENDS],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 7, result.stderr
    assert result.stdout == "buffered line\n", result.stdout
    assert "bps.server INFO: last log line" in result.stderr, result.stderr
    assert "finalized" not in result.stdout


@pytest.mark.parametrize(("role", "agents", "switch", "batch"), [
    ("server", "1", "1", True),    # a job with node agents: its servers yield at wake-up
    ("server", "0", "1", False),   # workers with the engine in process wait for replies
    ("server", "1", "0", False),   # BPS_SCHED_BATCH=0: the default policy
    ("scheduler", "1", "1", False),
])
def test_servers_of_a_job_with_node_agents_run_under_sched_batch(role, agents, switch,
                                                                 batch) -> None:
    environ = {**BASE, "DMLC_ROLE": role, "BPS_NODE_AGENT": agents, "BPS_SCHED_BATCH": switch}
    if role == "server":
        environ["BPS_SERVER_ID"] = "0"
    assert server_batch_policy(ClusterEnv.from_environ(environ)) is batch
