"""Error feedback ("vanilla"), a decorator around any compressor (BytePS design).

``g' = g + (lr_prev / lr_now) * e``; ``c = C(g')``; ``e = g' - D(c)``. The ratio is 1
until ``set_lr`` has been called twice with different values; call ``set_lr`` once
per step, before ``compress``.

Two error buffers take turns: ``g'`` is built in the one not holding ``e``, so the
error of the step before stays intact until the next ``compress`` and ``rollback``
returns to it (a step that a non-finite gradient elsewhere skips). A ``g'`` with inf
or NaN entries raises NonFiniteError with nothing changed.

Example::

    >>> import torch
    >>> from bps.compressors.topk import TopK
    >>> chain = ErrorFeedback(TopK(numel=4, k=1))
    >>> chain.set_lr(0.1)
    >>> payload = chain.compress(torch.tensor([1.0, 0.5, 0.0, 0.0]))
    >>> chain.error          # what was not sent is carried to the next step
    tensor([0.0000, 0.5000, 0.0000, 0.0000])
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch
from numba import njit

from .base import (
    KERNEL_FLOAT_DTYPES,
    Compressor,
    ErrorPassCompress,
    FastErrorUpdate,
    NonFiniteError,
    Payload,
    PayloadSum,
    ResidualCompress,
    check_state_keys,
    load_buffer,
)
from .device import (
    CHAIN_NONFINITE,
    StagedChain,
    TorchKernels,
    decorator_graph_key,
    first_bad,
    flag_status,
    is_staged,
    write_scalar,
)
from .threads import chunk_bounds, run_chunks


@njit(nogil=True, cache=True)
def add_scaled_error(x, ratio, error, out):
    """``out = x + ratio * error``, rounded as torch rounds (ratio 1 is exact); returns
    whether every value is finite (an integer flag in the same pass: it vectorises)."""
    bad = 0
    for i in range(x.size):
        value = x[i] + ratio * error[i]
        out[i] = value
        bad |= not abs(value) < np.inf
    return bad == 0


@njit(nogil=True, cache=True)
def add_scaled_error_divided(x, divisor, ratio, error, out):
    """``add_scaled_error`` of ``x / divisor``, divided in the same pass (each value
    rounded as dividing first, then adding, rounds it)."""
    bad = 0
    for i in range(x.size):
        value = x[i] / divisor + ratio * error[i]
        out[i] = value
        bad |= not abs(value) < np.inf
    return bad == 0


def add_scaled_error_torch(x: torch.Tensor, ratio: float | torch.Tensor, error: torch.Tensor,
                           out: torch.Tensor) -> torch.Tensor:
    """``out = x + ratio * error`` with torch ops, each rounded to the tensors' dtype (a
    multiply, then an add: never fused), as ``add_scaled_error`` rounds; ``out`` must not
    alias ``x``. The chains on a device and the float16/bfloat16 host chains use it.
    ``ratio`` may be a 0-dim tensor of ``error``'s dtype on its device (the same
    product, and a graph replay reads it anew).

        >>> add_scaled_error_torch(torch.ones(2), 0.5, torch.tensor([2.0, -4.0]),
        ...                        torch.empty(2))
        tensor([ 2., -1.])
    """
    torch.mul(error, ratio, out=out)
    return out.add_(x)


class ErrorFeedback(StagedChain, Compressor):
    """Adds the compression error of the previous step before compressing."""

    def __init__(self, inner: Compressor):
        super().__init__(inner.numel, inner.dtype)
        self.inner = inner
        self.device = inner.device
        self.staged = is_staged(inner)  # the inner chain has torch kernels: so has this one
        # a decorator in between is decoded after it encodes: a host sync
        self.kernels_only = isinstance(inner, TorchKernels)
        # how the residual g' - D(c) is made: in the compressor's pass, without decoding,
        # or by decoding (asked once: a protocol check walks the class's attributes)
        self.residual_in_pass = isinstance(inner, ResidualCompress)
        # g' built in the compressor's kernel call (onebit): one call for the whole step
        self.error_in_pass = (isinstance(inner, ErrorPassCompress) and not self.staged
                              and not self.kernels_only and inner.dtype in KERNEL_FLOAT_DTYPES)
        self.fast_update = isinstance(inner, FastErrorUpdate)
        # a server sums its pushes in error feedback's pass (compress_sum)
        self.sums_payloads = (isinstance(inner, PayloadSum) and not self.staged
                              and inner.dtype in KERNEL_FLOAT_DTYPES)
        self.bounds = chunk_bounds(inner.numel)  # a large input runs on several threads
        self.error = torch.zeros(inner.numel, dtype=inner.dtype, device=self.device)
        self.spare: torch.Tensor | None = None  # the other buffer (made on first use)
        self._arrays: tuple = ()  # (buffer, its numpy view) of the last two: _array
        self.lr_prev: float | None = None
        self.lr_now: float | None = None
        self.lr_before: tuple | None = None  # (lr_prev, lr_now) before this step's set_lr
        self.undo: tuple | None = None  # (learning rates, error) before the last compress
        # the ratio on the device, written before the kernels: a replayed graph reads it
        self.ratio_on_device: torch.Tensor | None = None
        self.divides_input = not self.staged and inner.dtype in KERNEL_FLOAT_DTYPES

    def set_lr(self, lr: float) -> None:
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not (
            math.isfinite(lr) and lr > 0
        ):
            raise ValueError(f"learning rate must be a finite number > 0, got {lr!r}")
        self.lr_before = (self.lr_prev, self.lr_now)
        self.lr_prev = float(lr) if self.lr_now is None else self.lr_now
        self.lr_now = float(lr)
        self.inner.set_lr(lr)

    @property
    def ratio(self) -> float:
        return 1.0 if self.lr_now is None else self.lr_prev / self.lr_now

    def compress(self, x: torch.Tensor) -> torch.Tensor:
        if self.staged:
            return self.run_staged(x)
        x = self.check_input(x)
        self.undo = None
        divisor = self.take_divisor()
        if self.dtype in KERNEL_FLOAT_DTYPES:
            array = x.numpy()
            if self.error_in_pass:
                return self._compress_in_pass(array, divisor)

            def build(error: np.ndarray, ratio: float, out: np.ndarray) -> bool:
                factor = array.dtype.type(ratio)
                if divisor != 1.0:
                    by = array.dtype.type(divisor)
                    return all(run_chunks(lambda lo, hi: add_scaled_error_divided(
                        array[lo:hi], by, factor, error[lo:hi], out[lo:hi]), self.bounds))
                return all(run_chunks(lambda lo, hi: add_scaled_error(
                    array[lo:hi], factor, error[lo:hi], out[lo:hi]), self.bounds))

            return self.compress_corrected(build)
        # float16/bfloat16: torch rounds each op
        corrected = add_scaled_error_torch(x, self.ratio, self.error, self._spare())
        if not bool(torch.isfinite(corrected).all()):
            self._refuse()
        return self._send(corrected)

    def _compress_in_pass(self, array: np.ndarray, divisor: float) -> torch.Tensor:
        """``compress`` of ``array / divisor`` by the inner compressor's
        ``compress_with_error``: the same payload, error and bits as building ``g'``
        here, then compressing it."""
        kind = array.dtype.type
        spare = self._spare()
        try:
            payload = self.inner.compress_with_error(array, kind(divisor), kind(self.ratio),
                                                     self._array(self.error),
                                                     self._array(spare))
        except NonFiniteError:
            self._restore_lr()
            raise
        if payload is None:
            self._refuse()
        self._keep(spare)
        return payload

    def _array(self, buffer: torch.Tensor) -> np.ndarray:
        """``buffer.numpy()``, kept for the error's two buffers, which take turns: a
        torch call costs more than finding the kept view."""
        for kept, array in self._arrays:
            if kept is buffer:
                return array
        array = buffer.numpy()
        self._arrays = (*self._arrays[-1:], (buffer, array))
        return array

    def _spare(self) -> torch.Tensor:
        if self.spare is None:
            self.spare = torch.empty_like(self.error)
        return self.spare

    def graph_key(self) -> tuple | None:
        return decorator_graph_key(self, "error feedback", lambda: [self.error, self._spare()])

    def prepare(self) -> None:
        self.undo = None
        self.inner.prepare()
        if self.dtype in KERNEL_FLOAT_DTYPES:
            self.ratio_on_device = write_scalar(self.ratio_on_device, self.ratio, self.error)

    def encode_kernels(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The staged half of ``compress`` (a chain with torch kernels): ``g'`` into the
        spare buffer, the inner chain's payload and the residual in it, no state
        changed and no host sync; ``commit`` or ``discard`` follows."""
        ratio = self.ratio if self.ratio_on_device is None else self.ratio_on_device
        corrected = add_scaled_error_torch(x, ratio, self.error, self._spare())
        refused = flag_status(~torch.isfinite(corrected).all(), CHAIN_NONFINITE)
        if isinstance(self.inner, TorchKernels):
            payload, status = self.inner.encode_residual(corrected)
        else:  # a decorator in between: encode, then decode its payload
            payload, status = self.inner.encode(corrected)
            corrected.sub_(self.inner.decompress(payload))
        return payload, first_bad(refused, status)

    def commit(self) -> None:
        self.inner.commit()
        lrs = self.lr_before if self.lr_before is not None else (self.lr_prev, self.lr_now)
        self.undo = (lrs, self.error)
        self.lr_before = None
        self.spare, self.error = self.error, self.spare

    def discard(self) -> None:
        self.inner.discard()
        self._restore_lr()

    def status_error(self, code: int, detail: int) -> Exception:
        if code == CHAIN_NONFINITE:
            return NonFiniteError(f"error feedback: the corrected gradient (numel={self.numel}) "
                                  "has inf or NaN entries")
        return self.inner.status_error(code, detail)

    def compress_corrected(self, build: Callable[[np.ndarray, float, np.ndarray], bool]
                           ) -> torch.Tensor:
        """Compress ``g'`` that ``build(error, ratio, out)`` writes into ``out`` as
        ``g + ratio * e`` (float32/float64 arrays; ``error`` holds ``e`` and must not
        change), returning whether every value of ``g'`` is finite. The decorator before
        this one (Nesterov momentum) builds ``g'`` in its own pass this way.

        Example::

            >>> import numpy as np, torch
            >>> from bps.compressors.topk import TopK
            >>> chain = ErrorFeedback(TopK(numel=2, k=1))
            >>> g = np.array([1.0, 0.5], dtype=np.float32)
            >>> build = lambda e, ratio, out: np.isfinite(np.add(g, ratio * e, out=out)).all()
            >>> payload = chain.compress_corrected(build)
            >>> chain.error
            tensor([0.0000, 0.5000])
        """
        if self.dtype not in KERNEL_FLOAT_DTYPES:
            raise TypeError(f"compress_corrected needs a float32/float64 chain, not {self.dtype}")
        self.undo = None
        if not build(self.error.numpy(), self.ratio, self._spare().numpy()):
            self._refuse()
        return self._send(self.spare)

    def check_payload(self, payload: Payload) -> None:
        """Raise ValueError for a payload that ``compress_sum`` would refuse (a chain
        whose ``sums_payloads`` is True)."""
        self.inner.check_payload(payload)

    def compress_sum(self, payloads: list[Payload]) -> torch.Tensor:
        """``compress`` of the sum of the decoded ``payloads`` (added in order, as a
        server adds its nodes' pushes), the sum built in the pass that adds the error
        (:class:`~bps.compressors.base.PayloadSum`). For chains whose ``sums_payloads`` is
        True; the same bits as decoding the first payload, ``decompress_add`` of the
        others and ``compress``.

            >>> import torch
            >>> from bps.compressors.onebit import OneBit
            >>> worker, server = OneBit(numel=2, scaling=True), ErrorFeedback(OneBit(
            ...     numel=2, scaling=True))
            >>> pushes = [worker.compress(torch.tensor([1.0, -1.0])),  # decodes to [1, -1]
            ...           worker.compress(torch.tensor([3.0, 1.0]))]   # decodes to [2, 2]
            >>> server.set_lr(0.1)
            >>> server.decompress(server.compress_sum(pushes))  # the sum [3, 1], scale 2
            tensor([2., 2.])
            >>> server.error                                    # what it did not send
            tensor([ 1., -1.])
        """
        self.undo = None
        residual = self._spare()
        payload = self.inner.compress_sum_residual(payloads, self.ratio,
                                                   self._array(self.error),
                                                   self._array(residual))
        if payload is None:
            self._refuse()
        self._keep(residual)
        return payload

    def _refuse(self) -> None:
        """Raise NonFiniteError for an inf or NaN in ``g'``, this step's set_lr undone."""
        self._restore_lr()
        raise NonFiniteError(f"error feedback: the corrected gradient (numel={self.numel}) "
                             "has inf or NaN entries")

    def cancel(self) -> None:
        """Undo this step's ``set_lr`` (no ``compress`` follows it)."""
        self.divisor = 1.0
        self._restore_lr()
        self.inner.cancel()

    def _restore_lr(self) -> None:
        if self.lr_before is not None:
            self.lr_prev, self.lr_now = self.lr_before
            self.lr_before = None

    def _send(self, corrected: torch.Tensor) -> torch.Tensor:
        """Compress ``corrected`` (not the error buffer) and keep what it did not send as
        the next error; the error before stays in the other buffer for ``rollback``."""
        try:
            if self.residual_in_pass:
                payload = self.inner.compress_residual(corrected)
            else:
                payload = self.inner.compress(corrected)
                if self.fast_update:
                    self.inner.fast_update_error(corrected, payload)
                else:
                    corrected.sub_(self.inner.decompress(payload))
        except NonFiniteError:
            self._restore_lr()
            raise
        self._keep(corrected)
        return payload

    def _keep(self, corrected: torch.Tensor) -> None:
        """``corrected``, its payload's residual now, becomes the error; the error before
        stays in the other buffer for ``rollback``."""
        lrs = self.lr_before if self.lr_before is not None else (self.lr_prev, self.lr_now)
        self.undo = (lrs, self.error)
        self.lr_before = None
        if corrected is self.spare:
            self.spare = self.error
        self.error = corrected

    def rollback(self) -> None:
        """Back to the error and learning rates before the last ``compress`` (and the
        inner compressor's state before it)."""
        if self.undo is None:
            return
        (self.lr_prev, self.lr_now), error = self.undo
        if self.spare is not None:
            self.spare = self.error
        self.error, self.undo = error, None
        self.inner.rollback()

    def decompress(self, payload: Payload, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.inner.decompress(payload, out)

    def decompress_add(self, payload: Payload, total: torch.Tensor,
                       scratch: torch.Tensor | None = None) -> torch.Tensor:
        return self.inner.decompress_add(payload, total, scratch)

    def state_dict(self) -> dict:
        return {
            "error": self.error.clone(),
            "lr_prev": self.lr_prev,
            "lr_now": self.lr_now,
            "inner": self.inner.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        check_state_keys(self, state, ("error", "lr_prev", "lr_now", "inner"))
        for key in ("lr_prev", "lr_now"):
            value = state[key]
            if value is not None and not isinstance(value, float):
                raise ValueError(f"ErrorFeedback state {key!r} must be a float or None, "
                                 f"got {value!r}")
        self.inner.load_state_dict(state["inner"])
        load_buffer(self, "error", self.error, state["error"])
        self.lr_prev, self.lr_now = state["lr_prev"], state["lr_now"]
        self.lr_before = self.undo = None
