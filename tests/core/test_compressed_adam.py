"""Compressed Adam (``compression_params["freeze_step"]``, bps/core/compressed_adam.py)
on real clusters, bit for bit against the numpy replay of tests/harness/adam_reference.py:
plain steps on the uncompressed average, then the variance frozen and the momentum
through the chain with error feedback on workers and servers; checkpoints on either side
of the freeze resume bit-identical; the momentum mask; what is refused.

This module is also the worker program (tests/harness/trainer_job.py's ``worker_main``
with this module's ``train``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.harness import adam_reference as ref
from tests.harness.trainer_job import (
    SHAPES,
    initial_params,
    load_params,
    make_model,
    step_faults,
    targets,
    worker_main,
)
from tests.harness.trainer_job import launch as trainer_launch

LRS = [0.01, 0.02, 0.02, 0.01, 0.005, 0.01, 0.01, 0.005]
BASE = {"ef": "vanilla", "fp16": False, "min_compress_bytes": 1000}
ONEBIT = {"compressor": "onebit", **BASE, "freeze_step": 3}
TOPK = {"compressor": "topk", "k": 0.1, **BASE, "freeze_step": 2}
RUNS = [
    {"tag": "onebit", "params": ONEBIT, "optimizer": "AdamW", "wd": 0.1, "device": True},
    {"tag": "topk", "params": TOPK, "optimizer": "Adam", "wd": 0.01, "device": True},
    {"tag": "nodecay", "params": ONEBIT, "optimizer": "AdamW", "wd": 0.0},
    {"tag": "ddp-onebit", "params": ONEBIT, "optimizer": "AdamW", "wd": 0.1, "ddp": True},
    {"tag": "ddp-topk", "params": TOPK, "optimizer": "Adam", "wd": 0.01, "ddp": True},
    # optimizer.step(closure), as Lightning steps: the backward runs inside the step
    {"tag": "ddp-closure", "params": ONEBIT, "optimizer": "AdamW", "wd": 0.1, "ddp": True,
     "closure": True},
    {"tag": "ddp-part2", "params": ONEBIT, "optimizer": "AdamW", "wd": 0.1, "ddp": True,
     "stop": 2, "save": "ddp2"},
    {"tag": "ddp-resumed2", "params": ONEBIT, "optimizer": "AdamW", "wd": 0.1, "ddp": True,
     "load": "ddp2"},
    # checkpoints: after the freeze, and before it (the resumed run crosses it)
    {"tag": "part5", "params": ONEBIT, "optimizer": "AdamW", "wd": 0.1, "stop": 5,
     "save": "ckpt5"},
    {"tag": "resumed5", "params": ONEBIT, "optimizer": "AdamW", "wd": 0.1, "load": "ckpt5"},
    {"tag": "part2", "params": ONEBIT, "optimizer": "AdamW", "wd": 0.1, "stop": 2,
     "save": "ckpt2"},
    {"tag": "resumed2", "params": ONEBIT, "optimizer": "AdamW", "wd": 0.1, "load": "ckpt2"},
]


# ----------------------------------------------------------------------------- worker side


def train_ddp(run: dict, rank: int, shapes: dict, out: Path) -> dict:
    """The same job through DDP and the bps hook; the optimizer's step is the user's."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import bps.ddp

    class Toy(torch.nn.Module):
        def forward(self, goal: dict, live: dict) -> torch.Tensor:
            return sum((getattr(self, n) * ((getattr(self, n).detach() - goal[n]) * live[n])
                        ).sum() for n in shapes)

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    toy = Toy()
    for name, value in initial_params(rank, shapes).items():
        toy.register_parameter(name, torch.nn.Parameter(torch.from_numpy(value)))
    start, saved = 0, None
    if "load" in run:  # the hook's state pickled with the rest
        saved = torch.load(out / f"{run['load']}-{rank}.pt", weights_only=False)
        toy.load_state_dict(saved["model"])
        start = saved["step"]
    ddp = DistributedDataParallel(toy)
    optimizer = getattr(torch.optim, run["optimizer"])(ddp.parameters(), lr=LRS[0],
                                                       weight_decay=run["wd"])
    if saved is not None:
        state = saved["hook"]
        state.optimizer = optimizer
        optimizer.load_state_dict(saved["optimizer"])
    else:
        state = bps.ddp.HookState(run["params"], optimizer=optimizer, module=toy)
    ddp.register_comm_hook(state, bps.ddp.ps_hook)
    goal = {n: torch.from_numpy(t) for n, t in targets(rank, shapes).items()}
    live = {n: torch.from_numpy(t) for n, t in ref.live_mask(shapes).items()}
    for step in range(start, run.get("stop", len(LRS))):
        for group in optimizer.param_groups:
            group["lr"] = LRS[step]
        optimizer.zero_grad()
        if run.get("closure"):
            def closure() -> torch.Tensor:
                loss = ddp(goal, live)
                loss.backward()
                return loss
            optimizer.step(closure)
        else:
            ddp(goal, live).backward()
            optimizer.step()
    if "save" in run:
        torch.save({"model": toy.state_dict(), "optimizer": optimizer.state_dict(),
                    "hook": state, "step": run["stop"]}, out / f"{run['save']}-{rank}.pt")
    np.savez(out / f"params{run['tag']}{rank}.npz",
             **{n: getattr(toy, n).detach().numpy() for n in shapes})
    state.close()
    return {}


def train(cfg: dict, run: dict, rank: int, shapes: dict, out: Path) -> dict:
    import torch

    import bps

    if run.get("ddp"):
        return train_ddp(run, rank, shapes, out)

    model = make_model(rank, shapes)
    cls = getattr(torch.optim, run["optimizer"])
    optimizer = cls(model.parameters(), lr=LRS[0], weight_decay=run["wd"])
    trainer = bps.DistributedTrainer(model, optimizer, run["params"])
    start = 0
    if "load" in run:
        saved = torch.load(out / f"{run['load']}-{rank}.pt", weights_only=False)
        model.load_state_dict(saved["model"])
        trainer.load_state_dict(saved["trainer"])
        start = saved["step"]
    goal = {n: torch.from_numpy(t) for n, t in targets(rank, shapes).items()}
    live = {n: torch.from_numpy(t) for n, t in ref.live_mask(shapes).items()}
    elastic = any(k in cfg for k in ("leave", "kill", "kill_server"))
    if "kill" in cfg:  # a node that joined starts where the node it joined from stands
        start = trainer.step_count
    report = {"pushed": [], "applied": [], "start": start}
    for step in range(start, run.get("stop", len(LRS))):
        step_faults(cfg, rank, step, out)
        for group in optimizer.param_groups:
            group["lr"] = LRS[step]
        trainer.zero_grad()
        loss = sum((getattr(model, n) * ((getattr(model, n).detach() - goal[n]) * live[n])).sum()
                   for n in shapes)
        loss.backward()
        applied = trainer.step()
        assert applied or elastic  # a step dropped when a worker node left or joined
        report["applied"].append(applied)
        report["pushed"].append(trainer.stats()["bytes_pushed"])
    if "save" in run:
        torch.save({"model": model.state_dict(), "trainer": trainer.state_dict(),
                    "step": run["stop"]}, out / f"{run['save']}-{rank}.pt")
    np.savez(out / f"params{run['tag']}{rank}.npz",
             **{n: getattr(model, n).detach().numpy() for n in shapes})
    report["state_keys"] = sorted(optimizer.state_dict()["state"][0])
    trainer.close()
    return report


# ----------------------------------------------------------------------------- test side


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("compressed_adam")
    proc = trainer_launch({"runs": RUNS}, tmp, workers=2, module=__name__, timeout=300)
    assert proc.returncode == 0, proc.stdout[-6000:]
    return tmp


def expected(run: dict) -> dict:
    return ref.simulate(run["params"], 2, LRS, SHAPES, wd=run["wd"],
                        decoupled=run["optimizer"] == "AdamW")


@pytest.mark.parametrize("tag", ["onebit", "topk", "nodecay", "ddp-onebit", "ddp-topk"])
def test_matches_the_numpy_replay_bit_for_bit(cluster, tag):
    run = next(r for r in RUNS if r["tag"] == tag)
    want = expected(run)
    for rank, got in enumerate(load_params(cluster, 2, tag)):
        for name in SHAPES:
            np.testing.assert_array_equal(got[name], want[name], err_msg=f"{tag} {name} r{rank}")


def test_a_worker_node_that_dies_costs_one_step(tmp_path):
    """``--min-workers 2``: node 2 of 3 is killed (SIGKILL) at the start of step 4, after
    the freeze: that step is dropped on both survivors (no Adam state, no parameter, no
    chain moves), the later ones average the momenta of the two; the survivors end as the
    replay of that membership, bit for bit."""
    run = {"tag": "elastic", "params": ONEBIT, "optimizer": "AdamW", "wd": 0.1}
    proc = trainer_launch({"runs": [run], "leave": [2, 4, "SIGKILL"]}, tmp_path, workers=3,
                          module=__name__, timeout=180, options=("--min-workers", "2"))
    assert proc.returncode == 0, proc.stdout[-6000:]
    reports = [json.loads((tmp_path / f"report{r}.json").read_text())["elastic"]
               for r in (0, 1)]
    assert reports[0]["applied"] == reports[1]["applied"] == [s != 4 for s in range(8)]
    members = [[0, 1, 2]] * 4 + [None] + [[0, 1]] * 3
    want = ref.simulate(ONEBIT, 3, LRS, SHAPES, wd=0.1, members=members)
    # without the drop (Adam's count, the freeze and the chains moved by step 4) it differs
    moved = ref.simulate(ONEBIT, 3, LRS, SHAPES, wd=0.1, members=[[0, 1, 2]] * 4 + [[0, 1]] * 4)
    assert any(not np.array_equal(want[n], moved[n]) for n in SHAPES)
    for rank, got in enumerate(load_params(tmp_path, 2, "elastic")):
        for name in SHAPES:
            np.testing.assert_array_equal(got[name], want[name], err_msg=f"{name} r{rank}")


def test_a_restarted_worker_node_joins_after_the_freeze(tmp_path):
    """Node 2 of 3 is killed at the start of step 4 (after the freeze) and restarted by
    ``--max-restarts 1``; the others wait at step 5 until it joined. The death and the
    join each drop a step on the nodes present; the joiner starts from the state sent
    (Adam's moments, the step count), its chains' error from zero; every node ends as
    the replay of that membership, bit for bit."""
    run = {"tag": "rejoin", "params": ONEBIT, "optimizer": "AdamW", "wd": 0.1}
    proc = trainer_launch({"runs": [run], "kill": [2, 4], "wait_at": 5}, tmp_path,
                          workers=3, module=__name__, timeout=180,
                          options=("--min-workers", "2", "--max-restarts", "1"))
    assert proc.returncode == 0, proc.stdout[-6000:]
    assert "joined: worker nodes [0, 1, 2] (membership generation 2)" in proc.stdout, \
        proc.stdout[-6000:]
    reports = [json.loads((tmp_path / f"report{r}.json").read_text())["rejoin"]
               for r in range(3)]
    start = reports[2]["start"]
    dropped = start - 1  # the step the join dropped on the nodes present
    assert 5 <= dropped < len(LRS) - 1, reports
    assert reports[2]["applied"] == [True] * (len(LRS) - start), reports
    for survivor in reports[:2]:
        assert survivor["applied"] == [s not in (4, dropped) for s in range(len(LRS))], reports
    members = [[0, 1, 2]] * 4 + [None] + [[0, 1]] * (dropped - 5) + [None] + \
        [[0, 1, 2]] * (len(LRS) - start)
    want = ref.simulate(ONEBIT, 3, LRS, SHAPES, wd=0.1, members=members,
                        fresh_workers={2: start})
    # the joiner's error feedback from zero makes a difference the replay sees
    kept = ref.simulate(ONEBIT, 3, LRS, SHAPES, wd=0.1, members=members)
    assert any(not np.array_equal(want[n], kept[n]) for n in SHAPES)
    for rank, got in enumerate(load_params(tmp_path, 3, "rejoin")):
        for name in SHAPES:
            np.testing.assert_array_equal(got[name], want[name], err_msg=f"{name} r{rank}")


def test_a_spare_takes_the_keys_of_a_server_killed_after_the_freeze(tmp_path):
    """Server 1 of 2 is killed at the start of step 4 (after the freeze) and a spare
    takes its keys: step 4 is dropped on both nodes, the server error feedback of the
    partitions it held restarts at zero; both end as the replay, bit for bit. (Largest
    payload first onto the least-loaded server: the raw key of 11 floats goes to server
    0, the three onebit partitions of "big", a fifth of its size each, to server 1.)"""
    run = {"tag": "spare", "params": ONEBIT, "optimizer": "AdamW", "wd": 0.1}
    proc = trainer_launch({"runs": [run], "kill_server": [1, 4]}, tmp_path, servers=2,
                          module=__name__, timeout=180, options=("--spare-servers", "1"))
    assert proc.returncode == 0, proc.stdout[-6000:]
    assert "server 1 is now served from" in proc.stdout, proc.stdout[-6000:]
    members = [[0, 1]] * 4 + [None] + [[0, 1]] * 3
    want = ref.simulate(ONEBIT, 2, LRS, SHAPES, wd=0.1, members=members,
                        fresh_servers={5: [0, 1, 2]})
    # the replay tells the reset apart: without it the moved partition would differ
    kept = ref.simulate(ONEBIT, 2, LRS, SHAPES, wd=0.1, members=members)
    assert not np.array_equal(want["big"], kept["big"])
    for rank, got in enumerate(load_params(tmp_path, 2, "spare")):
        for name in SHAPES:
            np.testing.assert_array_equal(got[name], want[name], err_msg=f"{name} r{rank}")


def test_a_step_given_a_closure_applies_its_own_update(cluster):
    """``optimizer.step(closure)`` (Lightning's way): the backward inside the step arms
    the update, which follows the closure. Within an ulp of the replay: a few elements
    differ from the closure-free run by one ulp, not yet explained; the update of the
    step before, which the step applied before the closure ran, is far off."""
    want = expected(next(r for r in RUNS if r["tag"] == "ddp-closure"))
    for rank, got in enumerate(load_params(cluster, 2, "ddp-closure")):
        for name in SHAPES:
            np.testing.assert_allclose(got[name], want[name], rtol=1e-6, atol=1e-7,
                                       err_msg=f"closure {name} r{rank}")


def test_a_skipped_step_leaves_parameters_and_adam_state_alone():
    """A step the servers skipped (NaN in ``.grad``, the DDP hook's ``nonfinite``
    policy without an error): the user's ``optimizer.step()`` changes none of it."""
    import torch

    from bps.core.compressed_adam import AdamCoupling

    p = torch.nn.Parameter(torch.ones(4))
    optimizer = torch.optim.AdamW([p], lr=0.1, weight_decay=0.1)
    coupling = AdamCoupling(optimizer, 2, [p])
    p.grad = torch.full((4,), 0.5)
    coupling.arm(False)
    optimizer.step()
    before = p.detach().clone()
    state = {k: v.clone() for k, v in optimizer.state[p].items()}
    p.grad = torch.full((4,), float("nan"))
    coupling.skip()
    optimizer.step()
    assert torch.equal(p.detach(), before)
    assert all(torch.equal(optimizer.state[p][k], v) for k, v in state.items())
    assert torch.isnan(p.grad).all()  # given back after the step
    coupling.close()


def test_the_device_chains_match_the_replay_too(tmp_path):
    """``BPS_DEVICE_KERNELS=1``: the chains' torch kernels (a GPU's) on CPU tensors."""
    runs = [r for r in RUNS if r.get("device")]
    proc = trainer_launch({"runs": runs}, tmp_path, workers=2, module=__name__, timeout=300,
                          env={"BPS_DEVICE_KERNELS": "1"})
    assert proc.returncode == 0, proc.stdout[-6000:]
    for run in runs:
        want = expected(run)
        for rank, got in enumerate(load_params(tmp_path, 2, run["tag"])):
            for name in SHAPES:
                np.testing.assert_array_equal(got[name], want[name],
                                              err_msg=f"{run['tag']} {name} r{rank}")


def test_frozen_steps_push_less_and_keep_the_optimizer_state(cluster):
    report = json.loads((cluster / "report0.json").read_text())["onebit"]
    pushed = report["pushed"]
    # onebit momentum of the big tensor vs its raw fp32 gradient (small and bias raw)
    assert max(pushed[3:]) * 3 < min(pushed[:3]), pushed
    assert report["state_keys"] == ["exp_avg", "exp_avg_sq", "step"]


def test_momentum_mask_keeps_never_moving_entries_still(cluster):
    """Entries whose gradient is always zero have zero variance: after the freeze the
    compressed momentum (signs times a scale) would move them by ``m / eps``."""
    start = initial_params(0, SHAPES)
    for got in load_params(cluster, 2, "nodecay"):
        np.testing.assert_array_equal(got["big"][0], start["big"][0])
        np.testing.assert_array_equal(got["bias"][0], start["bias"][0])
        assert not np.array_equal(got["big"][1], start["big"][1])


@pytest.mark.parametrize("tag", ["resumed5", "resumed2", "ddp-resumed2"])
def test_resume_on_either_side_of_the_freeze_is_bit_identical(cluster, tag):
    full = load_params(cluster, 2, "ddp-onebit" if tag.startswith("ddp") else "onebit")
    for rank, got in enumerate(load_params(cluster, 2, tag)):
        for name in SHAPES:
            np.testing.assert_array_equal(got[name], full[rank][name], err_msg=f"{tag} {name}")


def test_kernels_match_the_numpy_formulas():
    import torch

    from bps.core.compressed_adam import frozen_step_, local_momentum_, plain_step_

    rng = np.random.default_rng(5)
    x, g, m = (rng.standard_normal(4096).astype(np.float32) for _ in range(3))
    v = (rng.standard_normal(4096) ** 2).astype(np.float32)
    v[:7] = 0
    tx, tm, tv = torch.from_numpy(x.copy()), torch.from_numpy(m.copy()), torch.from_numpy(v.copy())
    plain_step_(tx, torch.from_numpy(g), tm, tv, 5, 0.003, 0.9, 0.99, 1e-8, 0.0, True)
    f32 = np.float32
    wm = ((m * f32(0.9)).astype(f32) + (g * f32(1 - 0.9)).astype(f32)).astype(f32)
    wv = ((v * f32(0.99)).astype(f32) + ((g * g).astype(f32) * f32(1 - 0.99))).astype(f32)
    assert tm.numpy().tobytes() == wm.tobytes() and tv.numpy().tobytes() == wv.tobytes()
    assert tx.numpy().tobytes() == ref.descend(x, wm, wv, 5, 5, 0.003, 0.9, 0.99, 1e-8).tobytes()
    tg = torch.from_numpy(g.copy())
    local_momentum_(tg, torch.from_numpy(m), torch.from_numpy(x), 0.9, 0.01, False)
    gl = (g + (x * f32(0.01)).astype(f32)).astype(f32)
    want = ((gl * f32(1 - 0.9)).astype(f32) + (m * f32(0.9)).astype(f32)).astype(f32)
    assert tg.numpy().tobytes() == want.tobytes()
    tx, tm = torch.from_numpy(x.copy()), torch.from_numpy(m.copy())
    frozen_step_(tx, torch.from_numpy(g), tm, torch.from_numpy(v), 9, 4, 0.003, 0.9, 0.99,
                 1e-8, 0.1, True)
    wm = np.where(v > 0, g, f32(0)).astype(f32)
    xd = (x * f32(1 - 0.003 * 0.1)).astype(f32)
    assert tm.numpy().tobytes() == wm.tobytes()
    assert tx.numpy().tobytes() == ref.descend(xd, wm, v, 9, 4, 0.003, 0.9, 0.99, 1e-8).tobytes()
    assert np.array_equal(tx.numpy()[:7], xd[:7])  # masked: decay only


def _toy():
    import torch

    model = torch.nn.Linear(4, 2)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


@pytest.mark.parametrize("kwargs, exc, words", [
    ({"staleness": 1}, ValueError, ["staleness=1", "freeze_step"]),
    ({"sync_every": 4}, ValueError, ["sync_every=4", "freeze_step"]),
    ({"sync_every": 4, "fragments": 2}, ValueError, ["sync_every=4", "freeze_step"]),
    ({"optimizer": "SGD"}, TypeError, ["freeze_step", "Adam", "SGD"]),
    ({"amsgrad": True}, ValueError, ["amsgrad", "freeze_step"]),
])
def test_what_does_not_go_is_refused_before_anything_is_sent(kwargs, exc, words):
    import torch

    import bps

    model, optimizer = _toy()
    kwargs = dict(kwargs)
    if kwargs.pop("optimizer", None) == "SGD":
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if kwargs.pop("amsgrad", False):
        optimizer = torch.optim.Adam(model.parameters(), lr=0.1, amsgrad=True)
    with pytest.raises(exc) as info:  # no bps.init(): nothing may have been sent
        bps.DistributedTrainer(model, optimizer, ONEBIT, **kwargs)
    for word in words:
        assert word in str(info.value), str(info.value)


def test_the_hook_refuses_what_does_not_go():
    import torch

    import bps.ddp

    model, optimizer = _toy()
    with pytest.raises(TypeError, match="freeze_step.*SGD"):
        bps.ddp.HookState(ONEBIT, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="GradScaler"):
        bps.ddp.HookState(ONEBIT, optimizer=optimizer, scaler=torch.amp.GradScaler("cpu"))


@pytest.mark.parametrize("params, words", [
    ({"freeze_step": 5}, ["freeze_step", "no compressor"]),
    ({"compressor": "onebit", "freeze_step": 0}, ["freeze_step", "int >= 1"]),
    ({"compressor": "onebit", "freeze_step": 3, "momentum": "nesterov"}, ["momentum"]),
    ({"compressor": "onebit", "freeze_step": 3, "warmup_steps": 2}, ["warmup_steps"]),
])
def test_bad_freeze_step_is_named(params, words):
    from bps.compressors import validate_compression_params

    with pytest.raises(ValueError) as info:
        validate_compression_params(params)
    for word in words:
        assert word in str(info.value), str(info.value)
    ok = validate_compression_params({"compressor": "onebit", "freeze_step": 4})
    assert (ok["freeze_step"], ok["warmup_steps"]) == (4, 4)


if __name__ == "__main__":
    from bps.server.role import end_process

    end_process(worker_main(json.loads(sys.argv[1]), train))
