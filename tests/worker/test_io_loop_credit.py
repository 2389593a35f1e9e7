"""A push's send credit is freed by the server's first reply to it, whatever its op.

With one worker node every push completes its step, so the server answers it with the
step's DATA at once and sends no ACK. One worker on the bare engine, one server,
``BPS_MAX_INFLIGHT=1``: the keys of a step are all handed to the engine at once, so each
push after the first waits in the send queue for the credit of the one before; were it
freed by an ACK only, the second push would never leave and the step would not finish.
Each answer is the node's own values (the sum of one node)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from tests.harness.trainer_job import launch

KEYS, STEPS, NUMEL = 6, 3, 8


def values(key: int, step: int) -> np.ndarray:
    """What the node pushes: small integers, exact in float32."""
    return np.arange(NUMEL, dtype=np.float32) + 10 * key + 100 * step


def node_main(cfg: dict) -> int:
    import torch

    from bps.common.env import ClusterEnv
    from bps.worker.engine import WorkerEngine

    engine = WorkerEngine.connect(ClusterEnv.from_environ())
    for key in range(KEYS):
        engine.declare(key, NUMEL, torch.float32, None, name=f"k{key}", server=0)
    answers = {}
    for step in range(STEPS):
        futures = {key: engine.push_pull(key, torch.from_numpy(values(key, step)), step, 0.1)
                   for key in range(KEYS)}
        for key, future in futures.items():  # a push stuck in the queue fails here
            answers[f"{step}/{key}"] = future.result(timeout=20).tolist()
    (Path(cfg["out"]) / "answers.json").write_text(json.dumps(answers))
    engine.close()
    return 0


def test_a_push_answered_at_once_frees_its_credit(tmp_path: Path) -> None:
    result = launch({}, tmp_path, workers=1, servers=1, timeout=120, module=__name__,
                    env={"BPS_MAX_INFLIGHT": "1"})
    assert result.returncode == 0, result.stdout[-6000:]
    answers = json.loads((tmp_path / "answers.json").read_text())
    assert answers == {f"{step}/{key}": values(key, step).tolist()
                       for step in range(STEPS) for key in range(KEYS)}


if __name__ == "__main__":
    from bps.server.role import end_process

    end_process(node_main(json.loads(sys.argv[1])))
