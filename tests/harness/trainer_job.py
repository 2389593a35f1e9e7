"""The toy job of the front-end tests: real clusters started with ``bpslaunch local``.

This module is also the worker program: ``python -m tests.harness.trainer_job
CONFIG_JSON`` (from the repository's root) is what every worker process runs; a test
module with a ``train`` of its own runs itself the same way, handing that ``train`` to
``worker_main``. Each worker trains a tiny model whose gradient is known in closed form
(loss ``0.5 * ||w - t_rank||^2``, so ``grad = w - t_rank`` exactly), which lets the
tests replay the whole pipeline in numpy (``simulate``, ``replay``).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from bps.compressors import description, registered_names
from tests.harness.paths import ROOT

# big: compressed, 3 partitions; small and bias: raw, fused into one key (next to each
# other in backward order)
SHAPES = {"big": (30, 10), "small": (7,), "bias": (4,)}
MOMENTUM = 0.9


def initial_params(rank: int, shapes: dict) -> dict:
    rng = np.random.default_rng(rank)
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


def targets(rank: int, shapes: dict) -> dict:
    rng = np.random.default_rng(1000 + rank)
    return {name: (3 * rng.standard_normal(shape)).astype(np.float32)
            for name, shape in shapes.items()}


# ----------------------------------------------------------------------------- worker side


def make_model(rank: int, shapes: dict):
    import torch

    model = torch.nn.Module()
    for name, value in initial_params(rank, shapes).items():
        model.register_parameter(name, torch.nn.Parameter(torch.from_numpy(value)))
    model.register_buffer("counter", torch.tensor([rank * 7 + 1], dtype=torch.int64))
    return model


def closed_form(rank: int, shapes: dict):
    """A module whose ``forward(goals)`` is ``sum 0.5 * ||w - goal||^2`` over ``shapes``,
    starting from ``rank``'s parameters."""
    import torch

    class Closed(torch.nn.Module):
        def forward(self, goals: dict):
            return sum(0.5 * ((getattr(self, n) - goals[n]) ** 2).sum() for n in shapes)

    module = Closed()
    for name, value in initial_params(rank, shapes).items():
        module.register_parameter(name, torch.nn.Parameter(torch.from_numpy(value)))
    return module


def expect_errors(cfg: dict, rank: int, shapes: dict) -> list[str]:
    """Every bad dict, then a model that differs on rank 1: the error each raised."""
    import torch

    import bps

    errors = []
    for params in cfg["bad_params"]:
        model = make_model(rank, shapes)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=MOMENTUM)
        try:
            bps.DistributedTrainer(model, optimizer, params)
        except (ValueError, TypeError) as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
    if rank == 1:
        shapes = {**shapes, "big": (shapes["big"][0] + 1, *shapes["big"][1:])}
    model = make_model(rank, shapes)
    try:
        bps.DistributedTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1))
    except ValueError as exc:
        errors.append(f"{type(exc).__name__}: {exc}")
    return errors


def train(cfg: dict, run: dict, rank: int, shapes: dict, out: Path) -> dict:
    import torch

    import bps

    tag = run.get("tag", "")
    if cfg.get("device") == "cuda-local":  # a GPU of its own per local rank (NCCL)
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    else:
        device = torch.device(cfg.get("device", "cpu"))
    model = make_model(rank, shapes).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg["lrs"][0], momentum=MOMENTUM)
    trainer = bps.DistributedTrainer(model, optimizer, run["params"], **run.get("mode", {}))
    report = {"counter": int(model.counter.item()),
              "optimizer_momentum": optimizer.param_groups[0]["momentum"], "steps": []}
    start = cfg.get("start", 0)
    if start:
        checkpoint = torch.load(out / f"ckpt{rank}.pt", weights_only=False)
        model.load_state_dict(checkpoint["model"])
        trainer.load_state_dict(checkpoint["trainer"])
    goal = {name: torch.from_numpy(t).to(device) for name, t in targets(rank, shapes).items()}
    engine = bps.core.runtime.get().engine
    for step in range(start, cfg["stop"]):
        step_faults(cfg, rank, step, out)
        for group in optimizer.param_groups:
            group["lr"] = cfg["lrs"][step]
        trainer.zero_grad()
        # grad = w - t_rank, exact on every device (the backward of 0.5 * (w - t) ** 2
        # goes through pow(x, 1), which a GPU rounds differently)
        loss = sum((getattr(model, n) * (getattr(model, n).detach() - goal[n])).sum()
                   for n in shapes)
        pushes_before = engine.stats.pushes if engine is not None else 0
        loss.backward()
        leave(cfg, rank, step, out, "backward")
        pushes = run.get("pushes_per_step", cfg.get("pushes_per_step"))
        if engine is not None and pushes:
            # The hooks alone (no step() yet) must get every push answered.
            deadline = time.monotonic() + 20
            while engine.stats.pushes - pushes_before < pushes:
                if time.monotonic() > deadline:
                    raise AssertionError("gradients were not pushed before step()")
                time.sleep(0.005)
        trainer.step()
        report["steps"].append(trainer.stats())
        if engine is not None:
            report["steps"][-1]["pushes"] = engine.stats.pushes - pushes_before
        if cfg.get("save_at") == step + 1:
            torch.save({"model": model.state_dict(), "trainer": trainer.state_dict()},
                       out / f"ckpt{rank}.pt")
    np.savez(out / f"params{tag}{rank}.npz",
             **{n: getattr(model, n).detach().cpu().numpy() for n in shapes})
    resume_stopped(out)
    trainer.close()
    return report


def rejoin_train(cfg: dict, run: dict, rank: int, shapes: dict, out: Path) -> dict:
    """The ``train`` of a worker node that dies and joins again: ``cfg["kill"]`` = [rank,
    step]: that rank kills itself (SIGKILL) at the start of that step, once (a file
    marks it: the restarted process goes on), and bpslaunch stops its node's other
    local ranks; the other nodes' local ranks 0 wait at the start of step
    ``cfg["wait_at"]`` until the scheduler announced the join (generation 2; their
    other local ranks wait for them in the node's sum). A rank that joined saves the
    parameters it started from (``admitted<rank>.npz``); every rank its parameters at
    the start of each step (``history<rank>.npz``, ``name@step``) and at the end; the
    report: the step it started at, the steps it skipped. ``cfg["frontend"] == "ddp"``:
    the same loop through DDP and the bps hook, DDP over a group of the node's own
    processes (``bps.ddp.init_process_group``), the model synced across nodes (and a
    joiner's loaded) by ``HookState(module=...)``."""
    import torch

    import bps

    rt = bps.core.runtime.get()
    goal = {n: torch.from_numpy(t) for n, t in targets(rank, shapes).items()}
    if cfg.get("frontend") == "ddp":
        model, optimizer, trainer, train_step = ddp_hook_job(run, rank, shapes, cfg["lrs"][0],
                                                             goal)
    else:
        model = make_model(rank, shapes)
        optimizer = torch.optim.SGD(model.parameters(), lr=cfg["lrs"][0], momentum=MOMENTUM)
        trainer = bps.DistributedTrainer(model, optimizer, run["params"],
                                         **run.get("mode", {}))

        def train_step() -> None:
            trainer.zero_grad()
            sum((getattr(model, n) * (getattr(model, n).detach() - goal[n])).sum()
                for n in shapes).backward()  # grad = w - t_rank exactly
            trainer.step()
    start = trainer.step_count
    params = lambda: {n: getattr(model, n).detach().numpy().copy() for n in shapes}  # noqa: E731
    if start:
        np.savez(out / f"admitted{rank}.npz", **params())
    engine = rt.engine
    if not start and engine is not None:
        # a barrier before training, as loading a checkpoint has: a joiner counts it too,
        # or the barrier of bps.shutdown() would not meet
        engine.barrier()
    history, skipped = {}, []
    for step in range(start, cfg["stop"]):
        step_faults(cfg, rank, step, out)
        history.update({f"{n}@{step}": v for n, v in params().items()})
        for group in optimizer.param_groups:
            group["lr"] = cfg["lrs"][step]
        train_step()
        if trainer.stats()["skipped"]:
            skipped.append(step)
    np.savez(out / f"params{rank}.npz", **params())
    np.savez(out / f"history{rank}.npz", **history)
    trainer.close()
    if cfg.get("frontend") == "ddp":
        torch.distributed.destroy_process_group()
    return {"start": start, "skipped": skipped}


def ddp_hook_job(run: dict, rank: int, shapes: dict, lr: float, goal: dict) -> tuple:
    """The DDP side of :func:`rejoin_train`: (model, optimizer, HookState, one training
    step) of :func:`closed_form`'s module wrapped in DDP over a group of the node's own
    processes, the bps hook registered."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    import bps.ddp

    bps.ddp.init_process_group("gloo")
    model = closed_form(rank, shapes)
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=lr, momentum=MOMENTUM)
    state = bps.ddp.HookState(run["params"], optimizer=optimizer, module=model)
    ddp.register_comm_hook(state, bps.ddp.ps_hook)

    def train_step() -> None:  # grad = w - t_rank exactly (0.5 * ||w - t||^2, on the CPU)
        optimizer.zero_grad()
        ddp(goal).backward()
        optimizer.step()

    return model, optimizer, state, train_step


def step_faults(cfg: dict, rank: int, step: int, out: Path) -> None:
    """Every fault ``cfg`` schedules at the start of ``step`` on this rank, in order:
    :func:`kill_server`, :func:`leave` (its "start" ones), :func:`kill_once` and, on
    the nodes that were not killed, :func:`wait_for_join`."""
    import bps

    rt = bps.core.runtime.get()
    kill_server(cfg, rank, step, out, rt.engine)
    leave(cfg, rank, step, out, "start")
    if "kill" in cfg:
        kill_once(cfg, rank, step, out)
        if rt.node_id != cfg["kill"][0] // rt.local_size:
            wait_for_join(cfg, step, rt.engine)


def kill_once(cfg: dict, rank: int, step: int, out: Path) -> None:
    """``cfg["kill"]`` = [rank, step]: that rank kills itself (SIGKILL) at the start of
    that step, once: a file marks it, so the restarted process goes on."""
    marker = out / f"killed{rank}"
    if (rank, step) == tuple(cfg["kill"]) and not marker.exists():
        marker.write_text("")
        os.kill(os.getpid(), signal.SIGKILL)


def wait_for_join(cfg: dict, step: int, engine) -> None:
    """On a local rank 0 of a node present (``engine``; None on the other local ranks):
    at the start of step ``cfg["wait_at"]``, wait until the scheduler announced the
    restarted node's join (membership generation 2)."""
    if step != cfg["wait_at"] or engine is None:
        return
    deadline = time.monotonic() + 90  # the victim starts again: seconds
    while engine.announced_generation < 2:
        assert time.monotonic() < deadline, "the restarted node never joined"
        time.sleep(0.01)


def leave(cfg: dict, rank: int, step: int, out: Path, where: str = "start") -> None:
    """``cfg["leave"]`` = [rank, step, signal name(, where)]: that rank sends itself the
    signal at the start of that step, before it pushes anything of it, or (``where``
    "backward") right after its backward, its pushes on their way (SIGSTOP: its pid goes
    to ``stopped.pid`` first, for :func:`resume_stopped`); "raise" instead of a signal:
    it raises RuntimeError("boom") there; "cut" (under ``bpslaunch netem``): its host's
    cable is out for ``spec[4]`` seconds from there (:func:`cut_link`), and it goes on."""
    spec = cfg.get("leave")
    if spec is None or spec[0] != rank or spec[1] != step or \
            (spec[3] if len(spec) > 3 else "start") != where:
        return
    if spec[2] == "raise":
        raise RuntimeError("boom")
    if spec[2] == "cut":
        cut_link(float(spec[4]))
        return
    sig = getattr(signal, spec[2])
    if sig == signal.SIGSTOP:
        (out / "stopped.pid").write_text(str(os.getpid()))
    os.kill(os.getpid(), sig)


def cut_link(seconds: float) -> None:
    """Take this emulated host's cable out: its port on ``bpslaunch netem``'s switch goes
    down (the host's own interface stays up, as when a cable is pulled at the far end)
    and comes back up after ``seconds``, whatever the job does meanwhile."""
    netns = subprocess.run(["ip", "netns", "identify"], capture_output=True, text=True,
                           check=True).stdout.split()[0]
    tag, host = netns.rsplit("-", 1)
    switch, port = f"{tag}-sw", f"p-{host}"
    subprocess.run(["ip", "-n", switch, "link", "set", port, "down"], check=True)
    # the cut's length, not a synchronisation: the job must cope with any length
    subprocess.Popen(["sh", "-c", f"sleep {seconds}; ip -n {switch} link set {port} up"],
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                     stderr=subprocess.DEVNULL, start_new_session=True)
def kill_server(cfg: dict, rank: int, step: int, out: Path, engine=None) -> None:
    """``cfg["kill_server"]`` = [server id, step(, "restart")]: rank 0 (or rank
    ``cfg["kill_server_by"]``) kills that server of its job (the process whose
    environment names it) with SIGKILL at the start of that step, before pushing
    anything of it (and before :func:`leave`); with "restart" it then starts a server
    with the dead one's environment (its output in ``restarted.log``, its pid in
    ``restarted.pid``). ``cfg["kill_server_after"]`` = a generation: first it waits (up
    to 60 s) until the scheduler announced that membership generation to ``engine``
    (a worker node's departure)."""
    spec = cfg.get("kill_server")
    if spec is None or rank != cfg.get("kill_server_by", 0) or spec[1] != step:
        return
    after, deadline = cfg.get("kill_server_after", 0), time.monotonic() + 60
    while after and engine.announced_generation < after:
        assert time.monotonic() < deadline, f"membership generation {after} never announced"
        time.sleep(0.01)
    port = os.environ["DMLC_PS_ROOT_PORT"]
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            raw = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        env = dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0")
                   if "=" in item)
        if (env.get("DMLC_ROLE"), env.get("BPS_SERVER_ID"), env.get("DMLC_PS_ROOT_PORT")) \
                == ("server", str(spec[0]), port):
            os.kill(int(pid), signal.SIGKILL)
            break
    else:
        raise AssertionError(f"server {spec[0]} of the job on port {port} not found")
    if len(spec) > 2 and spec[2] == "restart":
        with open(out / "restarted.log", "w") as log:
            server = subprocess.Popen([sys.executable, "-m", "bps.launch.cli"], env=env,
                                      stdout=log, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, start_new_session=True)
        (out / "restarted.pid").write_text(str(server.pid))


def resume_stopped(out: Path, timeout: float = 60) -> None:
    """A survivor that has finished training lets a stopped worker go on (SIGCONT): it
    left the job meanwhile, so what it sends next is refused. The survivor then waits
    (up to ``timeout`` s) until that worker has ended, so that the servers it is
    refused by are still there."""
    path = out / "stopped.pid"
    if not path.exists():
        return
    pid = int(path.read_text())
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while process_alive(pid):
        assert time.monotonic() < deadline, f"the resumed worker (pid {pid}) did not end"
        time.sleep(0.01)


def process_alive(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie, ended but not yet reaped, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def worker_main(cfg: dict, train: Callable[..., dict] = train) -> int:
    """One worker process: ``train(cfg, run, rank, shapes, out)`` for each of
    ``cfg["runs"]`` (``shapes``: the run's own, else ``cfg["shapes"]``), reports to
    ``report{rank}.json`` (also the worker of the other trainer test files, each with
    its own ``train``)."""
    import torch

    import bps

    torch.set_num_threads(1)
    bps.init()
    rank = bps.rank()
    out = Path(cfg["out"])
    shapes = {name: tuple(shape) for name, shape in cfg["shapes"].items()}
    if "bad_params" in cfg:
        (out / f"errors{rank}.json").write_text(json.dumps(expect_errors(cfg, rank, shapes)))
        bps.shutdown()  # reached by every rank only if every rank failed in the constructor
        return 3
    reports = {run.get("tag", ""): train(
        cfg, run, rank, {n: tuple(v) for n, v in run["shapes"].items()} if "shapes" in run
        else shapes, out) for run in cfg["runs"]}
    (out / f"report{rank}.json").write_text(json.dumps(reports))
    bps.shutdown()
    return 0


# ----------------------------------------------------------------------------- test side


def launch(cfg: dict, tmp: Path, workers: int = 2, servers: int = 1, local_size: int = 1,
           env: dict | None = None, timeout: float = 120,
           module: str = "tests.harness.trainer_job",
           options: tuple[str, ...] = (), netem: bool = False) -> subprocess.CompletedProcess:
    """Run ``module``'s worker program (``python -m module``, from the repository's root)
    on a ``bpslaunch local`` cluster with ``cfg`` (``options``: more of bpslaunch's), or
    with ``netem`` on ``bpslaunch netem``'s emulated hosts, unthrottled."""
    from tests.harness.ps_job import BPSLAUNCH

    cfg = {"shapes": SHAPES, **cfg, "out": str(tmp)}
    cluster = ["netem", "--nodes", str(workers), "--rate", "none"] if netem else \
        ["local", "--workers", str(workers)]
    cmd = [*BPSLAUNCH, *cluster, "--servers", str(servers),
           "--local-size", str(local_size), *options, "--", sys.executable, "-m", module,
           json.dumps(cfg)]
    full_env = {**os.environ, "BPS_TIMEOUT": "20", "BYTEPS_PARTITION_BYTES": "400",
                "BPS_JOB_SEED": "4242", **(env or {})}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return subprocess.CompletedProcess(cmd, proc.returncode, output, None)


def check_rejoin(tmp: Path, params: dict, workers: int, lrs: list[float], victim: int,
                 killed_at: int, wait_at: int, out: str, local_size: int = 1) -> None:
    """The outcome of a :func:`rejoin_train` job (``out``: its output, for messages): node
    ``victim`` (its ``local_size`` ranks) restarted and joined (generation 2), the other
    nodes' ranks skipped the step of the death and the one the join dropped, each of
    the joiner's ranks started from rank 0's parameters at its first step, and every
    rank ends bit-identical to the numpy replay of that membership, the joiner's error
    feedback and momentum starting at zero."""
    assert re.search(rf"restarting worker node w?{victim} ", out), out[-6000:]  # netem: w2
    assert f"worker {victim} at " in out and \
        f"joined: worker nodes {list(range(workers))} (membership generation 2)" in out, \
        out[-6000:]
    ranks = range(workers * local_size)
    reports = [json.loads((tmp / f"report{r}.json").read_text())[""] for r in ranks]
    joiners = [r for r in ranks if r // local_size == victim]
    start = reports[joiners[0]]["start"]
    dropped = start - 1  # the step the join dropped, on the nodes present
    assert wait_at <= dropped < len(lrs) - 1, reports
    history = np.load(tmp / "history0.npz")
    for rank in ranks:
        if rank in joiners:
            assert reports[rank] == {"start": start, "skipped": []}, reports
            admitted = np.load(tmp / f"admitted{rank}.npz")
            for n in SHAPES:
                np.testing.assert_array_equal(admitted[n], history[f"{n}@{start}"],
                                              err_msg=f"rank {rank}: {n}")
        else:
            assert reports[rank] == {"start": 0, "skipped": [killed_at, dropped]}, reports
    everyone = list(range(workers))
    survivors = [node for node in everyone if node != victim]
    members = [everyone] * killed_at + [None] + [survivors] * (dropped - killed_at - 1) + \
        [None] + [everyone] * (len(lrs) - dropped - 1)
    expected = replay(params, workers, lrs, plain(SHAPES), members=members,
                      fresh_workers={victim: start}, local_size=local_size)
    for rank in ranks:
        final = np.load(tmp / f"params{rank}.npz")
        for n in SHAPES:
            np.testing.assert_array_equal(final[n], expected[n], err_msg=f"rank {rank}: {n}")


def load_params(tmp: Path, ranks: int, tag: str = "") -> list[dict]:
    return [dict(np.load(tmp / f"params{tag}{r}.npz")) for r in range(ranks)]


def load_reports(tmp: Path, ranks: int) -> list[dict]:
    return [json.loads((tmp / f"report{r}.json").read_text()) for r in range(ranks)]


def nesterov(mu: np.float32, g: np.ndarray, m: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """docs/compression.md momentum: m = g + mu*m; g' = g + mu*m (float32, two roundings each)."""
    m = (g + mu * m).astype(np.float32)
    return (g + mu * m).astype(np.float32), m


def sgd_momentum(w: np.ndarray, g: np.ndarray, buf: np.ndarray | None, lr: float
                 ) -> tuple[np.ndarray, np.ndarray]:
    """torch.optim.SGD with momentum 0.9 (no dampening, no Nesterov): w, buf."""
    f32 = np.float32
    buf = g.copy() if buf is None else (f32(MOMENTUM) * buf + g).astype(f32)
    return (w - f32(lr) * buf).astype(f32), buf


def local_step(w: dict, bufs: dict, rank: int, lr: float, shapes: dict = SHAPES) -> None:
    """One local step of node ``rank`` in numpy, in place: SGD with momentum
    (:func:`sgd_momentum`) on the gradient ``w - t_rank`` of every tensor."""
    goal = targets(rank, shapes)
    for n in shapes:
        w[n], bufs[n] = sgd_momentum(w[n], (w[n] - goal[n]).astype(np.float32), bufs[n], lr)


def outer_average(anchor: dict, ws: dict, present: list[int], parts, workers, servers,
                  shapes: dict = SHAPES) -> None:
    """One outer round of local SGD (outer "average") in numpy: each present node's delta
    ``anchor - w`` divided by their number; ``big``'s through the node's and then the
    server's chains of each partition (lr 1), the rest raw, summed in node order; the
    anchor (updated in place) moves by the sum."""
    f32 = np.float32
    shares = {r: {n: ((anchor[n] - ws[r][n]).astype(f32) / f32(len(present))).astype(f32)
                  for n in shapes} for r in present}
    for n in shapes:
        if n == "big":
            continue
        summed = np.zeros(shapes[n], f32)
        for r in present:
            summed = (summed + shares[r][n]).astype(f32)
        anchor[n] = (anchor[n] - summed).astype(f32)
    big = np.zeros(int(np.prod(shapes["big"])), f32)
    for i, (offset, n) in enumerate(parts):
        summed = np.zeros(n, f32)
        for r in present:
            workers[r][i].set_lr(1.0)
            share = shares[r]["big"].reshape(-1)[offset:offset + n]
            summed = (summed + workers[r][i].decode(
                workers[r][i].compress(share)).astype(f32)).astype(f32)
        servers[i].set_lr(1.0)
        big[offset:offset + n] = servers[i].decode(servers[i].compress(summed))
    anchor["big"] = (anchor["big"] - big.reshape(shapes["big"])).astype(f32)


SIM_LRS = [0.5, 0.25, 0.25, 0.5, 0.125]  # powers of two: lr * g is exact everywhere
SIM_SEED = 4242  # BPS_JOB_SEED: the trainer fills compression_params["seed"] with it
PARTITION = 100  # elements per partition: BYTEPS_PARTITION_BYTES=400, float32
# every registered compressor whose payloads are decoded one by one, its first described
# example (the seed left to the trainer: SIM_SEED)
SIM_CASES = {
    name: {"compressor": name, **{key: value for key, value in
                                  description(name).examples[0].items() if key != "seed"}}
    for name in registered_names() if not description(name).payloads_sum}


def reference_codec(params: dict, numel: int):
    """(encode, decode) of the compressor from tests/harness/reference_compressors.py
    (the job's seed, SIM_SEED); decode gives float32 values, as the receiving side holds
    them."""
    import tests.harness.reference_compressors as ref

    return ref.ref_codec({**params, "seed": SIM_SEED}, numel, "float32")


def big_chains(params: dict, nodes: int, mu: float | None, shapes: dict = SHAPES
               ) -> tuple[list[tuple[int, int]], list[list], list]:
    """The reference chains of ``shapes["big"]`` cut in partitions of ``PARTITION``
    elements: (offset, numel) of each partition, each node's worker chains (momentum
    ``mu``) and the servers' chains, one per partition."""
    from tests.harness.reference_compressors import RefChain

    numel = int(np.prod(shapes["big"]))
    parts = [(o, min(PARTITION, numel - o)) for o in range(0, numel, PARTITION)]
    workers = [[RefChain(*reference_codec(params, n), n, "float32", True, mu)
                for _, n in parts] for _ in range(nodes)]
    servers = [RefChain(*reference_codec(params, n), n, "float32", True, None)
               for _, n in parts]
    return parts, workers, servers


def simulate(params: dict, nodes: int, lrs: list[float], compressed_from: int | None = 0,
             shapes: dict = SHAPES) -> dict:
    """The pipeline of docs/architecture.md in numpy: per node, g = (w - t_node) / nodes ->
    Momentum -> ErrorFeedback -> C; server: sum of the decoded payloads -> ErrorFeedback
    -> C; workers decode and take an SGD step. Tensors that travel raw (the small one
    always; the big one before step ``compressed_from``, or always if None) are summed
    and get the same Nesterov rule after the sum."""
    return replay(params, nodes, lrs, plain(shapes), compressed_from, shapes)


def replay(params: dict, nodes: int, lrs: list[float], grads, compressed_from: int | None = 0,
           shapes: dict = SHAPES, members: list[list[int] | None] | None = None,
           fresh_workers: dict[int, int] | None = None,
           fresh_servers: dict[int, list[int]] | None = None, local_size: int = 1) -> dict:
    """docs/architecture.md's pipeline in numpy (see ``simulate``), with node ``r``'s
    gradient at step ``s`` given by ``grads(s, r, w)`` (a dict of
    float32 arrays): ``big`` is compressed (from step ``compressed_from``; None: never),
    the rest travels raw and gets Nesterov momentum after the sum. ``members``: per
    step, the nodes present (each share divided by their number, summed in node order),
    or None for a step dropped everywhere (worker nodes left: nothing changes); default
    all ``nodes`` every step. ``fresh_workers``: node -> the step from which its worker
    chains start anew (a node that joined again: its error feedback and momentum at
    zero). ``fresh_servers``: step -> the partitions of ``big`` whose server chains start
    anew at that step (their server was replaced: its error feedback is lost).
    ``local_size``: ranks per node; node ``r``'s share is then the float32 sum, in local
    rank order, of ``grads(s, rank, w)`` divided by the ranks present, over its ranks
    ``r * local_size ...``."""
    f32 = np.float32
    w = initial_params(0, shapes)  # rank 0's parameters, broadcast at construction
    numel = int(np.prod(shapes["big"]))
    parts, workers, servers = big_chains(params, nodes, MOMENTUM, shapes)
    local_momentum = {n: np.zeros(shape, f32) for n, shape in shapes.items()}
    applied = 0  # steps applied: warmup counts these
    for step, lr in enumerate(lrs):
        present = list(range(nodes)) if members is None else members[step]
        for r, first in (fresh_workers or {}).items():
            if first == step:
                workers[r] = big_chains(params, 1, MOMENTUM, shapes)[1][0]
        for i in (fresh_servers or {}).get(step, []):
            servers[i] = big_chains(params, nodes, MOMENTUM, shapes)[2][i]
        if present is None:
            continue
        shares = {r: node_share(grads, step, w, r, local_size, len(present) * local_size)
                  for r in present}
        out = {}
        for n in shapes:
            if n == "big" and compressed_from is not None and applied >= compressed_from:
                continue
            summed = np.zeros(shapes[n], f32)
            for r in present:
                summed = (summed + shares[r][n]).astype(f32)
            out[n], local_momentum[n] = nesterov(f32(MOMENTUM), summed, local_momentum[n])
        if "big" not in out:
            big = np.zeros(numel, f32)
            for i, (offset, n) in enumerate(parts):
                summed = np.zeros(n, f32)
                for r in present:
                    workers[r][i].set_lr(lr)
                    share = shares[r]["big"].reshape(-1)[offset:offset + n]
                    decoded = workers[r][i].decode(workers[r][i].compress(share))
                    summed = (summed + decoded.astype(f32)).astype(f32)
                servers[i].set_lr(lr)
                big[offset:offset + n] = servers[i].decode(servers[i].compress(summed))
            out["big"] = big.reshape(shapes["big"])
        for n in shapes:
            w[n] = (w[n] - f32(lr) * out[n]).astype(f32)
        applied += 1
    return w


def node_share(grads, step: int, w: dict, node: int, local_size: int, ranks: int) -> dict:
    """Node ``node``'s share of step ``step``: each of its ranks' gradient divided by the
    ``ranks`` present, summed in float32 within the node, in local rank order."""
    f32 = np.float32
    share: dict = {}
    for rank in range(node * local_size, (node + 1) * local_size):
        for n, g in grads(step, rank, w).items():
            part = (g / f32(ranks)).astype(f32)
            share[n] = part if n not in share else (share[n] + part).astype(f32)
    return share


def plain(shapes: dict):
    """One backward per step: node r's gradient is ``w - t_r``."""
    return lambda step, r, w: {n: (w[n] - targets(r, shapes)[n]).astype(np.float32)
                               for n in shapes}


# comm_dtype: 2 nodes x 2 local ranks, a tensor of several partitions, small and bias fused
COMM_SHAPES = {"big": (60, 50), "small": (7,), "bias": (4,)}
COMM_LRS = [0.5, 0.25, 0.25, 0.5]  # powers of two: lr * g is exact


def comm_reference(comm: str, nodes: int = 2, local: int = 2,
                   lrs: list[float] = COMM_LRS) -> dict:
    """The final parameters of COMM_SHAPES after ``lrs`` with ``comm_dtype=comm``
    ("fp16", "bf16" or "fp32") and local Nesterov momentum, rounded to the wire's dtype
    exactly where the pipeline of docs/trainer.md rounds: each rank's share, the
    intra-node sum of a node's ``local`` shares, the servers' sum of two nodes (one
    rounding each: a sum of two halves is taken in float32 and rounded once), then
    float32 Nesterov momentum and SGD."""
    import torch

    assert nodes == 2 and local in (1, 2), "the sums below are written for these"
    dtype, f32 = {"fp16": torch.float16, "bf16": torch.bfloat16,
                  "fp32": torch.float32}[comm], np.float32
    ranks = nodes * local
    w = initial_params(0, COMM_SHAPES)
    goals = [targets(r, COMM_SHAPES) for r in range(ranks)]
    m = {n: np.zeros(s, f32) for n, s in COMM_SHAPES.items()}
    for lr in lrs:
        for n in COMM_SHAPES:
            shares = [torch.from_numpy((w[n] - goals[r][n]).astype(f32) / f32(ranks)).to(dtype)
                      for r in range(ranks)]
            node_sums = [shares[i * local] if local == 1 else
                         shares[i * local] + shares[i * local + 1] for i in range(nodes)]
            g = (node_sums[0] + node_sums[1]).float().numpy()
            m[n] = (g + f32(MOMENTUM) * m[n]).astype(f32)
            g = (g + f32(MOMENTUM) * m[n]).astype(f32)
            w[n] = (w[n] - f32(lr) * g).astype(f32)
    return w


if __name__ == "__main__":
    # exits without the interpreter's finalization, which costs 0.3-0.5 s of CPU
    # per process after torch (every test's cluster is on the same two cores)
    from bps.server.role import end_process

    config = json.loads(sys.argv[1])
    end_process(worker_main(config, rejoin_train if "kill" in config else train))
