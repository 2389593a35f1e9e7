"""The training loops practitioners write, end to end on real clusters (``bpslaunch local``):
gradient accumulation, non-finite gradients (both policies, and a GradScaler), uneven
inputs with ``trainer.join()``, low-precision parameters with autocast, torch.compile.

This module is also the worker program: ``python -m tests.frontends.test_trainer_loops
CONFIG_JSON`` is what every worker process runs (tests/harness/trainer_job.py's
``worker_main`` with this module's ``train``). The toy
model's gradient is known in closed form (``grad = w - target``), so the tests replay
the pipeline in numpy, or compare two real runs that must end bit-identical.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.harness.paths import ROOT
from tests.harness.ps_job import BPSLAUNCH
from tests.harness.trainer_job import (
    MOMENTUM,
    PARTITION,
    SHAPES,
    SIM_CASES,
    SIM_LRS,
    big_chains,
    initial_params,
    make_model,
    nesterov,
    targets,
    worker_main,
)
from tests.harness.trainer_job import launch as trainer_launch

INJECT_STEP, INJECT_RANK, INJECT_INDEX = 2, 1, 7


def micro_targets(rank: int, micro: int, shapes: dict) -> dict:
    """The targets of micro-batch ``micro`` on ``rank`` (micro-batch 0: trainer_job's)."""
    return targets(rank + 100 * micro, shapes)


# ----------------------------------------------------------------------------- worker side


def train(cfg: dict, run: dict, rank: int, shapes: dict, out: Path) -> dict:
    import torch

    import bps

    tag = run["tag"]
    passes = run.get("passes", 1)
    dtype = getattr(torch, run.get("dtype", "float32"))
    toy = make_model(rank, shapes).to(dtype)
    params = dict(toy.named_parameters())

    class Loss(torch.nn.Module):  # the toy's loss as a forward, for torch.compile
        def __init__(self) -> None:
            super().__init__()
            self.toy = toy

        def forward(self, goal: dict) -> torch.Tensor:
            if run.get("autocast"):  # a matmul, which autocast runs in bfloat16
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    out = torch.nn.functional.linear(probe, params["big"])
                assert out.dtype == torch.bfloat16
                return 0.5 * ((out.float() - probe_goal) ** 2).sum() / probe.square().sum()
            return sum(0.5 * ((params[n] - goal[n]) ** 2).sum() for n in shapes)

    gen = torch.Generator().manual_seed(rank)
    probe = torch.randn(8, shapes["big"][1], generator=gen)
    probe_goal = probe @ torch.randn(shapes["big"], generator=gen).T
    model = Loss()
    if run.get("compile"):  # the trainer gets the compiled module (OptimizedModule)
        # "aot_eager": dynamo and AOTAutograd's graphs (which produce the gradients the
        # hooks see), run eagerly; "inductor" generates C++ (tens of seconds, cold)
        model = torch.compile(model, backend=run["compile"])
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg["lrs"][0], momentum=MOMENTUM)
    trainer = bps.DistributedTrainer(model, optimizer, run["params"],
                                     backward_passes_per_step=passes)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10,
                                  growth_interval=run.get("growth_interval", 2000)) \
        if run.get("scaler") else None
    goals = [{n: torch.from_numpy(t).to(dtype) for n, t in micro_targets(rank, j, shapes).items()}
             for j in range(passes)]
    inject = run.get("inject", False) and rank == run.get("inject_rank", INJECT_RANK)
    steps = run.get("steps_per_rank", [cfg["stop"]] * 64)[rank]
    report = {"errors": [], "steps": [], "losses": []}
    with trainer.join() if run.get("join") else contextlib.nullcontext():
        for step in range(steps):
            if step in run.get("skip_steps", ()):
                if scaler is not None:  # the reference of a skipped step: the same backoff
                    scaler.update(new_scale=scaler.get_scale() * 0.5)
                continue
            for group in optimizer.param_groups:
                group["lr"] = cfg["lrs"][step]
            trainer.zero_grad()
            for j in range(passes):
                loss = model(goals[j])
                if inject and step == INJECT_STEP and j == 0:
                    poison = torch.zeros(shapes["big"], dtype=dtype)
                    poison.view(-1)[INJECT_INDEX] = float("inf")
                    loss = loss + (params["big"] * poison).sum()
                if run.get("overflow") and step == INJECT_STEP and j == 0:
                    # finite on every worker (80000 / 3 workers fits float16), but the
                    # sum of the three, rounded to float16, is not
                    loss = loss + params["small"][0] * 80000.0
                (loss if scaler is None else scaler.scale(loss)).backward()
                report["losses"].append(loss.item())
            try:
                trainer.step(scaler=scaler)
            except bps.NonFiniteGradientError as exc:
                report["errors"].append(f"{type(exc).__name__}: {exc}")
            report["steps"].append(trainer.stats())
    if run.get("join"):  # after the context: the others' remaining steps were shadowed
        report["steps"].append(trainer.stats())
    state = trainer.state_dict()
    state.pop("wire_step")
    torch.save({"params": {n: p.detach().float() for n, p in params.items()},
                "trainer": state,
                "scale": None if scaler is None else scaler.get_scale()},
               out / f"state{tag}{rank}.pt")
    trainer.close()
    return report


# ----------------------------------------------------------------------------- test side


def launch(cfg: dict, tmp: Path, workers: int = 2, servers: int = 1, local_size: int = 1,
           timeout: float = 240, env: dict | None = None) -> subprocess.CompletedProcess:
    """tests/harness/trainer_job.py's launch, running this module."""
    return trainer_launch(cfg, tmp, workers, servers, local_size, env=env, timeout=timeout,
                          module=__name__)


def load_state(tmp: Path, tag: str, rank: int) -> dict:
    import torch

    return torch.load(tmp / f"state{tag}{rank}.pt", weights_only=False)


def load_reports(tmp: Path, ranks: int) -> list[dict]:
    return [json.loads((tmp / f"report{r}.json").read_text()) for r in range(ranks)]


def assert_identical(a: object, b: object, where: str = "") -> None:
    """Bit-identical nested states; dicts keyed by int keys (the engine's) are compared
    in key order, as two runs of one job number their keys differently."""
    import torch

    if isinstance(a, dict):
        assert isinstance(b, dict) and len(a) == len(b), where
        if all(isinstance(k, int) for k in a):
            for (ka, va), (_, vb) in zip(sorted(a.items()), sorted(b.items()), strict=True):
                assert_identical(va, vb, f"{where}[key#{ka}]")
        else:
            assert a.keys() == b.keys(), where
            for k in a:
                assert_identical(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_identical(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
        assert a.dtype == b.dtype, where
    else:
        assert a == b, where


def simulate(params: dict | None, nodes: int, lrs: list[float], passes: int = 1,
             steps_per_rank: list[int] | None = None, shapes: dict = SHAPES,
             local_size: int = 1) -> dict:
    """SPEC §1's pipeline in numpy (as tests/harness/trainer_job.simulate), with ``passes``
    micro-batches summed in float32 per step, in backward order, ``local_size`` ranks
    per node summed in float32 within the node, and ranks that ran out of steps
    contributing nothing (the divisor stays the number of ranks; a node none of whose
    ranks has data pushes nothing). ``params`` None: uncompressed float32 wire, no
    momentum."""
    f32 = np.float32
    ranks = nodes * local_size
    w = initial_params(0, shapes)
    goals = [[micro_targets(r, j, shapes) for j in range(passes)] for r in range(ranks)]
    steps_per_rank = steps_per_rank or [len(lrs)] * ranks
    numel = int(np.prod(shapes["big"]))
    parts = [(o, min(PARTITION, numel - o)) for o in range(0, numel, PARTITION)]
    compressed = params is not None and params.get("compressor") is not None
    mu = MOMENTUM if params is not None and params.get("momentum") else None
    if compressed:
        _, workers, servers = big_chains(params, nodes, mu, shapes)
    local_momentum = {n: np.zeros(shape, f32) for n, shape in shapes.items()}
    optimizer_momentum = {n: None for n in shapes}
    for step in range(max(steps_per_rank)):
        lr = lrs[step]
        active_ranks = [r for r in range(ranks) if step < steps_per_rank[r]]
        active = sorted({r // local_size for r in active_ranks})
        shares: dict[int, dict] = {}  # per node, the sum of its ranks' shares
        for r in active_ranks:
            node = shares.setdefault(r // local_size, {})
            for n in shapes:
                acc = (w[n] - goals[r][0][n]).astype(f32)
                for j in range(1, passes):
                    acc = (acc + (w[n] - goals[r][j][n]).astype(f32)).astype(f32)
                share = (acc / f32(ranks)).astype(f32)
                node[n] = share if n not in node else (node[n] + share).astype(f32)
        grads = {}
        for n in shapes:
            if n == "big" and compressed:
                continue
            summed = None
            for r in active:
                summed = shares[r][n] if summed is None else (summed + shares[r][n]).astype(f32)
            if mu is not None:
                grads[n], local_momentum[n] = nesterov(f32(mu), summed, local_momentum[n])
            else:
                grads[n] = summed
        if compressed:
            big = np.zeros(numel, f32)
            for i, (offset, n) in enumerate(parts):
                summed = None
                for r in active:
                    workers[r][i].set_lr(lr)
                    share = shares[r]["big"].reshape(-1)[offset:offset + n]
                    decoded = workers[r][i].decode(workers[r][i].compress(share)).astype(f32)
                    summed = decoded if summed is None else (summed + decoded).astype(f32)
                servers[i].set_lr(lr)
                big[offset:offset + n] = servers[i].decode(servers[i].compress(summed))
            grads["big"] = big.reshape(shapes["big"])
        for n in shapes:
            g = grads[n]
            if mu is None:  # the optimizer keeps its own momentum (torch.optim.SGD)
                buf = optimizer_momentum[n]
                buf = g.copy() if buf is None else (f32(MOMENTUM) * buf + g).astype(f32)
                optimizer_momentum[n] = buf
                g = buf
            w[n] = (w[n] - f32(lr) * g).astype(f32)
    return w


COMMON = {"ef": "vanilla", "momentum": "nesterov", "fp16": False, "min_compress_bytes": 1000}


ACCUMULATION_RUNS = [
    {"tag": "acc-onebit", "params": {**SIM_CASES["onebit"], **COMMON}, "passes": 3},
    {"tag": "acc-raw", "params": {"fp16": False}, "passes": 3}]


def test_accumulation_equals_summed_microbatches(three_nodes):
    tmp_path, _ = three_nodes
    reports = load_reports(tmp_path, 3)
    for run in ACCUMULATION_RUNS:
        expected = simulate(run["params"] if run["tag"] != "acc-raw" else None, 3, SIM_LRS,
                            passes=3)
        for rank in range(3):
            final = load_state(tmp_path, run["tag"], rank)["params"]
            for n in SHAPES:
                np.testing.assert_array_equal(final[n].numpy(), expected[n],
                                              err_msg=f"{run['tag']} rank {rank}: {n}")
        steps = reports[0][run["tag"]]["steps"]
        assert [s["backward_passes"] for s in steps] == [3] * len(SIM_LRS)
        assert steps[-1]["bytes_pushed"] > 0  # counted once per step, not per backward
        # samples: the first dimension of the forward's first tensor input (goal["big"],
        # 30 rows) over the 3 forwards of a step
        assert [s["samples"] for s in steps] == [3 * SHAPES["big"][0]] * len(SIM_LRS)
        last = steps[-1]
        assert last["bytes_per_sample"] == \
            (last["bytes_pushed"] + last["bytes_pulled"]) / (3 * SHAPES["big"][0])


def one_worker(script: str) -> subprocess.CompletedProcess:
    """``script`` (python -c) as the one worker of a bpslaunch local job with one server."""
    return subprocess.run([*BPSLAUNCH, "local", "--workers", "1", "--servers", "1", "--",
                           sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "BPS_TIMEOUT": "20"})


def test_second_backward_without_accumulation_keeps_its_error(tmp_path):
    script = (
        "import torch, bps\n"
        "bps.init()\n"
        "m = torch.nn.Linear(3, 1)\n"
        "t = bps.DistributedTrainer(m, torch.optim.SGD(m.parameters(), lr=0.1))\n"
        "m(torch.ones(1, 3)).sum().backward()\n"
        "try:\n"
        "    m(torch.ones(1, 3)).sum().backward()\n"
        "except RuntimeError as exc:\n"
        "    print('REFUSED', exc)\n"
        "t.step(); t.close(); bps.shutdown()\n"
    )
    result = one_worker(script)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "REFUSED" in result.stdout and "backward_passes_per_step" in result.stdout
    assert "backward() ran again without trainer.step()" in result.stdout
    assert "optimizer.step() was called" not in result.stdout  # it was not


def test_optimizer_step_instead_of_trainer_step_is_named(tmp_path):
    """DDP's habit: optimizer.step() where trainer.step() belongs. The first such call
    raises saying so, before any parameter changes, and the process exits with that
    error alone, also when bpslaunch's SIGTERM (sent to every process once the failure
    is known) arrives during its exit."""
    script = (
        "import atexit, os, signal, torch, bps\n"
        "bps.init()\n"
        "atexit.register(lambda: os.kill(os.getpid(), signal.SIGTERM))\n"
        "m = torch.nn.Sequential(torch.nn.Linear(300, 64), torch.nn.ReLU(),\n"
        "                        torch.nn.Linear(64, 3))\n"
        "opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)\n"
        "t = bps.DistributedTrainer(m, opt, {'compressor': 'onebit', 'ef': 'vanilla',\n"
        "                                    'momentum': 'nesterov', 'min_compress_bytes': 0})\n"
        "for _ in range(3):\n"
        "    opt.zero_grad()\n"
        "    m(torch.ones(4, 300)).sum().backward()\n"
        "    before = [p.detach().clone() for p in m.parameters()]\n"
        "    try:\n"
        "        opt.step()\n"
        "    finally:\n"
        "        print('unchanged', all(torch.equal(a, p) for a, p in\n"
        "                               zip(before, m.parameters())), flush=True)\n"
        "bps.shutdown()\n"
    )
    result = one_worker(script)
    out = result.stdout + result.stderr
    assert result.returncode != 0, out[-3000:]
    assert out.count("unchanged ") == 1 and "unchanged True" in out, out[-3000:]
    assert "optimizer.step() was called outside trainer.step()" in out, out[-3000:]
    assert "call trainer.step() instead of optimizer.step()" in out, out[-3000:]
    assert "backward() ran again" not in out, out[-3000:]
    assert out.count("Traceback") == 1 and "futures" not in out, out[-3000:]


SERVER_REFUSAL = """
import numpy as np, torch, zmq
import bps
from bps.common.auth import connect_as_client, load_key
from bps.compressors import build
from bps.compressors import validate_compression_params
from bps.common.protocol import Op, RemoteError, decode, encode
bps.init()
engine = bps.core.runtime.get().engine
engine.declare(0, 4, torch.float32, None, name="raw")
try:
    engine.push_pull(0, torch.tensor([1.0, float("nan"), 2.0, 3.0]), 0, 0.1).result(20)
except RemoteError as exc:
    print("RAW", exc)
values = torch.ones(70000)  # 280,000 bytes: 3 frames of BPS_FRAME_BYTES, the NaN in the last
values[-1] = float("nan")
engine.declare(2, values.numel(), torch.float32, None, name="framed")
try:
    engine.push_pull(2, values, 0, 0.1).result(20)
except RemoteError as exc:
    print("FRAMED", exc)
params = validate_compression_params({"compressor": "randomk", "k": 2, "seed": 3})
engine.declare(1, 64, torch.float32, params, name="sparse")
payload = build(params, 64).compress(torch.ones(64)).numpy().copy()
payload[16:20] = np.array([np.inf], dtype=np.float32).view(np.uint8)
sock = zmq.Context.instance().socket(zmq.DEALER)
sock.setsockopt(zmq.ROUTING_ID, engine.token + b"crafted")  # a connection of worker 0
connect_as_client(sock, load_key(bps.core.runtime.get().env))
sock.connect(engine.servers[0])
sock.send_multipart([encode(Op.PUSH, rid=1, key=1, step=0, node=0, dtype="float32", numel=64,
                            nbytes=payload.size, lr=0.1), payload.tobytes()])
if sock.poll(20000):
    print("SPARSE", decode(sock.recv_multipart()[0]).get("msg"))
sock.close(linger=0)
bps.shutdown()
"""


def test_servers_refuse_nonfinite_pushes_naming_the_node():
    result = one_worker(SERVER_REFUSAL)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    raw = next(line for line in result.stdout.splitlines() if "RAW" in line)
    assert "key 0 ('raw')" in raw and "worker 0" in raw and "inf or NaN" in raw, raw
    framed = next(line for line in result.stdout.splitlines() if "FRAMED" in line)
    assert "key 2 ('framed')" in framed and "worker 0" in framed and "inf or NaN" in framed
    sparse = next(line for line in result.stdout.splitlines() if "SPARSE" in line)
    assert "key 1 ('sparse')" in sparse and "worker 0" in sparse and "inf or NaN" in sparse


NONFINITE_CASES = {
    "none": {"fp16": False}, **{n: {**c, **COMMON} for n, c in SIM_CASES.items()},
    "bytegrad": {"compressor": "bytegrad", "chunk": 64, **COMMON},
    "powersgd": {"compressor": "powersgd", "rank": 1, "ef": "vanilla", "fp16": False,
                 "min_compress_bytes": 1000},  # its own error feedback, two rounds
}


def nonfinite_runs() -> list[dict]:
    """Per compressor and policy, a run where rank 1's gradient has an inf at step 2,
    and a run that never takes step 2 (``-ref``)."""
    runs = []
    for name, params in NONFINITE_CASES.items():
        runs.append({"tag": f"{name}-ref", "params": params, "skip_steps": [INJECT_STEP]})
        for policy in ("raise", "skip"):
            runs.append({"tag": f"{name}-{policy}", "params": {**params, "nonfinite": policy},
                         "inject": True})
    fp16 = {"fp16": True}  # raw float16 keys: the server's sum overflows
    runs += [{"tag": "fp16-ref", "params": fp16, "skip_steps": [INJECT_STEP]},
             {"tag": "fp16-raise", "params": fp16, "overflow": True}]
    scaled = {"none": {"fp16": False}, "randomk": NONFINITE_CASES["randomk"],
              "nesterov": {"fp16": False, "momentum": "nesterov"}}
    # the chain's momentum and error feedback, and the trainer's own Nesterov for raw
    # tensors, follow the scale
    # A GradScaler skips the step and backs off; its scale has just doubled for that
    # step (growth_interval=INJECT_STEP), so nothing may keep that change
    grows = {"scaler": True, "growth_interval": INJECT_STEP}
    for name, params in scaled.items():
        runs.append({"tag": f"{name}-scaler-ref", "params": params, **grows,
                     "skip_steps": [INJECT_STEP]})
        runs.append({"tag": f"{name}-scaler", "params": params, **grows, "inject": True})
        runs.append({"tag": f"{name}-unscaled-ref", "params": params,
                     "skip_steps": [INJECT_STEP]})
    return runs


@pytest.fixture(scope="module", params=[
    pytest.param(None, id="host"), pytest.param({"BPS_DEVICE_KERNELS": "1"}, id="device-forced")])
def three_nodes(request, tmp_path_factory) -> tuple[Path, str]:
    """One launch per path (3 nodes, 2 servers) of the non-finite runs, then the
    accumulation runs (after them: the keys of the runs before keep their numbers);
    the run directory and the job's output."""
    tmp_path = tmp_path_factory.mktemp("loops")
    result = launch({"runs": nonfinite_runs() + ACCUMULATION_RUNS, "lrs": SIM_LRS,
                     "stop": len(SIM_LRS)}, tmp_path, workers=3, servers=2, env=request.param)
    assert result.returncode == 0, result.stdout[-3000:]
    return tmp_path, result.stdout


def test_nonfinite_step_leaves_no_trace_anywhere(three_nodes):
    # every parameter, optimizer buffer, local momentum and worker and server chain
    # state (error, momentum, RNG) of a run that skipped the inf's step is bit-identical
    # to that of a run that never took it
    tmp_path, output = three_nodes
    reports = load_reports(tmp_path, 3)
    for run in nonfinite_runs():
        tag = run["tag"]
        if tag.endswith("-ref"):
            continue
        if tag.endswith("-scaler"):  # powers of two: the scale changes no parameter bit,
            for rank in range(3):    # before or after it halves at the skipped step
                assert_identical(load_state(tmp_path, tag, rank)["params"],
                                 load_state(tmp_path, tag.replace("-scaler", "-unscaled-ref"),
                                            rank)["params"], f"{tag} unscaled, rank {rank}")
        reference = tag.removesuffix("-raise").removesuffix("-skip") + "-ref" \
            if "scaler" not in tag else tag + "-ref"
        for rank in range(3):
            state, ref = load_state(tmp_path, tag, rank), load_state(tmp_path, reference, rank)
            assert_identical(state, ref, f"{tag} rank {rank}")
            report = reports[rank][tag]
            skipped = [s["skipped"] for s in report["steps"]]
            assert skipped == [i == INJECT_STEP for i in range(len(SIM_LRS))], (tag, skipped)
            assert report["steps"][-1]["totals"]["skipped_steps"] == 1
            if tag.endswith("-raise"):
                assert len(report["errors"]) == 1, (tag, report["errors"])
                message = report["errors"][0]
                assert "NonFiniteGradientError" in message, message
                if tag.startswith("fp16"):
                    assert "the sum over the workers of 'fused(toy.bias, toy.small)' " \
                        "overflows float16" in message, message
                else:
                    assert "'toy.big'" in message and f"node {INJECT_RANK}" in message, message
                assert f"step {INJECT_STEP}" in message, message
            else:
                assert report["errors"] == [], (tag, report["errors"])
    assert "skipped" in output  # the skip policy's warning


def local_rank_runs() -> list[dict]:
    runs = []
    for name in ("none", "onebit"):
        params = {**NONFINITE_CASES[name], "nonfinite": "skip"}
        runs += [{"tag": f"{name}-ref", "params": params, "skip_steps": [INJECT_STEP]},
                 {"tag": name, "params": params, "inject": True, "inject_rank": 3}]
    return runs


# 2 nodes x 2 local ranks with 2, 5, 3 and 4 batches in the join runs
JOIN_LENGTHS = [2, 5, 3, 4]
JOIN_RUNS = [{"tag": "join-onebit", "params": {**SIM_CASES["onebit"], **COMMON}, "join": True,
              "steps_per_rank": JOIN_LENGTHS},
             {"tag": "join-raw", "params": {"fp16": False}, "join": True,
              "steps_per_rank": JOIN_LENGTHS}]


@pytest.fixture(scope="module")
def local_ranks(tmp_path_factory) -> Path:
    """One launch (2 nodes x 2 local ranks, 2 servers) of the local-rank non-finite runs,
    then the join runs."""
    tmp_path = tmp_path_factory.mktemp("local_ranks")
    result = launch({"runs": local_rank_runs() + JOIN_RUNS, "lrs": SIM_LRS,
                     "stop": len(SIM_LRS)}, tmp_path, workers=2, servers=2, local_size=2,
                    timeout=150)
    assert result.returncode == 0, result.stdout[-3000:]
    return tmp_path


def test_nonfinite_on_one_local_rank_skips_the_step_on_every_rank(local_ranks):
    # an inf on rank 3 (node 1's second local rank) reaches the node's sum; its root
    # marks it, and all 4 ranks skip the step and end as a run without it
    tmp_path = local_ranks
    reports = load_reports(tmp_path, 4)
    for name in ("none", "onebit"):
        for rank in range(4):
            assert_identical(load_state(tmp_path, name, rank),
                             load_state(tmp_path, f"{name}-ref", rank), f"{name} rank {rank}")
            skipped = [s["skipped"] for s in reports[rank][name]["steps"]]
            assert skipped == [i == INJECT_STEP for i in range(len(SIM_LRS))], (name, skipped)


# test_join_with_several_local_ranks covers it: joined ranks, and a node whose ranks have
# all joined, against the same simulation
@pytest.mark.slow
def test_join_with_unequal_shards(tmp_path):
    # rank 0 has 5 batches, rank 1 three, rank 2 four: joined ranks contribute zero, the
    # divisor stays the number of workers, and nobody waits for a timeout
    lengths = [5, 3, 4]
    runs = [{"tag": "onebit", "params": {**SIM_CASES["onebit"], **COMMON}, "join": True,
             "steps_per_rank": lengths},
            {"tag": "raw", "params": {"fp16": False}, "join": True, "steps_per_rank": lengths}]
    result = launch({"runs": runs, "lrs": SIM_LRS, "stop": len(SIM_LRS)}, tmp_path,
                    workers=3, servers=2, timeout=120)
    assert result.returncode == 0, result.stdout[-3000:]
    for run in runs:
        expected = simulate(run["params"] if run["tag"] != "raw" else None, 3, SIM_LRS,
                            steps_per_rank=lengths)
        for rank in range(3):
            final = load_state(tmp_path, run["tag"], rank)
            for n in SHAPES:
                np.testing.assert_array_equal(final["params"][n].numpy(), expected[n],
                                              err_msg=f"{run['tag']} rank {rank}: {n}")
            assert final["trainer"]["step"] == max(lengths)


def test_join_with_several_local_ranks(local_ranks):
    # a joined rank adds zeros to its node's sum, a node whose ranks have all joined
    # pushes nothing, and the last step's only rank with data is local rank 1 of node 0,
    # whose model every rank ends with
    for run in JOIN_RUNS:
        expected = simulate(run["params"] if run["tag"] != "join-raw" else None, 2, SIM_LRS,
                            steps_per_rank=JOIN_LENGTHS, local_size=2)
        for rank in range(4):
            final = load_state(local_ranks, run["tag"], rank)
            for n in SHAPES:
                np.testing.assert_array_equal(final["params"][n].numpy(), expected[n],
                                              err_msg=f"{run['tag']} rank {rank}: {n}")


# float32 chains on low-precision parameters, and under torch.compile
TOPK_EF = {"compressor": "topk", "k": 0.1, "ef": "vanilla", "min_compress_bytes": 1000}


def test_low_precision_autocast_and_compile(tmp_path):
    # bfloat16 and float16 parameters train (float32 chains); a bfloat16 autocast forward
    # trains; a compiled model trains exactly as the same model uncompiled
    lrs = [0.25, 0.25, 0.25, 0.125, 0.125, 0.125]
    params = TOPK_EF
    runs = [{"tag": "bf16", "params": params, "dtype": "bfloat16"},
            {"tag": "fp16", "params": {**params, "compressor": "randomk"}, "dtype": "float16"},
            {"tag": "autocast", "params": params, "autocast": True},
            {"tag": "eager", "params": params},
            {"tag": "compiled", "params": params, "compile": "aot_eager"}]
    result = launch({"runs": runs, "lrs": lrs, "stop": len(lrs)}, tmp_path, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:]
    start = initial_params(0, SHAPES)
    for tag in ("bf16", "fp16"):
        states = [load_state(tmp_path, tag, r) for r in range(2)]
        for n in SHAPES:
            np.testing.assert_array_equal(states[0]["params"][n], states[1]["params"][n])
            final = states[0]["params"][n].numpy()
            assert np.isfinite(final).all()
            goal = (targets(0, SHAPES)[n] + targets(1, SHAPES)[n]) / 2
            assert np.abs(final - goal).mean() < 0.9 * np.abs(start[n] - goal).mean(), (tag, n)
        chains = states[0]["trainer"]["engine"]["worker"]
        assert chains and all(c["error"].dtype.is_floating_point and
                              str(c["error"].dtype) == "torch.float32" for c in chains.values())
    autocast = [load_state(tmp_path, "autocast", r)["params"] for r in range(2)]
    assert_identical(autocast[0], autocast[1])
    losses = load_reports(tmp_path, 2)[0]["autocast"]["losses"]
    assert np.isfinite(losses).all() and losses[-1] < 0.85 * losses[0], losses
    for rank in range(2):
        assert_identical(load_state(tmp_path, "compiled", rank)["params"],
                         load_state(tmp_path, "eager", rank)["params"])


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None, reason="inductor needs a C++ compiler")
def test_a_model_compiled_by_inductor_trains_as_uncompiled(tmp_path):
    # inductor's generated kernels: the same gradients reach the hooks as without it
    params = TOPK_EF
    runs = [{"tag": "eager", "params": params},
            {"tag": "compiled", "params": params, "compile": "inductor"}]
    lrs = [0.25, 0.25, 0.125]
    result = launch({"runs": runs, "lrs": lrs, "stop": len(lrs)}, tmp_path, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:]
    for rank in range(2):
        assert_identical(load_state(tmp_path, "compiled", rank)["params"],
                         load_state(tmp_path, "eager", rank)["params"])


if __name__ == "__main__":
    # exits without the interpreter's finalization, which costs 0.3-0.5 s of CPU
    # per process after torch (every test's cluster is on the same two cores)
    from bps.server.role import end_process

    end_process(worker_main(json.loads(sys.argv[1]), train))
