"""Codec threads after shutdown fail their request, not the caller."""

from __future__ import annotations

import pytest


def test_codec_work_after_shutdown_fails_its_request_not_the_caller() -> None:
    """A reply that arrives as the process exits (the codec pool, or the interpreter,
    shut down) fails its request; the I/O thread that received it goes on."""
    import concurrent.futures
    from types import SimpleNamespace

    from bps.common.protocol import ClusterError
    from bps.worker.codec_pool import CodecPool

    pool = CodecPool(count=lambda **deltas: None, threads=1)
    pool.shutdown()
    request = SimpleNamespace(info=None, future=concurrent.futures.Future())
    pool.decompress(request, [])
    with pytest.raises(ClusterError, match="engine closed: cannot schedule new futures"):
        request.future.result(timeout=5)
