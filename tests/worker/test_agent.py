"""The node agent (``BPS_NODE_AGENT=1``) end to end on real clusters (``bpslaunch local``):
the engine runs in a process of its own beside local rank 0, the gradients cross in
shared memory. The trainer jobs of tests/harness/trainer_job.py end bit for bit where
the numpy replay of the pipeline says (as they do without the agent); an agent killed
outright fails its training process within seconds, naming the node; a training process
killed outright takes its agent with it; nothing stays in ``/dev/shm``.

This module is also the worker program (``python -m tests.worker.test_agent
CONFIG_JSON``): trainer_job's ``train``, or its own loop for an inf injected into one
rank's gradient and for a job that trains until it is killed.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from bps.launch.local import sibling_pids
from tests.harness.paths import ROOT
from tests.harness.ps_job import BPSLAUNCH, default_sigint
from tests.harness.trainer_job import (
    COMM_LRS,
    COMM_SHAPES,
    MOMENTUM,
    SHAPES,
    SIM_CASES,
    SIM_LRS,
    comm_reference,
    load_params,
    load_reports,
    make_model,
    simulate,
    targets,
    worker_main,
)
from tests.harness.trainer_job import launch as trainer_launch
from tests.harness.trainer_job import train as trainer_train

AGENT = {"BPS_NODE_AGENT": "1"}
COMMON = {"ef": "vanilla", "momentum": "nesterov", "fp16": False, "min_compress_bytes": 1000}
INJECT_STEP = 2
SHM = Path("/dev/shm")


# ----------------------------------------------------------------------------- worker side


def train(cfg: dict, run: dict, rank: int, shapes: dict, out: Path) -> dict:
    """trainer_job's ``train``, except for runs with ``inject`` or ``hold``."""
    import torch

    import bps

    if not run.get("inject") and not run.get("hold"):
        report = trainer_train(cfg, run, rank, shapes, out)
        engine = bps.core.runtime.get().engine
        report["engine"] = type(engine).__name__
        report["group"] = type(bps.core.runtime.get().group).__name__
        report["policies"] = {"trainer": policies(os.getpid()),
                              "agent": policies(getattr(engine, "pid", None)),
                              "servers": sorted({p for pid in sibling_pids("server")
                                                 for p in policies(pid)})}
        return report

    tag = run.get("tag", "")
    model = make_model(rank, shapes)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg["lrs"][0], momentum=MOMENTUM)
    trainer = bps.DistributedTrainer(model, optimizer, run["params"])
    goal = {name: torch.from_numpy(t) for name, t in targets(rank, shapes).items()}
    steps = 10**6 if run.get("hold") else len(cfg["lrs"])
    skipped = []
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = cfg["lrs"][step % len(cfg["lrs"])]
        trainer.zero_grad()
        bad = {n: goal[n].clone() for n in shapes}
        if run.get("inject") and step == INJECT_STEP and rank == 1:
            # grad = w - target: inf, or what the run names (beyond float16's range)
            bad[run["inject"]].view(-1)[0] = -run.get("inject_value", float("inf"))
        loss = sum((getattr(model, n) * (getattr(model, n).detach() - bad[n])).sum()
                   for n in shapes)
        loss.backward()
        trainer.step()
        skipped.append(trainer.stats()["skipped"])
        if run.get("hold") and step == 0:  # the test may kill processes from now on
            engine = bps.core.runtime.get().engine
            pids = {"trainer": os.getpid(), "agent": getattr(engine, "pid", None)}
            (out / f"pids{rank}.json.tmp").write_text(json.dumps(pids))
            os.replace(out / f"pids{rank}.json.tmp", out / f"pids{rank}.json")
    np.savez(out / f"params{tag}{rank}.npz",
             **{n: getattr(model, n).detach().numpy() for n in shapes})
    trainer.close()
    return {"skipped": skipped}


def policies(pid: int | None) -> list[str]:
    """The scheduling policies of process ``pid``'s threads (SCHED_OTHER, SCHED_BATCH)."""
    if pid is None:
        return []
    names = {os.SCHED_OTHER: "SCHED_OTHER", os.SCHED_BATCH: "SCHED_BATCH"}
    found = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            found.add(names.get(os.sched_getscheduler(int(task.name)), "other"))
        except OSError:  # the thread ended meanwhile
            pass
    return sorted(found)


def ddp_main(cfg: dict) -> int:
    """A worker of the DDP communication hook: ``cfg["runs"][0]`` for ``cfg["lrs"]``."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import bps
    import bps.ddp

    class Closed(torch.nn.Module):
        """``forward(goals)``: a loss whose gradient is ``w - goal`` exactly."""

        def forward(self, goals: dict):
            return sum((getattr(self, n) * (getattr(self, n).detach() - goals[n])).sum()
                       for n in SHAPES)

    torch.set_num_threads(1)
    bps.init()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    module = Closed()
    for name, value in make_model(rank, SHAPES).named_parameters():
        module.register_parameter(name, value)
    ddp = DistributedDataParallel(module)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=cfg["lrs"][0], momentum=MOMENTUM)
    state = bps.ddp.HookState(cfg["runs"][0]["params"], optimizer=optimizer, module=module)
    ddp.register_comm_hook(state, bps.ddp.ps_hook)
    goals = {n: torch.from_numpy(t) for n, t in targets(rank, SHAPES).items()}
    for lr in cfg["lrs"]:
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.zero_grad()
        ddp(goals).backward()
        optimizer.step()
    out = Path(cfg["out"])
    np.savez(out / f"paramsddp{rank}.npz",
             **{n: getattr(module, n).detach().numpy() for n in SHAPES})
    engine = type(bps.core.runtime.get().engine).__name__
    (out / f"report{rank}.json").write_text(json.dumps({"ddp": {"engine": engine}}))
    state.close()
    dist.barrier()
    bps.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as tests/frontends/test_ddp.py: no gloo teardown


# ----------------------------------------------------------------------------- test side


def launch(cfg: dict, tmp: Path, **kwargs) -> subprocess.CompletedProcess:
    """trainer_job's launch of this module, with the node agent on."""
    env = {**AGENT, **kwargs.pop("env", {})}
    return trainer_launch(cfg, tmp, env=env, module=__name__, **kwargs)


def bps_segments(pid: int | None = None) -> list[str]:
    """The node agent's segments in /dev/shm (of the process ``pid``)."""
    return sorted(p.name for p in SHM.glob("bps-*")
                  if pid is None or p.name.split("-")[-2] == str(pid))


SIM_RUNS = [
    {"tag": "onebit", "params": {**SIM_CASES["onebit"], **COMMON}, "compressed_from": 0},
    # worker and server chains with RNG state
    {"tag": "randomk", "params": {**SIM_CASES["randomk"], **COMMON}, "compressed_from": 0},
    {"tag": "warmup", "params": {**SIM_CASES["onebit"], **COMMON, "warmup_steps": 2},
     "compressed_from": 2},
]
# an inf in a compressed partition, and in a member of a raw bucket (its members are
# announced in one frame and pushed together)
INJECT_RUNS = [{"tag": f"inject_{name}", "inject": name,
                "params": {**SIM_CASES["onebit"], **COMMON, "nonfinite": "skip"}}
               for name in ("big", "small")]


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


# the device path through the agent differs only in the out tensors it is handed: the
# host case covers the agent's part
@pytest.mark.parametrize("env", [
    pytest.param({}, id="host"),
    pytest.param({"BPS_DEVICE_KERNELS": "1"}, id="device-forced", marks=pytest.mark.slow)])
def test_trainer_through_the_agent_matches_the_simulation(tmp_path, env):
    # 3 nodes, 2 servers (the servers add the pushes in node order): compressed
    # partitions, raw buckets, warmup, and a step that an inf on one rank skips
    # (Skipped results, rollback of worker and server chains through the agent); the
    # chains on the host, or the device path's staging forced onto CPU tensors
    before = bps_segments()
    # a process killed between making a segment and unlinking it leaves it behind: the
    # next start removes it, and only it (a live process's may be in use)
    stale, live = SHM / f"bps-test-{dead_pid()}-0", SHM / f"bps-test-{os.getpid()}-0"
    stale.write_bytes(b"\0" * 4096)
    live.write_bytes(b"\0" * 4096)
    try:
        result = launch({"runs": [*SIM_RUNS, *INJECT_RUNS], "lrs": SIM_LRS,
                         "stop": len(SIM_LRS), "pushes_per_step": 4}, tmp_path, workers=3,
                        servers=2, env=env)
        assert result.returncode == 0, result.stdout[-3000:]
        assert not stale.exists() and live.exists()
    finally:
        stale.unlink(missing_ok=True)
        live.unlink(missing_ok=True)
    reports = load_reports(tmp_path, 3)
    for run in SIM_RUNS:
        finals = load_params(tmp_path, 3, run["tag"])
        expected = simulate(run["params"], 3, SIM_LRS, run["compressed_from"])
        for rank in range(3):
            for name in SHAPES:
                np.testing.assert_array_equal(finals[rank][name], expected[name],
                                              err_msg=f"{run['tag']} {name} rank {rank}")
        assert reports[0][run["tag"]]["engine"] == "AgentProxy"
        assert reports[1][run["tag"]]["engine"] == "AgentProxy"
        # the agent and the servers yield to the training loop at wake-up (every thread,
        # ZeroMQ's too); the training process keeps the default policy
        assert reports[0][run["tag"]]["policies"] == {
            "trainer": ["SCHED_OTHER"], "agent": ["SCHED_BATCH"], "servers": ["SCHED_BATCH"]}
        steps = reports[0][run["tag"]]["steps"]
        assert [s["pushes"] for s in steps] == [4] * len(SIM_LRS), run["tag"]
    # the skipped step is as if never taken: the replay without it
    lrs = [lr for step, lr in enumerate(SIM_LRS) if step != INJECT_STEP]
    for run in INJECT_RUNS:
        expected = simulate(run["params"], 3, lrs)
        finals = load_params(tmp_path, 3, run["tag"])
        for rank in range(3):
            assert reports[rank][run["tag"]]["skipped"] == \
                [step == INJECT_STEP for step in range(len(SIM_LRS))], run["tag"]
            for name in SHAPES:
                np.testing.assert_array_equal(finals[rank][name], expected[name],
                                              err_msg=f"{run['tag']} {name} rank {rank}")
    assert "node agent" not in result.stdout  # no failure, no agent killed at the end
    # /dev/shm is the machine's: another test process's job may hold segments of its own
    # now; what this job (its scheduler's port) or a process now gone left is a leak
    port = re.search(r"scheduler listening on tcp://127\.0\.0\.1:(\d+)", result.stdout)[1]
    left = [name for name in set(bps_segments()) - set(before)
            if name.startswith(f"bps-{port}-") or gone(int(name.split("-")[-2]))]
    assert left == [], left


def test_two_local_ranks_round_where_the_pipeline_does(tmp_path):
    # 2 nodes x 2 local ranks: local rank 0 starts the agent, local rank 1 connects to it,
    # and the agent takes the node's sum of their shares in rank order (no gloo group);
    # bf16 and fp16 on the wire
    runs = [{"tag": comm, "params": {"momentum": "nesterov", "comm_dtype": comm}}
            for comm in ("bf16", "fp16")]
    result = launch({"runs": runs, "lrs": COMM_LRS, "stop": len(COMM_LRS),
                     "shapes": COMM_SHAPES}, tmp_path, workers=2, servers=2, local_size=2,
                    env={"BYTEPS_PARTITION_BYTES": "4000", "BPS_SCHED_BATCH": "0"},
                    timeout=180)
    assert result.returncode == 0, result.stdout[-3000:]
    reports = load_reports(tmp_path, 4)
    assert [r["bf16"]["engine"] for r in reports] == ["AgentProxy", "NoneType"] * 2
    assert reports[0]["bf16"]["policies"] == {  # BPS_SCHED_BATCH=0: the default policy
        "trainer": ["SCHED_OTHER"], "agent": ["SCHED_OTHER"], "servers": ["SCHED_OTHER"]}
    assert {r["bf16"]["group"] for r in reports} == {"AgentGroup"}
    assert "terminate called" not in result.stdout  # no gloo group to abort at the exit
    for comm in ("bf16", "fp16"):
        expected = comm_reference(comm)
        for rank, final in enumerate(load_params(tmp_path, 4, comm)):
            for name in COMM_SHAPES:
                np.testing.assert_array_equal(final[name], expected[name],
                                              err_msg=f"{comm} {name} {rank}")


def test_a_lone_local_rank_rounds_its_buckets_where_the_pipeline_does(tmp_path):
    # 2 nodes of one local rank: the members of a raw bucket reach the agent in one
    # frame, are divided in float32 and cast into a bucket of the wire's dtype, and land
    # together; a share beyond float16's range in one of them skips the step everywhere
    runs = [{"tag": comm, "params": {"momentum": "nesterov", "comm_dtype": comm}}
            for comm in ("bf16", "fp16")]
    runs.append({"tag": "overflow", "inject": "small", "inject_value": 1e6,
                 "params": {"momentum": "nesterov", "comm_dtype": "fp16",
                            "nonfinite": "skip"}})
    result = launch({"runs": runs, "lrs": COMM_LRS, "stop": len(COMM_LRS),
                     "shapes": COMM_SHAPES}, tmp_path, workers=2, servers=1,
                    env={"BYTEPS_PARTITION_BYTES": "4000"}, timeout=180)
    assert result.returncode == 0, result.stdout[-3000:]
    reports = load_reports(tmp_path, 2)
    assert [r["bf16"]["engine"] for r in reports] == ["AgentProxy"] * 2
    skipped_lrs = [lr for step, lr in enumerate(COMM_LRS) if step != INJECT_STEP]
    expected = {"bf16": comm_reference("bf16", local=1),
                "fp16": comm_reference("fp16", local=1),
                "overflow": comm_reference("fp16", local=1, lrs=skipped_lrs)}
    assert [r["overflow"]["skipped"] for r in reports] == \
        [[step == INJECT_STEP for step in range(len(COMM_LRS))]] * 2
    for tag, reference in expected.items():
        for rank, final in enumerate(load_params(tmp_path, 2, tag)):
            for name in COMM_SHAPES:
                np.testing.assert_array_equal(final[name], reference[name],
                                              err_msg=f"{tag} {name} {rank}")


def test_resume_from_state_dict_through_the_agent(tmp_path):
    # state_dict / load_state_dict of worker and server chains (randomk: error,
    # momentum, RNG) cross the agent's socket as pickles
    params = {"compressor": "randomk", "k": 0.1, **COMMON}
    lrs = SIM_LRS  # powers of two: the replay is exact
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    whole.mkdir()
    resumed.mkdir()
    run = launch({"runs": [{"params": params}], "lrs": lrs, "stop": 5, "save_at": 2},
                 whole, servers=2)
    assert run.returncode == 0, run.stdout[-3000:]
    for r in range(2):
        (resumed / f"ckpt{r}.pt").write_bytes((whole / f"ckpt{r}.pt").read_bytes())
    run = launch({"runs": [{"params": params}], "lrs": lrs, "start": 2, "stop": 5}, resumed,
                 servers=2, env={"BPS_JOB_SEED": "999"})
    assert run.returncode == 0, run.stdout[-3000:]
    expected = simulate(params, 2, lrs)
    for r in range(2):
        for name in SHAPES:
            np.testing.assert_array_equal(load_params(whole, 2)[r][name], expected[name])
            np.testing.assert_array_equal(load_params(resumed, 2)[r][name], expected[name])


def test_ddp_hook_through_the_agent_matches_the_simulation(tmp_path):
    params = {**SIM_CASES["onebit"], **COMMON}
    result = launch({"ddp": True, "runs": [{"params": params}], "lrs": SIM_LRS}, tmp_path,
                    workers=2, servers=2)
    assert result.returncode == 0, result.stdout[-3000:]
    assert load_reports(tmp_path, 2)[0]["ddp"]["engine"] == "AgentProxy"
    expected = simulate(params, 2, SIM_LRS)
    for rank, final in enumerate(load_params(tmp_path, 2, "ddp")):
        for name in SHAPES:
            np.testing.assert_array_equal(final[name], expected[name],
                                          err_msg=f"{name} rank {rank}")


HOLD = {"runs": [{"params": {**SIM_CASES["onebit"], **COMMON}, "hold": True}],
        "lrs": [0.01]}


def start_holding(tmp: Path, local_size: int = 1) -> subprocess.Popen:
    """A job of 2 nodes (1 of ``local_size`` local ranks) that trains until a process of
    it is killed."""
    cfg = {"shapes": SHAPES, **HOLD, "out": str(tmp)}
    workers = "2" if local_size == 1 else "1"
    cmd = [*BPSLAUNCH, "local", "--workers", workers, "--servers", "1", "--local-size",
           str(local_size), "--", sys.executable, "-m", __name__, json.dumps(cfg)]
    env = {**os.environ, **AGENT, "BPS_TIMEOUT": "20", "BYTEPS_PARTITION_BYTES": "400"}
    # SIGINT at its default: a suite started in the background (``make test &``, nohup)
    # ignores it, and the processes of the job would keep ignoring it
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            preexec_fn=default_sigint)


def wait_for_pids(job: subprocess.Popen, tmp: Path, timeout: float = 120,
                  rank: int = 0) -> dict:
    deadline = time.monotonic() + timeout
    path = tmp / f"pids{rank}.json"
    while not path.exists():
        if job.poll() is not None or time.monotonic() > deadline:
            output = job.communicate()[0] if job.poll() is not None else ""
            raise AssertionError(f"the job did not start training: {output[-3000:]}")
        time.sleep(0.05)
    return json.loads(path.read_text())


def finish(job: subprocess.Popen, timeout: float) -> str:
    try:
        return job.communicate(timeout=timeout)[0]
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()


def gone(pid: int) -> bool:
    """Whether ``pid`` has ended (a zombie not reaped yet has ended too)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True


def kill_and_wait_for_the_other(tmp_path, victim: str, other: str, limit: float
                                ) -> tuple[dict, subprocess.Popen, str]:
    """Start a holding job, SIGKILL its ``victim`` process ("agent" or "trainer") and
    wait at most ``limit`` s for the ``other`` to be gone; (pids, job, output)."""
    job = start_holding(tmp_path)
    try:
        pids = wait_for_pids(job, tmp_path)
        os.kill(pids[victim], signal.SIGKILL)
        deadline = time.monotonic() + limit
        while not gone(pids[other]):
            assert time.monotonic() < deadline, f"the {other} outlived the {victim}"
            time.sleep(0.05)
        output = finish(job, timeout=60)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    return pids, job, output


@pytest.mark.slow  # test_a_killed_agent_fails_every_local_rank: the same, two ranks
def test_a_killed_agent_fails_its_training_process_naming_the_node(tmp_path):
    # 30 s: the failure, then the exit of a torch process
    pids, job, output = kill_and_wait_for_the_other(tmp_path, "agent", "trainer", 30)
    assert job.returncode != 0, output[-3000:]
    assert f"the node agent of worker node 0 (pid {pids['agent']}) was killed by SIGKILL; " \
        "it reported no error" in output, output[-3000:]
    assert gone(pids["trainer"])
    assert bps_segments(pids["trainer"]) == []


def test_a_killed_training_process_takes_its_agent_with_it(tmp_path):
    pids, job, output = kill_and_wait_for_the_other(tmp_path, "trainer", "agent", 10)
    assert job.returncode != 0, output[-3000:]
    assert bps_segments(pids["trainer"]) == []


def test_a_killed_local_rank_fails_its_node_naming_it(tmp_path):
    # local rank 1 of a node of 2, killed outright: the agent sees its connection end,
    # reports the node FAILED naming it and ends; local rank 0 then fails too (no gloo
    # group to hang or abort in); nothing of either stays in /dev/shm
    job = start_holding(tmp_path, local_size=2)
    try:
        pids = wait_for_pids(job, tmp_path)
        victim = wait_for_pids(job, tmp_path, rank=1)["trainer"]
        os.kill(victim, signal.SIGKILL)
        output = finish(job, timeout=60)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode != 0, output[-3000:]
    assert f"worker node 0: local rank 1 (pid {victim}): its training process (pid " \
        f"{victim}) ended without closing bps" in output, output[-3000:]
    assert gone(pids["agent"]) and gone(pids["trainer"])
    assert bps_segments(pids["trainer"]) == [] and bps_segments(victim) == []


def test_a_killed_agent_fails_every_local_rank(tmp_path):
    job = start_holding(tmp_path, local_size=2)
    try:
        pids = wait_for_pids(job, tmp_path)
        other = wait_for_pids(job, tmp_path, rank=1)["trainer"]
        os.kill(pids["agent"], signal.SIGKILL)
        output = finish(job, timeout=60)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode != 0, output[-3000:]
    assert f"the node agent of worker node 0 (pid {pids['agent']}) was killed by SIGKILL" \
        in output, output[-3000:]
    assert gone(pids["trainer"]) and gone(other)
    assert bps_segments(pids["trainer"]) == [] and bps_segments(other) == []


def test_ctrl_c_is_reported_through_the_agent(tmp_path):
    # Ctrl-C reaches a terminal's whole process group: the agent ignores it, the
    # training process reports it to the scheduler through the agent, which then ends
    job = start_holding(tmp_path)
    try:
        pids = wait_for_pids(job, tmp_path)
        os.kill(pids["agent"], signal.SIGINT)
        os.kill(pids["trainer"], signal.SIGINT)
        output = finish(job, timeout=60)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode != 0, output[-3000:]
    assert "worker 0 at 127.0.0.1 failed: KeyboardInterrupt" in output, output[-3000:]
    assert "node agent of worker node 0" not in output, output[-3000:]  # it did not die
    assert gone(pids["agent"]) and gone(pids["trainer"])
    assert bps_segments(pids["trainer"]) == []


if __name__ == "__main__":
    from bps.server.role import end_process

    config = json.loads(sys.argv[1])
    end_process(ddp_main(config) if config.get("ddp") else worker_main(config, train))
