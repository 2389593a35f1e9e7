"""GradPipeline's hand-over: flat views reused, bucket futures settled."""

from __future__ import annotations

import pytest


def test_a_hook_reuses_the_flat_view_of_the_gradient_it_is_handed() -> None:
    """The trainer hands ``.grad`` and its flat view: the view itself comes back (no
    torch op, each of which releases the GIL); anything else gets a view of its own."""
    import torch

    from bps.core.grad_pipeline import _flat

    grad = torch.arange(6.0).reshape(2, 3)
    flat = grad.view(-1)
    assert _flat(grad, flat) is flat
    for dest in (torch.arange(6.0), grad.view(-1)[1:], grad.t().reshape(-1),
                 grad.view(-1).view(torch.int32)):
        got = _flat(grad, dest)  # other memory, a shifted start, another order, dtype
        assert got is not dest and got.data_ptr() == grad.data_ptr()
        assert torch.equal(got, torch.arange(6.0))
    wanted = torch.zeros(3, requires_grad=True)
    assert not _flat(wanted, wanted.detach()).requires_grad


def test_forward_settles_the_bucket_future_unless_cancelled(caplog) -> None:
    from concurrent.futures import CancelledError, Future

    import torch

    from bps.core.grad_pipeline import _BucketSlice, _forward

    source, target = Future(), Future()
    _forward(source, target)
    source.set_result(torch.arange(6.0))
    assert _BucketSlice(target, 2, 3).result(timeout=0).tolist() == [2.0, 3.0, 4.0]

    source, target = Future(), Future()
    _forward(source, target)
    source.set_exception(ValueError("server 1: refused"))
    with pytest.raises(ValueError, match="refused"):
        _BucketSlice(target, 0, 1).result(timeout=0)

    # close() cancels a bucket whose step never completed; a late aggregate is dropped
    # quietly (set_result on a cancelled future would raise inside the callback)
    source, target = Future(), Future()
    _forward(source, target)
    target.cancel()
    with caplog.at_level("ERROR", logger="concurrent.futures"):
        source.set_result(torch.zeros(2))
    assert not caplog.records
    with pytest.raises(CancelledError):
        target.result(timeout=0)
