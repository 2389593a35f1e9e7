"""comm_dtype through a real cluster (2 nodes x 2 local ranks): the final parameters equal,
bit for bit, a reference that rounds to float16/bfloat16 exactly where the pipeline of
docs/trainer.md does: each rank's share, the intra-node sum of two shares, the
servers' sum of two nodes (one rounding each: a sum of two halves is taken in float32
and rounded once), then float32 Nesterov momentum and SGD."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.test_trainer import MOMENTUM, initial_params, launch, load_params, load_reports, targets

SHAPES = {"big": (60, 50), "small": (7,), "bias": (4,)}  # small and bias: fused
LRS = [0.5, 0.25, 0.25, 0.5]  # powers of two: lr * g is exact
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def reference(comm: str, nodes: int = 2, local: int = 2) -> dict:
    dtype, f32 = DTYPES[comm], np.float32
    ranks = nodes * local
    w = initial_params(0, SHAPES)
    goals = [targets(r, SHAPES) for r in range(ranks)]
    m = {n: np.zeros(s, f32) for n, s in SHAPES.items()}
    for lr in LRS:
        for n in SHAPES:
            shares = [torch.from_numpy((w[n] - goals[r][n]).astype(f32) / f32(ranks)).to(dtype)
                      for r in range(ranks)]
            node_sums = [shares[i * local] + shares[i * local + 1] for i in range(nodes)]
            g = (node_sums[0] + node_sums[1]).float().numpy()
            m[n] = (g + f32(MOMENTUM) * m[n]).astype(f32)
            g = (g + f32(MOMENTUM) * m[n]).astype(f32)
            w[n] = (w[n] - f32(lr) * g).astype(f32)
    return w


@pytest.mark.parametrize("comm", ["bf16", "fp16"])
def test_comm_dtype_rounds_exactly_where_the_pipeline_does(tmp_path, comm):
    params = {"momentum": "nesterov", "comm_dtype": comm}
    result = launch({"runs": [{"params": params}], "lrs": LRS, "stop": len(LRS),
                     "shapes": SHAPES},
                    tmp_path, workers=2, servers=2, local_size=2,
                    env={"BYTEPS_PARTITION_BYTES": "4000"})
    assert result.returncode == 0, result.stdout[-3000:]
    finals = load_params(tmp_path, 4)
    expected = reference(comm)
    for name in SHAPES:
        for rank, final in enumerate(finals):
            np.testing.assert_array_equal(final[name], expected[name], err_msg=f"{name} {rank}")
    # the rounding mattered: bf16 and fp16 round differently, and both differ from fp32
    other = reference("fp16" if comm == "bf16" else "bf16")
    assert not np.array_equal(expected["big"], other["big"])
    assert not np.array_equal(expected["big"], reference("fp32")["big"])
    raw = sum(int(np.prod(s)) * 4 for s in SHAPES.values())
    pushed = load_reports(tmp_path, 4)[0][""]["steps"][-1]["bytes_pushed"]
    assert 0.5 * raw < pushed < 0.6 * raw  # two bytes per element on the wire
