"""bpslaunch: the role launcher, the loopback cluster, failure propagation, teardown."""

from __future__ import annotations

import io
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

from bps.launch.supervisor import Supervisor
from tests.harness.ps_job import BPSLAUNCH, TEST_ENV, default_sigint, run_command

PY = sys.executable


def test_failing_worker_stops_everything_and_exit_code_propagates() -> None:
    script = ("import os, sys, time\n"
              "if os.environ['DMLC_WORKER_ID'] == '1': sys.exit(3)\n"
              "time.sleep(600)\n")
    code, output = run_command(BPSLAUNCH + ["local", "--workers", "2", "--servers", "1", "--",
                                            PY, "-c", script], TEST_ENV, timeout=60)
    assert code == 3, output
    assert "[bpslaunch] worker1.0 exited with code 3; stopping all processes" in output


def test_with_min_workers_a_failing_worker_node_leaves_and_the_job_goes_on() -> None:
    """The launcher's side of --min-workers: worker 1 fails, the others are not stopped
    and finish; two failures with one to spare stop everything (worker 0 would otherwise
    sleep for ten minutes)."""
    script = ("import os, sys\n"
              "if os.environ['DMLC_WORKER_ID'] == '1': sys.exit(3)\n"
              "print('worker', os.environ['DMLC_WORKER_ID'], 'done', flush=True)\n")
    code, output = run_command(BPSLAUNCH + ["local", "--workers", "3", "--servers", "1",
                                            "--min-workers", "2", "--", PY, "-c", script],
                               TEST_ENV, timeout=60)
    assert "worker1.0 exited with code 3; worker node 1 leaves the job" in output, output
    assert "worker 0 done" in output and "worker 2 done" in output, output
    assert "stopping all processes" not in output.split("leaves the job")[0], output
    script = ("import os, sys\n"
              "if os.environ['DMLC_WORKER_ID'] != '0': sys.exit(3)\n"
              "import time; time.sleep(600)\n")
    code, output = run_command(BPSLAUNCH + ["local", "--workers", "3", "--servers", "1",
                                            "--min-workers", "2", "--", PY, "-c", script],
                               TEST_ENV, timeout=60)
    assert code == 3 and "exited with code 3; stopping all processes" in output, output


def test_min_workers_out_of_range_is_refused_before_anything_starts() -> None:
    code, output = run_command(BPSLAUNCH + ["local", "--workers", "2", "--min-workers", "3",
                                            "--", PY, "-c", "pass"], TEST_ENV, timeout=60)
    assert code == 2 and "--min-workers=3 out of range: expected 1 to --workers (2)" in output
    code, output = run_command(BPSLAUNCH + ["local", "--workers", "2", "--", PY, "-c", "pass"],
                               {**TEST_ENV, "BPS_MIN_WORKERS": "0"}, timeout=60)
    assert code == 2 and "BPS_MIN_WORKERS=0 out of range" in output, output
    assert "[scheduler]" not in output


def test_max_restarts_starts_a_failed_worker_node_again_with_all_its_processes(
        tmp_path: Path) -> None:
    """--max-restarts 1: local rank 0 of node 1 fails on its first run; both processes of
    node 1 are started again (rank 1 stopped first), with the same environment, and the
    job ends 0. A second failure (node 2, once node 1 ran again), with no restart left,
    is a node leaving as before."""
    script = ("import os, sys, time, pathlib\n"
              "folder = pathlib.Path(sys.argv[1])\n"
              "node, rank = os.environ['DMLC_WORKER_ID'], os.environ['BYTEPS_LOCAL_RANK']\n"
              "failed = folder / 'failed1'\n"
              "with open(folder / f'runs{node}.{rank}', 'a') as runs:\n"
              "    runs.write('after ' if failed.exists() else 'before ')\n"
              "if node == '1' and not failed.exists():\n"
              "    if rank == '0':\n"
              "        failed.write_text('')\n"
              "        sys.exit(3)\n"
              "    time.sleep(600)  # stopped to restart its node\n"
              "if node == '2':\n"
              "    again = folder / 'runs1.0'\n"
              "    deadline = time.monotonic() + 50\n"
              "    while 'after' not in (again.read_text() if again.exists() else ''):\n"
              "        assert time.monotonic() < deadline\n"
              "        time.sleep(0.05)\n"
              "    sys.exit(4)\n")
    code, output = run_command(BPSLAUNCH + ["local", "--workers", "3", "--servers", "1",
                                            "--local-size", "2", "--min-workers", "1",
                                            "--max-restarts", "1", "--", PY, "-c", script,
                                            str(tmp_path)], TEST_ENV, timeout=90)
    assert "worker1.0 exited with code 3; restarting worker node 1 (0 restart(s) left)" \
        in output, output
    runs = {p.name: p.read_text().split() for p in tmp_path.iterdir() if "runs" in p.name}
    assert runs["runs1.0"] == ["before", "after"], (runs, output)
    assert runs["runs1.1"][-1] == "after", (runs, output)  # its second start
    assert all(len(runs[f"runs{n}.{r}"]) == 1 for n in (0, 2) for r in (0, 1)), runs
    assert "exited with code 4; worker node 2 leaves the job" in output, output
    assert code == 0, output


def test_max_restarts_is_refused_before_anything_starts_without_spare_nodes() -> None:
    for options in (["--max-restarts", "1"], ["--min-workers", "2", "--max-restarts", "1"],
                    ["--min-workers", "1", "--max-restarts", "-1"]):
        code, output = run_command(BPSLAUNCH + ["local", "--workers", "2", *options, "--",
                                                PY, "-c", "pass"], TEST_ENV, timeout=60)
        assert code == 2, output
        assert "[scheduler]" not in output, output
        if "-1" in options:
            assert "--max-restarts=-1 must be >= 0" in output, output
        else:
            assert "--max-restarts=1 needs --min-workers (or BPS_MIN_WORKERS) below " \
                "--workers (2)" in output, output


def test_local_sets_roles_ranks_and_prefixes_output() -> None:
    script = ("import os\nprint('env', *(os.environ[v] for v in ('DMLC_ROLE', 'DMLC_WORKER_ID',"
              " 'BYTEPS_LOCAL_RANK', 'BYTEPS_LOCAL_SIZE', 'DMLC_NUM_WORKER', 'DMLC_NUM_SERVER',"
              " 'BPS_LOCAL_MASTER_ADDR', 'BPS_LOCAL_MASTER_PORT')))\n")
    code, output = run_command(BPSLAUNCH + ["local", "--workers", "2", "--servers", "1",
                                            "--local-size", "2", "--", PY, "-c", script],
                               TEST_ENV, timeout=60)
    assert code == 0, output
    lines = {line.split("] ")[0][1:]: line.split() for line in output.splitlines()
             if "] env " in line}
    assert sorted(lines) == ["worker0.0", "worker0.1", "worker1.0", "worker1.1"], output
    for name, fields in lines.items():
        node, rank = name.removeprefix("worker").split(".")
        assert fields[2:9] == ["worker", node, rank, "2", "2", "1", "127.0.0.1"], fields
    # one torch.distributed rendezvous per node, shared by its local ranks
    assert lines["worker0.0"][9] == lines["worker0.1"][9] != lines["worker1.0"][9]


def test_interrupt_tears_everything_down(tmp_path: Path) -> None:
    script = (f"import os, time\nopen(os.path.join({str(tmp_path)!r}, str(os.getpid())), 'w')"
              ".close()\ntime.sleep(600)\n")
    proc = subprocess.Popen(BPSLAUNCH + ["local", "--workers", "2", "--servers", "1", "--",
                                         PY, "-c", script], env={**os.environ, **TEST_ENV},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True, text=True, preexec_fn=default_sigint)
    try:
        deadline = time.monotonic() + 60
        while len(os.listdir(tmp_path)) < 2:  # waiting for a condition, with a deadline
            assert time.monotonic() < deadline and proc.poll() is None, proc.poll()
            time.sleep(0.05)
        pids = [int(name) for name in os.listdir(tmp_path)]
        proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=30)
        assert proc.returncode == 128 + signal.SIGINT, output
        for pid in pids:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                continue
            raise AssertionError(f"worker pid {pid} survived the interrupt")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_role_worker_starts_local_size_copies() -> None:
    env = {**TEST_ENV, "DMLC_ROLE": "worker", "DMLC_WORKER_ID": "1", "DMLC_NUM_WORKER": "2",
           "DMLC_NUM_SERVER": "1", "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": "9",
           "BYTEPS_LOCAL_SIZE": "3"}
    script = "import os; print('rank', os.environ['BYTEPS_LOCAL_RANK'])"
    code, output = run_command(BPSLAUNCH + [PY, "-c", script], env, timeout=60)
    assert code == 0, output
    assert sorted(line for line in output.splitlines() if "rank" in line) == \
        ["[worker1.0] rank 0", "[worker1.1] rank 1", "[worker1.2] rank 2"]


def test_bad_environment_names_the_variable() -> None:
    base = {"DMLC_ROLE": "", "DMLC_NUM_WORKER": "2", "DMLC_NUM_SERVER": "1",
            "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": "9000"}
    cases = [({}, "DMLC_ROLE is not set"),
             ({"DMLC_ROLE": "boss"}, "DMLC_ROLE='boss'"),
             ({"DMLC_ROLE": "server", "DMLC_NUM_SERVER": "x"}, "DMLC_NUM_SERVER='x'"),
             ({"DMLC_ROLE": "worker"}, "DMLC_WORKER_ID is not set"),
             ({"DMLC_ROLE": "worker", "DMLC_WORKER_ID": "2"}, "DMLC_WORKER_ID=2 out of range"),
             ({"DMLC_ROLE": "scheduler", "BPS_TIMEOUT": "-1"}, "BPS_TIMEOUT='-1'")]
    for extra, fragment in cases:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "BPS_"))}
        env.update({**base, **extra})
        proc = subprocess.run(BPSLAUNCH + [PY, "-c", "pass"], env=env, capture_output=True,
                              text=True, timeout=60)
        assert proc.returncode == 2, (extra, proc.stderr)
        assert fragment in proc.stderr, (extra, proc.stderr)


def test_help_and_a_bare_call_show_the_three_modes() -> None:
    """``bpslaunch --help``, and ``bpslaunch`` with no DMLC_ROLE and no command, print the
    usage of every mode with an example of each."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "BPS_"))}
    helped = subprocess.run(BPSLAUNCH + ["--help"], env=env, capture_output=True, text=True,
                            timeout=60)
    bare = subprocess.run(BPSLAUNCH, env=env, capture_output=True, text=True, timeout=60)
    assert helped.returncode == 0 and bare.returncode == 2, (helped.stderr, bare.stderr)
    assert bare.stderr == helped.stdout
    for example in ("DMLC_ROLE=scheduler", "bpslaunch local --workers 2",
                    "bpslaunch netem --nodes 4"):
        assert example in helped.stdout, helped.stdout


def test_every_target_of_the_table_is_listed_and_runs_its_module() -> None:
    """Each sub-command of ``bpslaunch``'s table has its line in ``--help`` and reaches its
    own module: ``bpslaunch NAME --help`` is that module's argparse usage, exit code 0."""
    from bps.launch.cli import TARGETS, USAGE
    assert sorted(TARGETS) == ["keygen", "local", "netem"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "BPS_"))}
    for name, target in TARGETS.items():
        line = next(line for line in USAGE.splitlines() if f"bpslaunch {name} " in line)
        assert line.split() == ["bpslaunch", *target.synopsis.split(), *target.summary.split()]
        helped = subprocess.run(BPSLAUNCH + [name, "--help"], env=env, capture_output=True,
                                text=True, timeout=60)
        assert helped.returncode == 0, (name, helped.stderr)
        assert helped.stdout.startswith(f"usage: bpslaunch {name} "), (name, helped.stdout)


def test_the_others_name_a_failure_before_anything_is_stopped(tmp_path: Path) -> None:
    """One child fails; another, told of it (through a pipe here, by the scheduler in a
    job), needs a moment to say so and exit: it gets that moment and its line is in the
    output, and the supervisor returns as soon as it has exited."""
    told = tmp_path / "told"
    os.mkfifo(told)
    out = io.StringIO()
    with Supervisor(out=out, report=60) as supervisor:
        supervisor.spawn([PY, "-c", f"open({str(told)!r}, 'w').write('x'); raise SystemExit(3)"],
                         dict(os.environ), "failing")
        supervisor.spawn([PY, "-c", f"import time; open({str(told)!r}).read(); time.sleep(0.3); "
                                    "print('the other one failed', flush=True); "
                                    "raise SystemExit(1)"], dict(os.environ), "peer")
        started = time.monotonic()
        code = supervisor.wait()
        waited = time.monotonic() - started
    assert code == 3, out.getvalue()
    assert "[peer] the other one failed" in out.getvalue(), out.getvalue()
    assert waited < 30, waited  # the peer's exit ended the wait, not the report window


class GoneReader(io.StringIO):
    """Where the output goes when its reader went away (``bpslaunch ... | head``)."""

    def write(self, text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")


def test_a_reader_that_goes_away_does_not_hold_the_job() -> None:
    """Output that can no longer be written is dropped; the children's exits still end
    the wait (a child that prints a lot is drained, so it does not block either)."""
    supervisor = Supervisor(out=GoneReader())
    with supervisor:
        supervisor.spawn([PY, "-c", "for i in range(100000): print(i)"], dict(os.environ),
                         "chatty")
        finished = threading.Thread(target=lambda: supervisor.wait(), daemon=True)
        finished.start()
        finished.join(timeout=60)
    assert not finished.is_alive(), "wait() hung after its output went away"


def test_teardown_is_bounded_when_a_child_cannot_be_waited_for() -> None:
    # A SIGTERM turns into SystemExit wherever the launcher's main thread is; struck just
    # after Popen.wait took its internal lock, it leaves that lock held, and a teardown
    # that then waits without a timeout waits for itself forever.
    out = io.StringIO()
    supervisor = Supervisor(grace=0.5, out=out)
    child = supervisor.spawn([sys.executable, "-c", "import time; time.sleep(120)"],
                             dict(os.environ), "sleeper")
    child.process._waitpid_lock.acquire()  # the state that SystemExit left behind
    teardown = threading.Thread(target=supervisor.stop_all, daemon=True)
    teardown.start()
    teardown.join(timeout=60)
    assert not teardown.is_alive(), "stop_all() hung"
    assert "sleeper (pid" in out.getvalue() and "not reaped" in out.getvalue()
    state = Path(f"/proc/{child.process.pid}/stat").read_text().split(")")[-1].split()[0]
    assert state == "Z", state  # killed, left for init to reap
    child.process._waitpid_lock.release()
    child.process.wait(timeout=10)


FORGETS_SHUTDOWN = """
import sys, torch, bps
bps.init()
model = torch.nn.Linear(8, 1)
trainer = bps.DistributedTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1))
for _ in range(3):
    trainer.zero_grad()
    model(torch.ones(4, 8)).sum().backward()
    trainer.step()
print("trained", flush=True)
if bps.rank() == 1:
    sys.exit(0)
"""


def test_a_job_that_forgets_shutdown_succeeds_with_a_warning() -> None:
    """Training finished, no bps.shutdown(): the end of the script (rank 0) and
    sys.exit(0) (rank 1) leave as shutdown() would; the job exits 0, no ERROR line."""
    code, output = run_command(BPSLAUNCH + ["local", "--workers", "2", "--servers", "1", "--",
                                            PY, "-c", FORGETS_SHUTDOWN], TEST_ENV, timeout=120)
    assert code == 0, output
    assert output.count("trained") == 2, output
    assert "ended without bps.shutdown()" in output, output
    assert "ERROR" not in output and "failed" not in output, output
    assert "all workers finished" in output, output


def test_a_mistyped_command_is_refused_before_anything_starts() -> None:
    for program, hint in ((".venv/bin/pyhton", "no such file"), ("pyhton", "activate")):
        code, output = run_command(BPSLAUNCH + ["local", "--", program, "x.py"], TEST_ENV,
                                   timeout=60)
        assert code == 2, output
        assert f"bpslaunch local: error: command not found: {program!r}" in output, output
        assert hint in output and "Traceback" not in output and "[scheduler]" not in output


def test_a_script_without_bps_init_ends_at_once_and_quietly() -> None:
    """No worker joins: the scheduler and servers, which would wait for them, are
    stopped as soon as the workers exit 0, without the grace period or their ERRORs."""
    started = time.monotonic()
    code, output = run_command(BPSLAUNCH + ["local", "--workers", "2", "--servers", "1", "--",
                                            PY, "-c", "print('hello')"], TEST_ENV, timeout=60)
    elapsed = time.monotonic() - started
    assert code == 0, output
    assert output.count("hello") == 2, output
    assert "no worker called bps.init()" in output, output
    assert "ERROR" not in output and "SIGTERM" not in output, output
    assert "services still running" not in output, output  # not the grace period's stop
    assert elapsed < Supervisor().grace + 30, (elapsed, output)


LOCAL_RANK_RAISES = """
import torch, bps
bps.init()
model = torch.nn.Linear(8, 1)
trainer = bps.DistributedTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1))
for step in range(2):
    if step == 1 and bps.rank() == 1:
        raise RuntimeError("boom")
    trainer.zero_grad()
    model(torch.ones(4, 8)).sum().backward()
    trainer.step()
bps.shutdown()
"""


def test_a_failing_local_rank_leaves_no_stray_abort() -> None:
    """2 nodes x 2 local ranks, rank 1 raises: every process names the failure and ends;
    none aborts in the teardown of its node's gloo group ("terminate called ...")."""
    code, output = run_command(BPSLAUNCH + ["local", "--workers", "2", "--servers", "1",
                                            "--local-size", "2", "--", PY, "-c",
                                            LOCAL_RANK_RAISES],
                               {**TEST_ENV, "BPS_TIMEOUT": "60"}, timeout=180)
    assert code != 0, output
    assert "RuntimeError: boom" in output, output
    assert "terminate called" not in output and "Aborted" not in output, output


def test_keygen_makes_the_missing_folders_private(tmp_path: Path) -> None:
    """``bpslaunch keygen ~/.bps/cluster.key`` (docs/runtime.md) on a host without
    ``~/.bps``: the folders are made, mode 0700, the key file 0600."""
    home = tmp_path / "home"
    home.mkdir(mode=0o755)
    home.chmod(0o755)
    done = subprocess.run(BPSLAUNCH + ["keygen", "~/.bps/keys/cluster.key"],
                          env={**os.environ, "HOME": str(home)}, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    key = home / ".bps" / "keys" / "cluster.key"
    assert stat.S_IMODE((home / ".bps").stat().st_mode) == 0o700
    assert stat.S_IMODE(key.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert stat.S_IMODE(home.stat().st_mode) == 0o755  # an existing folder stays as it was
