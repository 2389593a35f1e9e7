"""Nesterov momentum inside the compression chain (workers only), BytePS design.

``m = g + mu * m``; ``g' = g + mu * m``; then the rest of the chain compresses ``g'``.
Two momentum buffers take turns, as error feedback's do, so ``rollback`` returns to the
momentum before the last ``compress``; an inf or NaN in ``g'`` raises NonFiniteError
with nothing changed.

Example::

    >>> import torch
    >>> from bps.compressors.onebit import OneBit
    >>> chain = Momentum(OneBit(numel=2), mu=0.9)
    >>> _ = chain.compress(torch.tensor([1.0, -1.0]))
    >>> chain.momentum
    tensor([ 1., -1.])
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit

from .base import (
    KERNEL_FLOAT_DTYPES,
    Compressor,
    CorrectedCompress,
    NonFiniteError,
    Payload,
    check_state_keys,
    load_buffer,
)
from .device import (
    CHAIN_NONFINITE,
    StagedChain,
    decorator_graph_key,
    first_bad,
    flag_status,
    is_staged,
    write_scalar,
)


@njit(nogil=True, cache=True)
def nesterov_step(grad, momentum, decay, mu, lookahead, momentum_out):
    """``momentum_out = decay * momentum + grad``; ``lookahead = grad + mu * momentum_out``,
    one pass, each operation rounded to the arrays' dtype as torch's element-wise ops
    round; returns whether every lookahead value is finite. ``decay`` is ``mu``, times
    the change of scale of the gradients where they changed scale (see
    ``Momentum.scale_momentum``)."""
    bad = 0
    for i in range(grad.size):
        m = momentum[i] * decay + grad[i]
        momentum_out[i] = m
        value = grad[i] + mu * m
        lookahead[i] = value
        bad |= not abs(value) < np.inf
    return bad == 0


@njit(nogil=True, cache=True)
def nesterov_step_corrected(grad, momentum, decay, mu, ratio, error, momentum_out, out):
    """nesterov_step with error feedback's ``g' = lookahead + ratio * error`` written into
    ``out`` in the same pass (one pass less, no lookahead array); rounded as the two
    separate kernels round; returns whether every value of ``g'`` is finite."""
    bad = 0
    for i in range(grad.size):
        m = momentum[i] * decay + grad[i]
        momentum_out[i] = m
        value = (grad[i] + mu * m) + ratio * error[i]
        out[i] = value
        bad |= not abs(value) < np.inf
    return bad == 0


@njit(nogil=True, cache=True)
def nesterov_step_corrected_divided(grad, divisor, momentum, decay, mu, ratio, error,
                                    momentum_out, out):
    """nesterov_step_corrected of ``grad / divisor``, divided in the same pass (each value
    rounded as dividing first, then the step, rounds it)."""
    bad = 0
    for i in range(grad.size):
        g = grad[i] / divisor
        m = momentum[i] * decay + g
        momentum_out[i] = m
        value = (g + mu * m) + ratio * error[i]
        out[i] = value
        bad |= not abs(value) < np.inf
    return bad == 0


def nesterov_step_torch(grad: torch.Tensor, momentum: torch.Tensor,
                        decay: float | torch.Tensor, mu: float, lookahead: torch.Tensor,
                        momentum_out: torch.Tensor) -> torch.Tensor:
    """``momentum_out = decay * momentum + grad``; ``lookahead = grad + mu * momentum_out``
    with torch ops, each rounded to the tensors' dtype (never fused), as
    ``nesterov_step`` rounds; returns ``lookahead``. The chains on a device and the
    float16/bfloat16 host chains use it. ``decay`` may be a 0-dim tensor of the
    momentum's dtype on its device (the same product).

        >>> m, look = torch.empty(1), torch.empty(1)
        >>> nesterov_step_torch(torch.ones(1), torch.ones(1), 0.5, 0.5, look, m), m
        (tensor([1.7500]), tensor([1.5000]))
    """
    torch.mul(momentum, decay, out=momentum_out).add_(grad)
    torch.mul(momentum_out, mu, out=lookahead)
    return lookahead.add_(grad)


class Momentum(StagedChain, Compressor):
    """Applies Nesterov momentum to the gradient, then the inner chain."""

    def __init__(self, inner: Compressor, mu: float):
        super().__init__(inner.numel, inner.dtype)
        if not 0.0 <= mu < 1.0:
            raise ValueError(f"momentum mu must be in [0, 1), got {mu!r}")
        self.inner = inner
        self.mu = float(mu)
        self.device = inner.device
        self.staged = is_staged(inner)  # the inner chain has torch kernels: so has this one
        self.fused = isinstance(inner, CorrectedCompress)  # builds g' in our pass
        self.momentum = torch.zeros(inner.numel, dtype=inner.dtype, device=self.device)
        self.spare: torch.Tensor | None = None  # the other momentum buffer (first use)
        self.lookahead: torch.Tensor | None = None  # g' when the inner chain takes a tensor
        self.undo: torch.Tensor | None = None  # the momentum before the last compress
        self.factor = 1.0  # scale_momentum's, for the next compress only
        # this step's decay, on the device (written before the kernels: a replayed graph
        # reads it anew) or, for float16/bfloat16, a Python number
        self.decay: torch.Tensor | float | None = None
        self.divides_input = self.fused and not self.staged \
            and inner.dtype in KERNEL_FLOAT_DTYPES

    def set_lr(self, lr: float) -> None:
        self.inner.set_lr(lr)

    def scale_momentum(self, factor: float) -> None:
        """The next ``compress`` builds ``m = factor * mu * m + g``: the momentum follows
        gradients that came ``factor`` times larger. ``rollback`` (or a refused input)
        returns to the momentum as it was, unscaled."""
        self.factor = float(factor)

    def compress(self, x: torch.Tensor) -> torch.Tensor:
        if self.staged:
            return self.run_staged(x)
        x = self.check_input(x)
        self.undo = None
        decay, self.factor = self.mu * self.factor, 1.0
        divisor = self.take_divisor()
        self._buffers()
        if self.dtype not in KERNEL_FLOAT_DTYPES:  # float16/bfloat16: torch rounds each op
            lookahead = nesterov_step_torch(x, self.momentum, decay, self.mu, self._lookahead(),
                                            self.spare)
            if not bool(torch.isfinite(lookahead).all()):
                raise self._nonfinite()
            return self._commit(self.spare, self.inner.compress(lookahead))
        grad, momentum, out = x.numpy(), self.momentum.numpy(), self.spare.numpy()
        mu = grad.dtype.type(self.mu)
        if self.fused:  # error feedback: one pass for both
            decay, by = grad.dtype.type(decay), grad.dtype.type(divisor)

            def build(error: np.ndarray, ratio: float, corrected: np.ndarray) -> bool:
                ratio = grad.dtype.type(ratio)
                if divisor != 1.0:  # the average over nodes in the same pass
                    return nesterov_step_corrected_divided(grad, by, momentum, decay, mu,
                                                           ratio, error, out, corrected)
                return nesterov_step_corrected(grad, momentum, decay, mu, ratio, error, out,
                                               corrected)

            return self._commit(self.spare, self.inner.compress_corrected(build))
        if not nesterov_step(grad, momentum, grad.dtype.type(decay), mu,
                             self._lookahead().numpy(), out):
            raise self._nonfinite()
        return self._commit(self.spare, self.inner.compress(self.lookahead))

    def _buffers(self) -> None:
        """The spare momentum buffer (made on first use)."""
        if self.spare is None:
            self.spare = torch.empty_like(self.momentum)

    def _lookahead(self) -> torch.Tensor:
        """The lookahead buffer, where the inner chain takes g' as a tensor (first use)."""
        if self.lookahead is None:
            self.lookahead = torch.empty_like(self.momentum)
        return self.lookahead

    def graph_key(self) -> tuple | None:
        def buffers() -> list[torch.Tensor]:
            self._buffers()
            return [self.momentum, self.spare, self._lookahead()]
        return decorator_graph_key(self, "momentum", buffers)

    def prepare(self) -> None:
        self.undo = None
        decay, self.factor = self.mu * self.factor, 1.0
        self._buffers()
        self.decay = write_scalar(self.decay, decay, self.momentum) \
            if self.dtype in KERNEL_FLOAT_DTYPES else decay
        self.inner.prepare()

    def encode_kernels(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The staged half of ``compress`` (a chain with torch kernels): the new momentum
        into the spare buffer, the lookahead through the inner chain's; no state changed
        and no host sync; ``commit`` or ``discard`` follows."""
        lookahead = nesterov_step_torch(x, self.momentum, self.decay, self.mu,
                                        self._lookahead(), self.spare)
        refused = flag_status(~torch.isfinite(lookahead).all(), CHAIN_NONFINITE)
        payload, status = self.inner.encode_kernels(lookahead)
        return payload, first_bad(refused, status)

    def commit(self) -> None:
        self.inner.commit()
        self._commit(self.spare, None)

    def discard(self) -> None:
        self.inner.discard()

    def status_error(self, code: int, detail: int) -> Exception:
        if code == CHAIN_NONFINITE:
            return NonFiniteError(f"momentum: the gradient (numel={self.numel}) has inf or "
                                  "NaN entries")
        return self.inner.status_error(code, detail)

    def cancel(self) -> None:
        self.divisor = 1.0
        self.inner.cancel()

    def _nonfinite(self) -> NonFiniteError:
        self.inner.cancel()
        return NonFiniteError(f"momentum: the gradient (numel={self.numel}) has inf or NaN "
                              "entries")

    def _commit(self, momentum: torch.Tensor, payload: torch.Tensor) -> torch.Tensor:
        """The new momentum becomes current; the one before is kept for ``rollback``."""
        self.undo = self.momentum
        if momentum is self.spare:
            self.spare = self.momentum
        self.momentum = momentum
        return payload

    def rollback(self) -> None:
        """Back to the momentum before the last ``compress`` (and the inner chain's
        state before it)."""
        if self.undo is None:
            return
        if self.spare is not None:
            self.spare = self.momentum
        self.momentum, self.undo = self.undo, None
        self.inner.rollback()

    def decompress(self, payload: Payload, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.inner.decompress(payload, out)

    def decompress_add(self, payload: Payload, total: torch.Tensor,
                       scratch: torch.Tensor | None = None) -> torch.Tensor:
        return self.inner.decompress_add(payload, total, scratch)

    def state_dict(self) -> dict:
        return {"momentum": self.momentum.clone(), "inner": self.inner.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        check_state_keys(self, state, ("momentum", "inner"))
        self.inner.load_state_dict(state["inner"])
        load_buffer(self, "momentum", self.momentum, state["momentum"])
        self.undo = None
