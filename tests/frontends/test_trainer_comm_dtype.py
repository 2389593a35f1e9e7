"""comm_dtype through a real cluster (2 nodes x 2 local ranks): the final parameters equal,
bit for bit, a reference that rounds to float16/bfloat16 exactly where the pipeline of
docs/trainer.md does (tests/harness/trainer_job.py's ``comm_reference``): each rank's
share, the intra-node sum of two shares, the servers' sum of two nodes (one rounding
each: a sum of two halves is taken in float32 and rounded once), then float32 Nesterov
momentum and SGD."""

from __future__ import annotations

import numpy as np

from tests.harness.trainer_job import COMM_LRS as LRS
from tests.harness.trainer_job import COMM_SHAPES as SHAPES
from tests.harness.trainer_job import comm_reference as reference
from tests.harness.trainer_job import launch, load_params, load_reports


def test_comm_dtype_rounds_exactly_where_the_pipeline_does(tmp_path):
    """bf16 and fp16 in one cluster, one trainer after the other."""
    runs = [{"tag": comm, "params": {"momentum": "nesterov", "comm_dtype": comm}}
            for comm in ("bf16", "fp16")]
    result = launch({"runs": runs, "lrs": LRS, "stop": len(LRS), "shapes": SHAPES},
                    tmp_path, workers=2, servers=2, local_size=2,
                    env={"BYTEPS_PARTITION_BYTES": "4000"})
    assert result.returncode == 0, result.stdout[-3000:]
    reports = load_reports(tmp_path, 4)
    raw = sum(int(np.prod(s)) * 4 for s in SHAPES.values())
    for comm in ("bf16", "fp16"):
        finals = load_params(tmp_path, 4, comm)
        expected = reference(comm)
        for name in SHAPES:
            for rank, final in enumerate(finals):
                np.testing.assert_array_equal(final[name], expected[name],
                                              err_msg=f"{comm} {name} {rank}")
        # the rounding mattered: bf16 and fp16 round differently, and both differ from fp32
        other = reference("fp16" if comm == "bf16" else "bf16")
        assert not np.array_equal(expected["big"], other["big"])
        assert not np.array_equal(expected["big"], reference("fp32")["big"])
        report = reports[0][comm]
        assert report["counter"] == 1  # rank 0's buffer everywhere
        assert report["optimizer_momentum"] == 0.0  # moved into bps
        assert report["steps"][-1]["raw_bytes"] == raw
        pushed = report["steps"][-1]["bytes_pushed"]
        assert 0.5 * raw < pushed < 0.6 * raw  # two bytes per element on the wire
