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
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
BPSLAUNCH = str(Path(sys.executable).parent / "bpslaunch")
SHAPES = {"big": (30, 10), "small": (7,)}  # big: compressed, 3 partitions; small: raw
MOMENTUM = 0.9


def initial_params(rank: int, shapes: dict) -> dict:
    rng = np.random.default_rng(rank)
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


def targets(rank: int, shapes: dict) -> dict:
    rng = np.random.default_rng(1000 + rank)
    return {name: (3 * rng.standard_normal(shape)).astype(np.float32)
            for name, shape in shapes.items()}


# ----------------------------------------------------------------------------- worker side


def worker_main(cfg: dict) -> int:
    import torch

    import bps

    torch.set_num_threads(1)
    bps.init()
    rank = bps.rank()
    out = Path(cfg["out"])
    shapes = {name: tuple(shape) for name, shape in cfg["shapes"].items()}
    if cfg.get("mismatch") and rank == 1:
        shapes["big"] = (shapes["big"][0] + 1, *shapes["big"][1:])
    model = torch.nn.Module()
    for name, value in initial_params(rank, shapes).items():
        model.register_parameter(name, torch.nn.Parameter(torch.from_numpy(value)))
    model.register_buffer("counter", torch.tensor([rank * 7 + 1], dtype=torch.int64))
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg["lrs"][0], momentum=MOMENTUM)
    if cfg.get("expect_error"):
        errors = []
        for params in cfg["params"]:
            try:
                bps.DistributedTrainer(model, optimizer, params)
            except (ValueError, TypeError) as exc:
                errors.append(f"{type(exc).__name__}: {exc}")
        (out / f"errors{rank}.json").write_text(json.dumps(errors))
        bps.shutdown()  # reached by every rank only if every rank failed in the constructor
        return 3
    trainer = bps.DistributedTrainer(model, optimizer, cfg["params"])
    report = {"counter": int(model.counter.item()),
              "optimizer_momentum": optimizer.param_groups[0]["momentum"], "steps": []}
    start = cfg.get("start", 0)
    if start:
        checkpoint = torch.load(out / f"ckpt{rank}.pt", weights_only=False)
        model.load_state_dict(checkpoint["model"])
        trainer.load_state_dict(checkpoint["trainer"])
    goal = {name: torch.from_numpy(t) for name, t in targets(rank, shapes).items()}
    engine = bps.runtime.get().engine
    for step in range(start, cfg["stop"]):
        for group in optimizer.param_groups:
            group["lr"] = cfg["lrs"][step]
        trainer.zero_grad()
        loss = sum(0.5 * ((getattr(model, n) - goal[n]) ** 2).sum() for n in shapes)
        pushes_before = engine.stats.pushes if engine is not None else 0
        loss.backward()
        if engine is not None and cfg.get("check_overlap"):
            # The hooks alone (no step() yet) must get every push answered.
            deadline = time.monotonic() + 20
            while engine.stats.pushes - pushes_before < cfg["pushes_per_step"]:
                if time.monotonic() > deadline:
                    raise AssertionError("gradients were not pushed before step()")
                time.sleep(0.005)
        trainer.step()
        report["steps"].append(trainer.stats())
    if cfg.get("save"):
        torch.save({"model": model.state_dict(), "trainer": trainer.state_dict()},
                   out / f"ckpt{rank}.pt")
    np.savez(out / f"params{rank}.npz",
             **{n: getattr(model, n).detach().numpy() for n in shapes})
    (out / f"report{rank}.json").write_text(json.dumps(report))
    trainer.close()
    bps.shutdown()
    return 0


# ----------------------------------------------------------------------------- test side


def launch(cfg: dict, tmp: Path, workers: int = 2, servers: int = 1, local_size: int = 1,
           env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    cfg = {"shapes": SHAPES, **cfg, "out": str(tmp)}
    cmd = [BPSLAUNCH, "local", "--workers", str(workers), "--servers", str(servers),
           "--local-size", str(local_size), "--", sys.executable, __file__, json.dumps(cfg)]
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


def load_params(tmp: Path, ranks: int) -> list[dict]:
    return [dict(np.load(tmp / f"params{r}.npz")) for r in range(ranks)]


def load_reports(tmp: Path, ranks: int) -> list[dict]:
    return [json.loads((tmp / f"report{r}.json").read_text()) for r in range(ranks)]


def nesterov(mu: np.float32, g: np.ndarray, m: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """SPEC §4 momentum: m = g + mu*m; g' = g + mu*m (float32, two roundings each)."""
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
}


def reference_codec(params: dict, numel: int):
    """(encode, decode) of the compressor from tests/reference_compressors.py; decode
    gives float32 values, as the receiving side holds them."""
    import tests.reference_compressors as ref

    name, f32 = params["compressor"], "float32"
    if name == "onebit":
        return (lambda x: ref.onebit_encode(x, True),
                lambda p: ref.onebit_decode(p, numel, f32))
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


def simulate(params: dict, nodes: int, lrs: list[float]) -> dict:
    """The pipeline of SPEC §1 in numpy: per node, g = (w - t_node) / nodes ->
    Momentum -> ErrorFeedback -> C; server: sum of the decoded payloads -> ErrorFeedback
    -> C; workers decode and take an SGD step. The small tensor travels raw and gets the
    same Nesterov rule after the sum."""
    from tests.reference_compressors import RefChain

    f32 = np.float32
    w = initial_params(0, SHAPES)  # rank 0's parameters, broadcast at construction
    goals = [targets(r, SHAPES) for r in range(nodes)]
    numel = int(np.prod(SHAPES["big"]))
    parts = [(o, min(PARTITION, numel - o)) for o in range(0, numel, PARTITION)]
    workers = [[RefChain(*reference_codec(params, n), n, "float32", True, MOMENTUM)
                for _, n in parts] for _ in range(nodes)]
    servers = [RefChain(*reference_codec(params, n), n, "float32", True, None)
               for _, n in parts]
    small_momentum = np.zeros(SHAPES["small"], f32)
    for lr in lrs:
        shares = [{n: ((w[n] - goals[r][n]) / f32(nodes)).astype(f32) for n in SHAPES}
                  for r in range(nodes)]
        big = np.zeros(numel, f32)
        for i, (offset, n) in enumerate(parts):
            summed = np.zeros(n, f32)
            for r in range(nodes):
                workers[r][i].set_lr(lr)
                payload = workers[r][i].compress(shares[r]["big"].reshape(-1)[offset:offset + n])
                summed = (summed + workers[r][i].decode(payload).astype(f32)).astype(f32)
            servers[i].set_lr(lr)
            big[offset:offset + n] = servers[i].decode(servers[i].compress(summed))
        small = np.zeros(SHAPES["small"], f32)
        for r in range(nodes):
            small = (small + shares[r]["small"]).astype(f32)
        small, small_momentum = nesterov(f32(MOMENTUM), small, small_momentum)
        w["big"] = (w["big"] - f32(lr) * big.reshape(SHAPES["big"])).astype(f32)
        w["small"] = (w["small"] - f32(lr) * small).astype(f32)
    return w


@pytest.mark.parametrize("name", list(SIM_CASES))
def test_every_compressor_matches_independent_simulation(tmp_path, name):
    params = {**SIM_CASES[name], "ef": "vanilla", "momentum": "nesterov", "fp16": False,
              "min_compress_bytes": 1000}
    result = launch({"params": params, "lrs": SIM_LRS, "stop": len(SIM_LRS),
                     "check_overlap": True, "pushes_per_step": 4}, tmp_path, servers=2)
    assert result.returncode == 0, result.stdout[-3000:]
    finals = load_params(tmp_path, 2)
    for n in SHAPES:
        np.testing.assert_array_equal(finals[1][n], finals[0][n])
    expected = simulate(params, 2, SIM_LRS)
    for n in SHAPES:
        np.testing.assert_array_equal(finals[0][n], expected[n], err_msg=f"{name}: {n}")
    report = load_reports(tmp_path, 2)[0]
    assert report["optimizer_momentum"] == 0.0 and report["counter"] == 1
    last = report["steps"][-1]
    assert last["compression_ratio"] > 1.5, last


def test_fp16_two_local_ranks_per_node(tmp_path):
    shapes = {"big": (60, 50), "small": (7,)}
    lrs = [0.1, 0.1, 0.05, 0.05]
    params = {"momentum": "nesterov", "fp16": True}
    result = launch({"params": params, "lrs": lrs, "stop": len(lrs), "shapes": shapes},
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
    report = load_reports(tmp_path, 4)[0]
    assert report["counter"] == 1  # rank 0's buffer everywhere
    assert report["optimizer_momentum"] == 0.0  # moved into bps
    raw = sum(int(np.prod(s)) * 4 for s in shapes.values())
    assert report["steps"][-1]["raw_bytes"] == raw
    assert 0 < report["steps"][-1]["bytes_pushed"] < 0.6 * raw  # fp16 on the wire


def test_resume_from_state_dict_continues_exactly(tmp_path):
    params = {"compressor": "dithering", "k": 4, "ef": "vanilla", "momentum": "nesterov",
              "fp16": False, "min_compress_bytes": 1000}
    lrs = [0.2, 0.2, 0.1, 0.1, 0.05, 0.05]
    whole, first, second = (tmp_path / d for d in ("whole", "first", "second"))
    for d in (whole, first, second):
        d.mkdir()
    run = launch({"params": params, "lrs": lrs, "stop": 6}, whole, servers=2)
    assert run.returncode == 0, run.stdout[-3000:]
    run = launch({"params": params, "lrs": lrs, "stop": 3, "save": True}, first, servers=2)
    assert run.returncode == 0, run.stdout[-3000:]
    for r in range(2):
        (second / f"ckpt{r}.pt").write_bytes((first / f"ckpt{r}.pt").read_bytes())
    # Fresh processes, a different job seed: the RNG state must come from the checkpoint.
    run = launch({"params": params, "lrs": lrs, "start": 3, "stop": 6}, second, servers=2,
                 env={"BPS_JOB_SEED": "999"})
    assert run.returncode == 0, run.stdout[-3000:]
    for r in range(2):
        for name in SHAPES:
            np.testing.assert_array_equal(load_params(second, 2)[r][name],
                                          load_params(whole, 2)[r][name])
    halfway = load_params(first, 2)[0]["big"]
    assert not np.array_equal(halfway, load_params(whole, 2)[0]["big"])


def test_bad_params_fail_in_constructor_on_every_rank(tmp_path):
    bad = [({"compressor": "topk"}, "'k'"),
           ({"compressor": "onebit", "fp16": "yes"}, "'fp16'"),
           ({"compressor": "onebit", "colour": 1}, "'colour'"),
           ({"momentum": "nesterov", "mu": 1.5}, "'mu'")]
    start = time.monotonic()
    result = launch({"params": [b for b, _ in bad], "lrs": [0.1], "stop": 1,
                     "expect_error": True}, tmp_path)
    assert result.returncode != 0  # every rank exits 3 after the shutdown barrier
    for r in range(2):
        errors = json.loads((tmp_path / f"errors{r}.json").read_text())
        assert len(errors) == len(bad)
        for message, (_, key) in zip(errors, bad, strict=True):
            assert key in message, message
    assert time.monotonic() - start < 60


def test_model_mismatch_names_the_parameter(tmp_path):
    result = launch({"params": [None], "lrs": [0.1], "stop": 1, "expect_error": True,
                     "mismatch": True}, tmp_path)
    assert result.returncode != 0
    for r in range(2):
        (message,) = json.loads((tmp_path / f"errors{r}.json").read_text())
        assert "ModelMismatchError" in message and "'big'" in message, message
        assert "rank 1" in message
    assert "(31, 10)" in (tmp_path / "errors1.json").read_text()  # what rank 1 has


def test_init_without_launcher_names_the_variable():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "BYTEPS_"))}
    result = subprocess.run([sys.executable, "-c", "import bps; bps.init()"], env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "DMLC_ROLE" in result.stderr and "bpslaunch" in result.stderr


if __name__ == "__main__":
    sys.exit(worker_main(json.loads(sys.argv[1])))
