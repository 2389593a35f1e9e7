"""A trainer's per-step figures: bytes on the wire, compression ratio, time spent.

The trainer snapshots the engine's counters when a step's first gradient is ready and
records the step when ``step()`` returns::

    stats = StepStats()
    before = stats.snapshot(engine)        # at the first gradient of the step
    stats.record(engine, before, step=0, raw_bytes=4 * numel, wait=0.01)
    stats.report()["compression_ratio"]
"""

from __future__ import annotations

from typing import Any


class StepStats:
    """The last step's figures and running byte totals (local rank 0 has the engine)."""

    def __init__(self) -> None:
        self._last: dict = {}
        self._totals = {"steps": 0, "bytes_pushed": 0, "bytes_pulled": 0, "raw_bytes": 0,
                        "skipped_steps": 0}

    @staticmethod
    def snapshot(engine: Any) -> dict:
        """The engine's cumulative counters (empty without an engine)."""
        if engine is None:
            return {}
        counters = engine.stats
        return {"bytes_pushed": counters.bytes_pushed, "bytes_pulled": counters.bytes_pulled,
                "compress_time": counters.compress_s + counters.decompress_s,
                "comm_time": counters.comm_s, "pcie_bytes": counters.pcie_bytes,
                "server_time": counters.server_s}

    def record(self, engine: Any, before: dict, step: int, raw_bytes: int,
               wait: float, passes: int = 1, skipped: bool = False,
               samples: int = 0) -> None:
        """Close a step: the counters' growth since ``before``; ``raw_bytes``: what one
        direction would carry uncompressed in float32; ``wait``: seconds step() blocked;
        ``passes``: backward passes per step; ``skipped``: a non-finite gradient (or worker
        nodes leaving the job) made every worker skip the step; ``samples``: the node's
        samples in the step (0: unknown, and ``bytes_per_sample`` is None)."""
        after = self.snapshot(engine)

        def delta(key: str) -> float:
            return after.get(key, 0) - before.get(key, 0)

        pushed, pulled = int(delta("bytes_pushed")), int(delta("bytes_pulled"))
        self._last = {
            "step": step,
            "bytes_pushed": pushed,
            "bytes_pulled": pulled,
            "raw_bytes": raw_bytes,
            # None (n/a) off local rank 0: the node's traffic is counted there alone
            "compression_ratio": None if engine is None else
            (2 * raw_bytes / (pushed + pulled)) if pushed + pulled else 0.0,
            "compress_time": float(delta("compress_time")),
            "comm_time": float(delta("comm_time")),
            "pcie_bytes": int(delta("pcie_bytes")),
            "server_time": float(delta("server_time")),
            "wait_time": wait,
            "backward_passes": passes,
            "skipped": skipped,
            "samples": samples,
            "bytes_per_sample": (pushed + pulled) / samples if samples else None,
        }
        self._totals["steps"] += 1
        self._totals["skipped_steps"] += int(skipped)
        self._totals["bytes_pushed"] += pushed
        self._totals["bytes_pulled"] += pulled
        self._totals["raw_bytes"] += raw_bytes

    def report(self) -> dict:
        """The last step's figures plus ``totals`` (see ``DistributedTrainer.stats``)."""
        return dict(self._last, totals=dict(self._totals))
