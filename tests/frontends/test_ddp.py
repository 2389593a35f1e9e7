"""The DDP communication hook (bps.ddp) end to end: DDP over gloo, bps's servers behind.

This module is also the worker program: ``python -m tests.frontends.test_ddp
CONFIG_JSON`` is what every worker process runs under ``bpslaunch local``; it calls
``dist.init_process_group("gloo")`` with no rendezvous arguments (bpslaunch exports RANK,
WORLD_SIZE, MASTER_*). The model is tests/harness/trainer_job.py's (loss
``0.5 * ||w - t||^2``, so the gradient is ``w - t`` exactly), wrapped in DDP, so every
result is compared with an independent numpy replay of the same partitions through the
reference chains.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.harness.trainer_job import (
    COMM_LRS,
    COMM_SHAPES,
    MOMENTUM,
    SHAPES,
    SIM_CASES,
    SIM_LRS,
    comm_reference,
    initial_params,
    load_params,
    plain,
    replay,
    targets,
)
from tests.harness.trainer_job import launch as trainer_launch

# ----------------------------------------------------------------------------- worker side


def make_module(rank: int, shapes: dict, unused: tuple = ()):
    import torch

    class Closed(torch.nn.Module):
        """``forward(goals)`` gives ``sum 0.5 * ||w - goal||^2`` over the used tensors."""

        def forward(self, goals: dict):
            return sum(0.5 * ((getattr(self, n) - goals[n]) ** 2).sum()
                       for n in shapes if n not in unused)

    module = Closed()
    for name, value in initial_params(rank, shapes).items():
        module.register_parameter(name, torch.nn.Parameter(torch.from_numpy(value)))
    module.register_buffer("counter", torch.tensor([rank * 7 + 1], dtype=torch.int64))
    return module


def goals_of(rank: int, micro: int, shapes: dict) -> dict:
    import torch

    return {n: torch.from_numpy(t) for n, t in targets(rank + 100 * micro, shapes).items()}


def train(cfg: dict, run: dict, rank: int, shapes: dict, out: Path) -> dict:
    import torch
    from torch.distributed.algorithms.join import Join
    from torch.nn.parallel import DistributedDataParallel

    import bps.ddp

    tag = run["tag"]
    shapes = {**shapes, **{n: tuple(s) for n, s in run.get("extra", {}).items()}}
    module = make_module(rank, shapes, tuple(run.get("extra", {})))
    lrs = run.get("lrs", cfg["lrs"])
    start = run.get("start", 0)
    checkpoint = None
    if start:
        checkpoint = torch.load(out / f"ckpt{tag}{rank}.pt", weights_only=False)
        module.load_state_dict(checkpoint["model"])
    ddp = DistributedDataParallel(module, **run.get("ddp", {}))
    optimizer = torch.optim.SGD(ddp.parameters(), lr=lrs[0], momentum=MOMENTUM)
    # doubles its scale every step: the chains must follow each change
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4, growth_interval=1) \
        if run.get("scaler") else None
    if checkpoint is not None:
        state = checkpoint["hook"]  # unpickled: no threads, no sockets yet
        state.optimizer = optimizer
        optimizer.load_state_dict(checkpoint["optimizer"])
        if scaler is not None:
            scaler.load_state_dict(checkpoint["scaler"])
            if not run.get("drop_scaler"):  # else the hook refuses the first step
                state.scaler = scaler
    else:
        state = bps.ddp.HookState(run["params"], optimizer=optimizer, module=module,
                                  scaler=scaler)
    ddp.register_comm_hook(state, bps.ddp.ps_hook)
    report = {"counter": int(module.counter.item()),
              "optimizer_momentum": optimizer.param_groups[0]["momentum"]}
    steps = run.get("steps", [len(lrs)] * 64)[rank]
    join = Join([ddp]) if run.get("join") else contextlib.nullcontext()
    with join:
        for step in range(start, steps):
            for group in optimizer.param_groups:
                group["lr"] = lrs[step]
            optimizer.zero_grad()
            if run.get("accumulate"):
                with ddp.no_sync():
                    ddp(goals_of(rank, 1, shapes)).backward()
            goals = goals_of(rank, 0, shapes)
            if run.get("inf_at") == [rank, step]:  # this rank's gradient gets an inf
                goals["big"] = goals["big"].clone()
                goals["big"][0, 0] = float("inf")
            try:
                loss = ddp(goals)
                (loss if scaler is None else scaler.scale(loss)).backward()
            # nonfinite "raise": backward() raises everywhere (a RuntimeError); a state
            # without its scaler: the hook's ValueError
            except (RuntimeError, ValueError) as exc:
                report.setdefault("raised", []).append([step, str(exc)[-300:]])
                if run.get("drop_scaler"):
                    break
                continue
            if not all(torch.isfinite(p.grad).all() for p in ddp.parameters()
                       if p.grad is not None):
                report.setdefault("nan", []).append(step)  # "skip": NaN everywhere
                if scaler is not None:  # it finds the NaN, skips and backs off
                    scaler.step(optimizer)
                    scaler.update()
                continue
            if scaler is None:
                optimizer.step()
            else:
                scaler.step(optimizer)
                scaler.update()
            if run.get("save_at") == step + 1:
                torch.save({"model": module.state_dict(), "optimizer": optimizer.state_dict(),
                            "hook": state, "scaler": scaler and scaler.state_dict()},
                           out / f"ckpt{tag}{rank}.pt")
    report["stats"] = state.stats()
    report["scale"] = None if scaler is None else scaler.get_scale()
    np.savez(out / f"params{tag}{rank}.npz",
             **{n: getattr(module, n).detach().numpy() for n in shapes})
    state.close()
    return report


def worker_main(cfg: dict) -> int:
    import torch
    import torch.distributed as dist

    import bps

    torch.set_num_threads(1)
    bps.init()
    dist.init_process_group("gloo")  # CPU tensors: not the NCCL a GPU host defaults to
    rank = dist.get_rank()
    out = Path(cfg["out"])
    shapes = {name: tuple(shape) for name, shape in cfg["shapes"].items()}
    reports = {run["tag"]: train(cfg, run, rank, shapes, out) for run in cfg["runs"]}
    (out / f"report{rank}.json").write_text(json.dumps(reports))
    dist.barrier()  # neither rank tears gloo down while the other still talks
    bps.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    # no teardown: gloo's destructors aborted a loaded run after the results were written
    os._exit(0)


# ----------------------------------------------------------------------------- test side


def launch(cfg: dict, tmp: Path, workers: int = 2, servers: int = 1, local_size: int = 1,
           env: dict | None = None, timeout: float = 150) -> subprocess.CompletedProcess:
    """tests/harness/trainer_job.py's launch, running this module."""
    return trainer_launch(cfg, tmp, workers, servers, local_size,
                          {"BPS_TIMEOUT": "60", **(env or {})}, timeout, module=__name__)


def accumulated(shapes: dict):
    """A no_sync backward (goal t_{r+100}) then a synchronised one (goal t_r): their
    float32 sum, as autograd accumulates it."""
    f32 = np.float32
    return lambda step, r, w: {
        n: ((w[n] - targets(r + 100, shapes)[n]).astype(f32)
            + (w[n] - targets(r, shapes)[n]).astype(f32)).astype(f32) for n in shapes}


def joined(shapes: dict, steps: list[int]):
    """Node r has data for ``steps[r]`` steps, then contributes zeros (DDP's Join)."""
    g = plain(shapes)
    return lambda step, r, w: g(step, r, w) if step < steps[r] else {
        n: np.zeros(s, np.float32) for n, s in shapes.items()}


# ----------------------------------------------------------------------------- tests

COMMON = {"ef": "vanilla", "momentum": "nesterov", "fp16": False, "min_compress_bytes": 1000}
SMALL_BUCKETS = {"bucket_cap_mb": 0.0005}  # about a tensor per bucket: DDP rebuilds them


def test_hook_matches_the_replay_for_every_compressor_and_ddp_feature(tmp_path):
    """2 nodes x 2 servers, one launch: each compressor (with one DDP feature each),
    warmup, a tensor topk would not shrink, no_sync accumulation, Join with uneven
    data, an unused parameter under find_unused_parameters, an inf on one rank under
    both non-finite policies (against the replay without that step), a GradScaler whose
    scale doubles every step (against the replay without one); each against the
    replay. Then a second launch resumes randomk from its pickled hook state."""
    topk = {**SIM_CASES["topk"], **COMMON}
    runs = [
        {"tag": "onebit", "params": {**SIM_CASES["onebit"], **COMMON}},
        {"tag": "topk", "params": topk, "ddp": {"gradient_as_bucket_view": True}},
        {"tag": "randomk", "params": {**SIM_CASES["randomk"], **COMMON}, "ddp": SMALL_BUCKETS,
         "save_at": 3},  # pickles the hook's state after step 3 (must not disturb)
        {"tag": "dithering", "params": {**SIM_CASES["dithering"], **COMMON},
         "ddp": {"static_graph": True, **SMALL_BUCKETS}},
        {"tag": "bytegrad", "params": {**SIM_CASES["bytegrad"], **COMMON}},
        {"tag": "warmup", "params": {**SIM_CASES["onebit"], **COMMON, "warmup_steps": 2},
         "compressed_from": 2},
        {"tag": "dense", "params": {"compressor": "topk", "k": 0.6, **COMMON},
         "compressed_from": None},
        {"tag": "nosync", "params": topk, "accumulate": True, "ddp": SMALL_BUCKETS},
        {"tag": "join", "params": topk, "join": True, "steps": [5, 3],
         "lrs": [0.25] * 5},
        {"tag": "unused", "params": topk, "extra": {"unused": [5]},
         "ddp": {"find_unused_parameters": True, **SMALL_BUCKETS}},
        # an inf in rank 1's gradient at step 2: no worker applies that step
        {"tag": "skip", "params": {**topk, "nonfinite": "skip"}, "inf_at": [1, 2],
         "skipped": 2},
        {"tag": "raise", "params": topk, "inf_at": [1, 2], "skipped": 2},
        # scaled by 16, 32, ... 256 (powers of two): the replay without a scaler, exactly
        {"tag": "scaler", "params": {**SIM_CASES["randomk"], **COMMON}, "scaler": True,
         "save_at": 3},
        # the scale doubles for step 2, which an inf skips: no chain keeps that change
        {"tag": "scaler-skip", "params": {**SIM_CASES["randomk"], **COMMON, "nonfinite": "skip"},
         "scaler": True, "inf_at": [1, 2], "skipped": 2},
    ]
    covered = {run["params"]["compressor"] for run in runs}
    runs += [{"tag": name, "params": {**case, **COMMON}}  # every other compressor, plain
             for name, case in SIM_CASES.items() if name not in covered]
    result = launch({"runs": runs, "lrs": SIM_LRS}, tmp_path, workers=2, servers=2)
    assert result.returncode == 0, result.stdout[-3000:]
    reports = [json.loads((tmp_path / f"report{r}.json").read_text()) for r in range(2)]
    for run in runs:
        name = run["tag"]
        finals = load_params(tmp_path, 2, name)
        grads = (accumulated(SHAPES) if run.get("accumulate") else
                 joined(SHAPES, run["steps"]) if run.get("join") else plain(SHAPES))
        lrs = [lr for i, lr in enumerate(run.get("lrs", SIM_LRS)) if i != run.get("skipped")]
        expected = replay(run["params"], 2, lrs, grads, run.get("compressed_from", 0))
        for n in SHAPES:
            np.testing.assert_array_equal(finals[0][n], expected[n], err_msg=f"{name}: {n}")
            np.testing.assert_array_equal(finals[1][n], expected[n], err_msg=f"{name}: {n}")
        report = reports[0][name]
        assert report["counter"] == 1, name  # DDP broadcast rank 0's buffers
        assert report["optimizer_momentum"] == 0.0, name  # Nesterov moved into the chains
    for final in load_params(tmp_path, 2, "unused"):  # never used: rank 0's, untouched
        np.testing.assert_array_equal(final["unused"],
                                      initial_params(0, {**SHAPES, "unused": (5,)})["unused"])
    for r in range(2):  # "skip": NaN buckets on every rank; "raise": backward() raised
        assert reports[r]["skip"]["nan"] == [2] and "raised" not in reports[r]["skip"]
        [[step, message]] = reports[r]["raise"]["raised"]
        assert step == 2 and "'big' on worker node 1 has inf or NaN" in message, message
    assert reports[0]["skip"]["stats"]["totals"]["skipped_steps"] == 1
    assert reports[0]["scaler"]["scale"] == 2.0 ** (4 + len(SIM_LRS))
    assert reports[0]["scaler-skip"]["scale"] == 2.0 ** (4 + len(SIM_LRS) - 2)
    stats = reports[0]["topk"]["stats"]
    assert stats["compression_ratio"] > 1.5 and stats["totals"]["steps"] == len(SIM_LRS)

    # Exact resume: fresh processes load randomk's pickled state (error, momentum and
    # RNG state of every worker and server chain; the scales too, with a scaler) and run
    # steps 3 and 4 with another job seed; they end where the uninterrupted runs (and
    # the replay) ended.
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    again = [{**run, "start": 3} for run in runs if "save_at" in run]
    for run in again:
        for r in range(2):
            name = f"ckpt{run['tag']}{r}.pt"
            (resumed / name).write_bytes((tmp_path / name).read_bytes())
    # the scaler's checkpoint, but the loop forgets to give the state its scaler
    forgot = {**again[1], "tag": "forgot", "drop_scaler": True}
    for r in range(2):
        (resumed / f"ckptforgot{r}.pt").write_bytes((tmp_path / f"ckptscaler{r}.pt")
                                                    .read_bytes())
    result = launch({"runs": [*again, forgot], "lrs": SIM_LRS}, resumed, workers=2,
                    servers=2, env={"BPS_JOB_SEED": "999"})
    assert result.returncode == 0, result.stdout[-3000:]
    for r in range(2):
        report = json.loads((resumed / f"report{r}.json").read_text())
        [[step, message]] = report["forgot"]["raised"]
        assert step == 3 and "saved with a GradScaler: set state.scaler" in message, message
    for run in again:
        whole = load_params(tmp_path, 2, run["tag"])
        for r, final in enumerate(load_params(resumed, 2, run["tag"])):
            for n in SHAPES:
                np.testing.assert_array_equal(final[n], whole[r][n],
                                              err_msg=f"resumed {run['tag']}: {n}")


def test_a_hook_state_that_never_ran_fails_the_first_step_and_warns_at_close(caplog):
    """Lightning's DDPStrategy(ddp_comm_hook=...) on CPUs never registers the hook: the
    first optimizer step raises saying what to do, before any parameter changes (of the
    state's optimizer only, where it has one), and close() warns."""
    import torch

    import bps.ddp

    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model(torch.ones(1, 3)).sum().backward()
    before = [p.detach().clone() for p in model.parameters()]
    state = bps.ddp.HookState({"compressor": "topk", "k": 0.5})
    with pytest.raises(RuntimeError, match=r"optimizer.step\(\) ran, but no DDP model ran "
                       r"bps.ddp.ps_hook .* on CPUs add callbacks=\[bps.lightning"):
        optimizer.step()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))

    def closure():  # Lightning's way: the backward runs inside step(), the check after it
        optimizer.zero_grad()
        loss = model(torch.ones(1, 3)).sum()
        loss.backward()
        return loss

    with pytest.raises(RuntimeError, match=r"optimizer.step\(\) ran, but no DDP model"):
        optimizer.step(closure)
    assert model.weight.grad is not None  # the closure ran
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    other = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.5)
    state.optimizer = optimizer
    other.step()  # not the state's optimizer: not its business
    with caplog.at_level("WARNING", logger="bps"):
        state.close()
    assert "HookState.close(): no DDP model ran bps.ddp.ps_hook" in caplog.text
    optimizer.step()  # closed: no longer watched
    assert not all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))


# tests/frontends/test_trainer_comm_dtype.py covers the pipeline's 2 x 2 fp16 roundings,
# and test_hook_matches_the_replay_for_every_compressor_and_ddp_feature the hook
@pytest.mark.slow
@pytest.mark.parametrize("env", [pytest.param({}, id="host"),
                                 # the trainer's device-forced runs cover the pipeline
                                 pytest.param({"BPS_DEVICE_KERNELS": "1"}, id="device-forced",
                                              marks=pytest.mark.slow)])
def test_two_local_ranks_reduce_in_fp16(tmp_path, env):
    """2 nodes x 2 local ranks x 2 servers, fp16 within the node and on the wire: the
    exact roundings of tests/harness/trainer_job.py's comm_reference (which
    tests/frontends/test_trainer_comm_dtype.py checks through the trainer)."""
    LRS, FP16_SHAPES, reference = COMM_LRS, COMM_SHAPES, comm_reference

    runs = [{"tag": "fp16", "params": {"momentum": "nesterov", "comm_dtype": "fp16"},
             "ddp": SMALL_BUCKETS}]
    result = launch({"runs": runs, "lrs": LRS, "shapes": FP16_SHAPES}, tmp_path, workers=2,
                    servers=2, local_size=2, env={"BYTEPS_PARTITION_BYTES": "4000", **env})
    assert result.returncode == 0, result.stdout[-3000:]
    expected = reference("fp16")
    for rank, final in enumerate(load_params(tmp_path, 4, "fp16")):
        for n in FP16_SHAPES:
            np.testing.assert_array_equal(final[n], expected[n], err_msg=f"{n} {rank}")
    # the node's figures are on its local rank 0; the other says n/a, not a ratio of 0
    ratios = [json.loads((tmp_path / f"report{r}.json").read_text())["fp16"]["stats"]
              ["compression_ratio"] for r in range(4)]
    assert ratios[1] is None and ratios[3] is None, ratios
    assert ratios[0] > 1.5 and ratios[2] > 1.5, ratios  # fp16 halves float32


if __name__ == "__main__":
    # exits without the interpreter's finalization, which costs 0.3-0.5 s of CPU
    # per process after torch (every test's cluster is on the same two cores)
    from bps.server.role import end_process

    end_process(worker_main(json.loads(sys.argv[1])))
