"""DistributedTrainer end to end: real clusters started with ``bpslaunch local``.

This file is also the worker script: ``python tests/test_trainer.py CONFIG_JSON`` is what
every worker process runs. Each worker trains a tiny model whose gradient is known in
closed form (loss ``0.5 * ||w - t_rank||^2``, so ``grad = w - t_rank`` exactly), which
lets the tests replay the whole pipeline in numpy.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
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
    device = torch.device(cfg.get("device", "cpu"))
    model = make_model(rank, shapes).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg["lrs"][0], momentum=MOMENTUM)
    trainer = bps.DistributedTrainer(model, optimizer, run["params"])
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
        for group in optimizer.param_groups:
            group["lr"] = cfg["lrs"][step]
        trainer.zero_grad()
        # grad = w - t_rank, exact on every device (the backward of 0.5 * (w - t) ** 2
        # goes through pow(x, 1), which a GPU rounds differently)
        loss = sum((getattr(model, n) * (getattr(model, n).detach() - goal[n])).sum()
                   for n in shapes)
        pushes_before = engine.stats.pushes if engine is not None else 0
        loss.backward()
        if engine is not None and cfg.get("pushes_per_step"):
            # The hooks alone (no step() yet) must get every push answered.
            deadline = time.monotonic() + 20
            while engine.stats.pushes - pushes_before < cfg["pushes_per_step"]:
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
    trainer.close()
    return report


def worker_main(cfg: dict, train: Callable[..., dict] = train) -> int:
    """One worker process: ``train(cfg, run, rank, shapes, out)`` for each of
    ``cfg["runs"]``, reports to ``report{rank}.json`` (also the worker of the other
    trainer test files, each with its own ``train``)."""
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
    reports = {run.get("tag", ""): train(cfg, run, rank, shapes, out) for run in cfg["runs"]}
    (out / f"report{rank}.json").write_text(json.dumps(reports))
    bps.shutdown()
    return 0


# ----------------------------------------------------------------------------- test side


def launch(cfg: dict, tmp: Path, workers: int = 2, servers: int = 1, local_size: int = 1,
           env: dict | None = None, timeout: float = 120,
           script: str = __file__) -> subprocess.CompletedProcess:
    """Run ``script``'s worker_main on a ``bpslaunch local`` cluster with ``cfg``."""
    from tests.ps_job import BPSLAUNCH

    cfg = {"shapes": SHAPES, **cfg, "out": str(tmp)}
    cmd = [*BPSLAUNCH, "local", "--workers", str(workers), "--servers", str(servers),
           "--local-size", str(local_size), "--", sys.executable, script, json.dumps(cfg)]
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


def load_params(tmp: Path, ranks: int, tag: str = "") -> list[dict]:
    return [dict(np.load(tmp / f"params{tag}{r}.npz")) for r in range(ranks)]


def load_reports(tmp: Path, ranks: int) -> list[dict]:
    return [json.loads((tmp / f"report{r}.json").read_text()) for r in range(ranks)]


def nesterov(mu: np.float32, g: np.ndarray, m: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """docs/compression.md momentum: m = g + mu*m; g' = g + mu*m (float32, two roundings each)."""
    m = (g + mu * m).astype(np.float32)
    return (g + mu * m).astype(np.float32), m


SIM_LRS = [0.5, 0.25, 0.25, 0.5, 0.125]  # powers of two: lr * g is exact everywhere
SIM_SEED = 4242  # BPS_JOB_SEED: the trainer fills compression_params["seed"] with it
PARTITION = 100  # elements per partition: BYTEPS_PARTITION_BYTES=400, float32
SIM_CASES = {
    "onebit": {"compressor": "onebit", "scaling": True},
    "topk": {"compressor": "topk", "k": 0.1},
    "randomk": {"compressor": "randomk", "k": 0.1},
    "dithering": {"compressor": "dithering", "k": 4},
    "bytegrad": {"compressor": "bytegrad", "chunk": 16},
}


def reference_codec(params: dict, numel: int):
    """(encode, decode) of the compressor from tests/reference_compressors.py; decode
    gives float32 values, as the receiving side holds them."""
    import tests.reference_compressors as ref

    name, f32 = params["compressor"], "float32"
    if name == "onebit":
        return (lambda x: ref.onebit_encode(x, True),
                lambda p: ref.onebit_decode(p, numel, f32))
    if name == "bytegrad":
        return (lambda x: ref.bytegrad_encode(x, params["chunk"]),
                lambda p: ref.bytegrad_decode(p, numel, params["chunk"], f32))
    k = max(1, int(params["k"] * numel)) if name in ("topk", "randomk") else params["k"]
    if name == "topk":
        return (lambda x: ref.topk_encode(x, k, f32),
                lambda p: ref.topk_decode(p, numel, k, f32))
    rng = ref.XorShift128Plus(SIM_SEED)
    if name == "randomk":
        return (lambda x: ref.randomk_encode(x, k, f32, rng),
                lambda p: ref.randomk_decode(p, numel, k, f32))
    return (lambda x: ref.dithering_encode(x, k, "linear", "max", rng),
            lambda p: ref.round_to(ref.dithering_decode(p, numel, k, "linear"), f32))


def simulate(params: dict, nodes: int, lrs: list[float], compressed_from: int | None = 0,
             shapes: dict = SHAPES) -> dict:
    """The pipeline of docs/architecture.md in numpy: per node, g = (w - t_node) / nodes ->
    Momentum -> ErrorFeedback -> C; server: sum of the decoded payloads -> ErrorFeedback
    -> C; workers decode and take an SGD step. Tensors that travel raw (the small one
    always; the big one before step ``compressed_from``, or always if None) are summed
    and get the same Nesterov rule after the sum."""
    return replay(params, nodes, lrs, plain(shapes), compressed_from, shapes)


def replay(params: dict, nodes: int, lrs: list[float], grads, compressed_from: int | None = 0,
           shapes: dict = SHAPES) -> dict:
    """docs/architecture.md's pipeline in numpy (see ``simulate``), with node ``r``'s
    gradient at step ``s`` given by ``grads(s, r, w)`` (a dict of
    float32 arrays): ``big`` is compressed (from step ``compressed_from``; None: never),
    the rest travels raw and gets Nesterov momentum after the sum."""
    from tests.reference_compressors import RefChain

    f32 = np.float32
    w = initial_params(0, shapes)  # rank 0's parameters, broadcast at construction
    numel = int(np.prod(shapes["big"]))
    parts = [(o, min(PARTITION, numel - o)) for o in range(0, numel, PARTITION)]
    workers = [[RefChain(*reference_codec(params, n), n, "float32", True, MOMENTUM)
                for _, n in parts] for _ in range(nodes)]
    servers = [RefChain(*reference_codec(params, n), n, "float32", True, None)
               for _, n in parts]
    local_momentum = {n: np.zeros(shape, f32) for n, shape in shapes.items()}
    for step, lr in enumerate(lrs):
        shares = [{n: (g / f32(nodes)).astype(f32) for n, g in grads(step, r, w).items()}
                  for r in range(nodes)]
        out = {}
        for n in shapes:
            if n == "big" and compressed_from is not None and step >= compressed_from:
                continue
            summed = np.zeros(shapes[n], f32)
            for r in range(nodes):
                summed = (summed + shares[r][n]).astype(f32)
            out[n], local_momentum[n] = nesterov(f32(MOMENTUM), summed, local_momentum[n])
        if "big" not in out:
            big = np.zeros(numel, f32)
            for i, (offset, n) in enumerate(parts):
                summed = np.zeros(n, f32)
                for r in range(nodes):
                    workers[r][i].set_lr(lr)
                    share = shares[r]["big"].reshape(-1)[offset:offset + n]
                    decoded = workers[r][i].decode(workers[r][i].compress(share))
                    summed = (summed + decoded.astype(f32)).astype(f32)
                servers[i].set_lr(lr)
                big[offset:offset + n] = servers[i].decode(servers[i].compress(summed))
            out["big"] = big.reshape(shapes["big"])
        for n in shapes:
            w[n] = (w[n] - f32(lr) * out[n]).astype(f32)
    return w


def plain(shapes: dict):
    """One backward per step: node r's gradient is ``w - t_r``."""
    return lambda step, r, w: {n: (w[n] - targets(r, shapes)[n]).astype(np.float32)
                               for n in shapes}


# where the chains run: numba on the host; torch kernels and the staging of the device
# path forced onto CPU tensors; a CUDA model (two nodes sharing the GPU)
PATHS = [
    pytest.param({}, id="host"),
    pytest.param({"env": {"BPS_DEVICE_KERNELS": "1"}}, id="device-forced"),
    pytest.param({"cfg": {"device": "cuda"}}, id="cuda", marks=pytest.mark.cuda),
]


@pytest.mark.parametrize("path", PATHS)
def test_every_compressor_matches_independent_simulation(tmp_path, path):
    common = {"ef": "vanilla", "momentum": "nesterov", "fp16": False, "min_compress_bytes": 1000}
    runs = [{"tag": name, "params": {**case, **common}, "compressed_from": 0}
            for name, case in SIM_CASES.items()]
    runs += [  # warmup: raw for 2 steps; topk k=0.6 would not shrink the payload: raw
        {"tag": "warmup", "params": {**SIM_CASES["onebit"], **common, "warmup_steps": 2},
         "compressed_from": 2},
        {"tag": "dense", "params": {"compressor": "topk", "k": 0.6, **common},
         "compressed_from": None},
    ]
    # 3 nodes: the servers' float32 sums of 3 terms round as the simulation's only
    # because they add the pushes in node order, whichever arrives first. 4 pushes per
    # step: 3 partitions of big, and small and bias fused
    result = launch({"runs": runs, "lrs": SIM_LRS, "stop": len(SIM_LRS),
                     "pushes_per_step": 4, **path.get("cfg", {})}, tmp_path, workers=3,
                    servers=2, env=path.get("env"))
    assert result.returncode == 0, result.stdout[-3000:]
    reports = load_reports(tmp_path, 3)[0]
    for run in runs:
        name = run["tag"]
        finals = load_params(tmp_path, 3, name)
        for rank in (1, 2):
            for n in SHAPES:
                np.testing.assert_array_equal(finals[rank][n], finals[0][n], err_msg=name)
        expected = simulate(run["params"], 3, SIM_LRS, run["compressed_from"])
        # on a GPU, onebit's scale (a float64 sum of |x|) is added in another order: it
        # may round 1 float32 ulp apart (docs/compression.md); all else is exact
        sums_on_gpu = "device" in path.get("cfg", {}) and run["params"]["compressor"] == "onebit"
        for n in SHAPES:
            if sums_on_gpu:
                np.testing.assert_allclose(finals[0][n], expected[n], rtol=1e-5, atol=1e-6,
                                           err_msg=f"{name}: {n}")
            else:
                np.testing.assert_array_equal(finals[0][n], expected[n], err_msg=f"{name}: {n}")
        report = reports[name]
        assert report["optimizer_momentum"] == 0.0 and report["counter"] == 1
        assert [s["pushes"] for s in report["steps"]] == [4] * len(SIM_LRS), name
        ratios = [s["compression_ratio"] for s in report["steps"]]
        if run["compressed_from"] is None:
            assert max(ratios) < 1.01, (name, ratios)
        else:
            assert max(ratios[:run["compressed_from"]], default=0) < 1.01, (name, ratios)
            assert min(ratios[run["compressed_from"]:]) > 1.5, (name, ratios)


def test_small_tensors_beyond_one_bucket_split_at_its_capacity(tmp_path):
    # 100 float32 elements per bucket (BYTEPS_PARTITION_BYTES=400): in backward order
    # e, d and c fill one bucket exactly (30 + 30 + 40), b would overflow it and starts
    # the next with a; so a step pushes big's 3 partitions and 2 buckets. Offsets that
    # mixed up tensors, or a bucket past its capacity, change the parameters or the count.
    shapes = {"big": (30, 10), "a": (40,), "b": (40,), "c": (40,), "d": (30,), "e": (30,)}
    params = {**SIM_CASES["onebit"], "ef": "vanilla", "momentum": "nesterov", "fp16": False,
              "min_compress_bytes": 1000}
    result = launch({"runs": [{"params": params}], "lrs": SIM_LRS, "stop": len(SIM_LRS),
                     "pushes_per_step": 5, "shapes": shapes}, tmp_path, workers=3, servers=2)
    assert result.returncode == 0, result.stdout[-3000:]
    finals = load_params(tmp_path, 3)
    expected = simulate(params, 3, SIM_LRS, shapes=shapes)
    for n in shapes:
        np.testing.assert_array_equal(finals[0][n], expected[n], err_msg=n)
        np.testing.assert_array_equal(finals[2][n], finals[0][n], err_msg=n)
    steps = load_reports(tmp_path, 3)[0][""]["steps"]
    assert [s["pushes"] for s in steps] == [5] * len(SIM_LRS)


def test_fp16_two_local_ranks_per_node(tmp_path):
    shapes = {"big": (60, 50), "small": (7,), "bias": (4,)}  # small and bias: fused
    lrs = [0.1, 0.1, 0.05, 0.05]
    params = {"momentum": "nesterov", "fp16": True}
    result = launch({"runs": [{"params": params}], "lrs": lrs, "stop": len(lrs),
                     "shapes": shapes},
                    tmp_path, workers=2, servers=2, local_size=2,
                    env={"BYTEPS_PARTITION_BYTES": "4000"})
    assert result.returncode == 0, result.stdout[-3000:]
    finals = load_params(tmp_path, 4)
    for other in finals[1:]:
        for name in shapes:
            np.testing.assert_array_equal(other[name], finals[0][name])
    # Exact averaged SGD with local Nesterov momentum, in float64: fp16 only rounds.
    w = {n: v.astype(np.float64) for n, v in initial_params(0, shapes).items()}
    m = {n: np.zeros(shapes[n]) for n in shapes}
    goals = [targets(r, shapes) for r in range(4)]
    for lr in lrs:
        for n in shapes:
            g = np.mean([w[n] - goals[r][n] for r in range(4)], axis=0)
            m[n] = g + MOMENTUM * m[n]
            w[n] = w[n] - lr * (g + MOMENTUM * m[n])
    for n in shapes:
        np.testing.assert_allclose(finals[0][n], w[n], atol=2e-2, rtol=1e-2)
        assert not np.array_equal(finals[0][n], w[n].astype(np.float32))  # fp16 did round
    report = load_reports(tmp_path, 4)[0][""]
    assert report["counter"] == 1  # rank 0's buffer everywhere
    assert report["optimizer_momentum"] == 0.0  # moved into bps
    raw = sum(int(np.prod(s)) * 4 for s in shapes.values())
    assert report["steps"][-1]["raw_bytes"] == raw
    assert 0 < report["steps"][-1]["bytes_pushed"] < 0.6 * raw  # fp16 on the wire


def test_resume_from_state_dict_continues_exactly(tmp_path):
    # randomk: worker and server chains carry error, momentum and RNG state
    params = {"compressor": "randomk", "k": 0.1, "ef": "vanilla", "momentum": "nesterov",
              "fp16": False, "min_compress_bytes": 1000}
    lrs = [0.2, 0.2, 0.1, 0.1, 0.05, 0.05]
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    whole.mkdir()
    resumed.mkdir()
    # Uninterrupted 6 steps; a checkpoint is taken after step 3 (and must not disturb).
    run = launch({"runs": [{"params": params}], "lrs": lrs, "stop": 6, "save_at": 3},
                 whole, servers=2)
    assert run.returncode == 0, run.stdout[-3000:]
    for r in range(2):
        (resumed / f"ckpt{r}.pt").write_bytes((whole / f"ckpt{r}.pt").read_bytes())
    # Fresh processes, a different job seed: the RNG state must come from the checkpoint.
    run = launch({"runs": [{"params": params}], "lrs": lrs, "start": 3, "stop": 6}, resumed,
                 servers=2, env={"BPS_JOB_SEED": "999"})
    assert run.returncode == 0, run.stdout[-3000:]
    for r in range(2):
        for name in SHAPES:
            np.testing.assert_array_equal(load_params(resumed, 2)[r][name],
                                          load_params(whole, 2)[r][name])
    assert not np.array_equal(load_params(whole, 2)[0]["big"], initial_params(0, SHAPES)["big"])


def test_bad_input_fails_in_constructor_on_every_rank(tmp_path):
    bad = [({"compressor": "topk"}, "'k'"),
           ({"compressor": "onebit", "fp16": "yes"}, "'fp16'"),
           ({"compressor": "onebit", "colour": 1}, "'colour'"),
           ({"momentum": "nesterov", "mu": 1.5}, "'mu'")]
    start = time.monotonic()
    result = launch({"bad_params": [b for b, _ in bad]}, tmp_path)
    assert result.returncode != 0  # every rank exits 3 after the shutdown barrier
    for r in range(2):
        *errors, mismatch = json.loads((tmp_path / f"errors{r}.json").read_text())
        assert len(errors) == len(bad)
        for message, (_, key) in zip(errors, bad, strict=True):
            assert key in message, message
        # rank 1's model has 'big' of shape (31, 10): both ranks name it
        assert "ModelMismatchError" in mismatch and "'big'" in mismatch, mismatch
        assert "rank 1" in mismatch and "(30, 10)" in mismatch
    assert "(31, 10)" in (tmp_path / "errors1.json").read_text()
    assert time.monotonic() - start < 90


def test_init_without_launcher_names_the_variable():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "BYTEPS_"))}
    result = subprocess.run([sys.executable, "-c", "import bps; bps.init()"], env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "DMLC_ROLE" in result.stderr and "bpslaunch" in result.stderr


if __name__ == "__main__":
    sys.exit(worker_main(json.loads(sys.argv[1])))
