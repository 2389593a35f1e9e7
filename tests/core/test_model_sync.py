"""Every model can start: rank 0's parameters and buffers reach every rank bit for bit,
inf and NaN included (a ``-inf`` causal mask), on a real cluster (``bpslaunch local``).

This module is also the worker program (tests/harness/trainer_job.py's ``worker_main``
with this module's ``train``). Each rank builds the model from its own seed, so
whatever the trainer's start-up broadcast leaves on ranks 1.. must equal rank 0's
bytes; the test rebuilds rank 0's model itself and compares bytes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.harness.trainer_job import launch as trainer_launch
from tests.harness.trainer_job import load_reports, worker_main

SHAPES = {"w": (16, 8)}


def make_model(rank: int):
    """A model whose state the float32 gradient path could not carry: a ``-inf`` mask,
    NaN, a signed zero, an int64 above 2**53, bfloat16 and bool buffers."""
    import torch

    gen = torch.Generator().manual_seed(rank)
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.randn(SHAPES["w"], generator=gen))
    mask = torch.full((6, 6), float("-inf")).triu(1)
    mask[0, 0] = float("nan") if rank == 0 else 1.0
    mask[1, 0] = -0.0 if rank == 0 else 0.0
    model.register_buffer("mask", mask)
    model.register_buffer("big", torch.tensor([2**62 + 1 + rank, -3], dtype=torch.int64))
    model.register_buffer("low", torch.randn(5, generator=gen).to(torch.bfloat16))
    model.register_buffer("flags", torch.rand(3, generator=gen) > 0.5)
    model.register_buffer("running", torch.full((4,), float(rank)))
    return model


def state_bytes(model) -> dict:
    """name -> the hex of its bytes."""
    import torch

    out = {}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        out[name] = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes().hex()
    return out


# ----------------------------------------------------------------------------- worker side


def train(cfg: dict, run: dict, rank: int, shapes: dict, out: Path) -> dict:
    import torch

    import bps

    model = make_model(rank)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    trainer = bps.DistributedTrainer(model, optimizer, run.get("params"),
                                     sync_every=run.get("sync_every", 1))
    report = {"start": state_bytes(model)}
    for _ in range(run.get("steps", 0)):
        trainer.zero_grad()
        (model.w ** 2).sum().backward()
        trainer.step()
    report["end"] = state_bytes(model)
    trainer.close()
    return report


# ----------------------------------------------------------------------------- test side


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("model_sync")
    cfg = {"runs": [{"tag": "start"},
                    {"tag": "periodic", "sync_every": 2, "steps": 4}]}
    proc = trainer_launch(cfg, tmp, workers=2, module=__name__, timeout=180)
    assert proc.returncode == 0, proc.stdout[-4000:]
    return load_reports(tmp, 2)


def test_start_carries_every_bit_of_rank0s_model(reports):
    expected = state_bytes(make_model(0))
    for rank, report in enumerate(reports):
        assert report["start"]["start"] == expected, f"rank {rank}"
        assert report["periodic"]["start"] == expected, f"rank {rank}"


def test_periodic_averaging_keeps_nonfinite_buffer_entries(reports):

    ends = [r["periodic"]["end"] for r in reports]
    assert ends[0] == ends[1]
    mask = np.frombuffer(bytes.fromhex(ends[0]["mask"]), np.float32).reshape(6, 6)
    reference = make_model(0).mask.numpy()
    assert mask.tobytes() == reference.tobytes()  # -inf, NaN and -0.0 as they were
    assert np.isinf(mask).sum() == 15
    running = np.frombuffer(bytes.fromhex(ends[0]["running"]), np.float32)
    assert running.tolist() == [0.0] * 4  # rank 0's zeros everywhere, averaged


def test_bits_roundtrip_every_byte_value():
    import torch

    from bps.core.model_sync import bytes_to_float, float_to_bytes

    raw = torch.arange(256, dtype=torch.uint8).repeat(3)[:-1]  # odd length: a pad byte
    values = bytes_to_float(raw)
    assert bool(torch.isfinite(values).all()) and values.max().item() <= 65535
    reference = np.frombuffer(raw.numpy().tobytes() + b"\0", "<u2").astype(np.float32)
    assert values.numpy().tobytes() == reference.tobytes()
    assert torch.equal(float_to_bytes(values + 0.0)[:raw.numel()], raw)


if __name__ == "__main__":
    from bps.server.role import end_process

    end_process(worker_main(json.loads(sys.argv[1]), train))
