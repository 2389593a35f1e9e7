"""powersgd: rank-r PowerSGD (Vogels et al. 2019) as PyTorch's ``powerSGD_hook`` runs it,
summed by the parameter servers in two rounds, docs/compression.md.

A key holds one matrix ``M`` (n x m: a parameter's gradient viewed as ``shape[0]`` rows),
or ``b`` matrices of one shape compressed together (the batched variant). Each step::

    M = x + e                         (e: this worker's error; 0 without error feedback)
    Q = orth(Q)                       (warm start: last step's Q; else, and at first, random)
    round 0: push P = M Q             servers sum: P = sum over workers
    round 1: P = orth(P); push Q = M^T P    servers sum: Q = sum over workers
    decode:  y = P Q^T                (the averaged gradient's approximation)
    e = M - y / workers               (error feedback: this worker's share of the error)

A gradient with inf or NaN entries (after adding the error) raises NonFiniteError with
the state unchanged. ``rollback`` undoes the last step (error, Q, random draws): the
error is double-buffered, so the step before stays intact until the next decode.

Rounds travel as raw float32 vectors of ``b*n*r`` and ``b*m*r`` elements; the servers
sum them like any float32 key. ``orth`` is Gram-Schmidt for r <= 2 and QR (Householder,
``torch.linalg.qr``) above, per matrix, with the same torch ops as the hook; a column of
zeros stays zero (the hook's own fallback). The first random Q (and every Q without warm
start) is ``torch.randn(b, m, r)`` from a ``torch.Generator`` seeded with ``seed + j`` for
the j-th draw of the key (mod 2**64).

Example::

    >>> import torch
    >>> c = PowerSGD(numel=6, shape=(3, 2), rank=1, ef=False)
    >>> x = torch.tensor([1.0, 2.0, 2.0, 4.0, 3.0, 6.0])      # rank one: exact
    >>> p = c.compress(x)                                      # round 0 (one worker)
    >>> q = c.compress_round(1, p.view(torch.float32))         # round 1
    >>> [round(v, 5) for v in c.decompress(q).tolist()]
    [1.0, 2.0, 2.0, 4.0, 3.0, 6.0]
"""

from __future__ import annotations

import math
import threading
from typing import Any, ClassVar

import torch

from bps.common.config import Key, boolean, fail, integer, is_int, real

from .base import (
    Compressor,
    Description,
    NonFiniteError,
    Payload,
    check_state_keys,
    load_buffer,
    payload_tensor,
)
from .rng import job_seed


def should_compress(n: int, m: int, rank: int, min_rate: float) -> bool:
    """PyTorch's rule: compress an n x m matrix where ``(n + m) * r * min_rate < n * m``
    (r = min(n, m, rank)).

        >>> should_compress(784, 512, 1, 2.0), should_compress(10, 2, 1, 2.0)
        (True, False)
    """
    r = min(n, m, rank)
    return (n + m) * r * min_rate < n * m


_linalg_lock = threading.Lock()
_cuda_linalg_loaded = False


def load_cuda_linalg(device: torch.device) -> None:
    """Make this process's first CUDA linear-algebra call, under a lock. torch loads its
    CUDA linalg library lazily on that call, and two threads making it at once fail
    ("lazy wrapper should be called at most once"): a node's codec threads orthogonalise
    their first Qs together."""
    global _cuda_linalg_loaded
    with _linalg_lock:
        if not _cuda_linalg_loaded:
            torch.linalg.qr(torch.eye(2, device=device))
            _cuda_linalg_loaded = True


def orthogonalize(matrices: torch.Tensor, epsilon: float = 0.0) -> None:
    """Orthonormalise the columns of each matrix of a (b, n, r) batch in place, with the
    torch ops of PyTorch's PowerSGD hook: Gram-Schmidt for r <= 2, QR above."""
    rank = matrices.shape[2]
    if rank > 2:
        if matrices.is_cuda and not _cuda_linalg_loaded:
            load_cuda_linalg(matrices.device)
        q, _ = torch.linalg.qr(matrices)
        matrices.copy_(q)
        return
    for i in range(rank):
        col = matrices[:, :, i:i + 1]
        norm = torch.norm(col, dim=1, keepdim=True)
        if epsilon == 0:
            col /= torch.where(norm == 0, 1.0, norm)  # a zero column stays zero
        else:
            col /= norm + epsilon
        if i + 1 < rank:
            rest = matrices[:, :, i + 1:]
            rest -= torch.sum(col * rest, dim=1, keepdim=True) * col


def matrix_shape(key: str, value: Any) -> list[int]:
    """The rule of ``shape``: 2 or 3 ints >= 1 (set per key by the trainer)."""
    if (not isinstance(value, (list, tuple)) or len(value) not in (2, 3)
            or not all(is_int(d) and d >= 1 for d in value)):
        raise fail(ValueError, key, value, "None or 2 or 3 ints >= 1 (set per key by the trainer)")
    return [int(d) for d in value]


class PowerSGD(Compressor):
    """Rank-r PowerSGD over two server rounds; keeps its own error and warm-start Q.

    Abilities: :class:`~bps.compressors.base.MultiRound` (its rounds P and Q) and
    :class:`~bps.compressors.base.WholeTensor` (a parameter travels whole, as a matrix).
    Its keys are PyTorch's ``PowerSGDState`` options; ``warmup_steps`` is the start
    step, ``seed`` seeds the first Q and ``ef`` is its own error feedback.
    """

    description: ClassVar[Description] = Description(
        examples=({"rank": 1},), dtypes=(torch.float32,), payloads_sum=True,
        tolerance="rounding", label="rank-r factors, two rounds")
    keys: ClassVar[dict[str, Key]] = {
        "rank": Key(integer(1), required="an int >= 1 (rank of the approximation)"),
        "warm_start": Key(boolean, default=True),
        "orthogonalization_epsilon": Key(real(0.0), default=0.0),
        "min_compression_rate": Key(real(0.0), default=2.0),
        "batch_tensors_with_same_shape": Key(boolean, default=False),
        "shape": Key(matrix_shape),  # per key: (n, m) or (batch, n, m)
    }
    rounds = 2

    def __init__(self, numel: int, dtype: torch.dtype = torch.float32,
                 shape: tuple | list | None = None, rank: int = 1, ef: bool = True,
                 warm_start: bool = True, epsilon: float = 0.0, seed: int = 1):
        super().__init__(numel, dtype)
        if dtype != torch.float32:
            raise TypeError(f"powersgd compresses float32 tensors, not {dtype}")
        shape = tuple(shape or (numel, 1))
        if len(shape) == 2:
            shape = (1, *shape)
        if len(shape) != 3 or math.prod(shape) != numel or min(shape) < 1:
            raise ValueError(f"powersgd shape {shape} does not hold numel={numel} as "
                             "(n, m) or (batch, n, m)")
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"powersgd rank must be an int >= 1, got {rank!r}")
        self.batch, self.n, self.m = shape
        self.rank = min(self.n, self.m, rank)
        self.ef, self.warm_start, self.epsilon, self.seed = ef, warm_start, epsilon, seed
        self.workers = 1
        self.matrix = torch.zeros(shape)
        self.error = torch.zeros(numel) if ef else None
        self.spare: torch.Tensor | None = None  # the other error buffer (first decode)
        self.undo: tuple | None = None  # (error, q, draws) before the last compress
        self.p = torch.zeros(self.batch, self.n, self.rank)
        self.q = torch.zeros(self.batch, self.m, self.rank)
        self.draws = 0  # random Qs drawn so far

    @classmethod
    def check_params(cls, params: dict) -> None:
        """No chain momentum: the optimizer keeps its own, as with DDP's hook."""
        if params["momentum"] is not None:
            raise ValueError("compression_params['momentum'] = 'nesterov' cannot be used "
                             "with compressor 'powersgd': keep the optimizer's momentum "
                             "instead")

    @classmethod
    def options(cls, params: dict, numel: int) -> dict:
        return {"shape": params["shape"], "rank": params["rank"],
                "ef": params["ef"] == "vanilla", "warm_start": params["warm_start"],
                "epsilon": params["orthogonalization_epsilon"], "seed": job_seed(params)}

    @classmethod
    def tensor_shape(cls, shape: tuple[int, ...] | None, params: dict) -> list[int] | None:
        """[n, m]: a parameter of 2 or more dimensions viewed as ``shape[0]`` rows, where
        it meets ``min_compression_rate`` (else None: it travels raw, as in PyTorch).

            >>> PowerSGD.tensor_shape((10, 2), {"rank": 1, "min_compression_rate": 2.0})
            >>> PowerSGD.tensor_shape((784, 512), {"rank": 1, "min_compression_rate": 2.0})
            [784, 512]
        """
        if shape is None or len(shape) < 2 or math.prod(shape) == 0:
            return None
        n, m = int(shape[0]), math.prod(shape) // int(shape[0])
        if not should_compress(n, m, params["rank"], params["min_compression_rate"]):
            return None
        return [n, m]

    @classmethod
    def batches(cls, params: dict) -> bool:
        """``batch_tensors_with_same_shape``: PyTorch's batched compression."""
        return params["batch_tensors_with_same_shape"]

    @classmethod
    def max_payload_bytes(cls, numel: int, dtype: torch.dtype = torch.float32,
                          shape: tuple | list | None = None, rank: int = 1,
                          **options: object) -> int:
        """Bytes one worker pushes per step, both rounds together: ``4 * b * (n + m) * r``.

            >>> PowerSGD.max_payload_bytes(784 * 512, shape=(784, 512), rank=2)
            10368
        """
        shape = tuple(shape or (numel, 1))
        b, n, m = (1, *shape) if len(shape) == 2 else shape
        return 4 * b * (n + m) * min(n, m, rank)

    def set_workers(self, count: int) -> None:
        self.workers = count

    def round_numel(self, round_: int) -> int:
        """Elements the servers sum in ``round_``: P (b*n*r), then Q (b*m*r)."""
        return self.batch * (self.n if round_ == 0 else self.m) * self.rank

    def random_q(self) -> torch.Tensor:
        """The key's next random Q: ``randn(b, m, r)`` seeded with ``seed + draws``."""
        generator = torch.Generator().manual_seed((self.seed + self.draws) % 2**64)
        self.draws += 1
        return torch.randn(self.batch, self.m, self.rank, generator=generator)

    def compress(self, x: torch.Tensor) -> torch.Tensor:
        """Round 0: M = x + e; P = M orth(Q), as float32 bytes."""
        x = self.check_input(x)
        self.undo = None
        flat = self.matrix.view(-1)
        if self.ef:
            torch.add(x, self.error, out=flat)
        else:
            flat.copy_(x)
        if not bool(torch.isfinite(flat).all()):
            raise NonFiniteError(f"powersgd: the gradient (numel={self.numel}"
                                 f"{', plus its error' if self.ef else ''}) has inf or NaN "
                                 "entries")
        self.undo = (self.error, self.q.clone(), self.draws)
        if not self.warm_start or self.draws == 0:
            self.q.copy_(self.random_q())
        orthogonalize(self.q, self.epsilon)
        torch.bmm(self.matrix, self.q, out=self.p)
        return self.p.reshape(-1).clone().view(torch.uint8)

    def _values(self, payload: Payload | torch.Tensor, round_: int) -> torch.Tensor:
        """A round's summed float32 vector (a float32 tensor or its bytes), checked."""
        if isinstance(payload, torch.Tensor) and payload.dtype == torch.float32:
            values = payload.reshape(-1)
        else:
            data = payload_tensor(payload)
            if data.numel() % 4:
                raise self.bad_payload(f"round {round_}: {data.numel()} bytes is not a "
                                       "whole number of float32 values")
            values = data.view(torch.float32)
        if values.numel() != self.round_numel(round_):
            raise self.bad_payload(f"round {round_} holds {values.numel()} values, "
                                   f"expected {self.round_numel(round_)}")
        return values

    def compress_round(self, round_: int, aggregate: Payload | torch.Tensor) -> torch.Tensor:
        """Round 1 from round 0's sum: P = orth(sum P); Q = M^T P, as float32 bytes."""
        if round_ != 1:
            raise ValueError(f"powersgd has rounds 0 and 1, got compress_round({round_})")
        self.p.view(-1).copy_(self._values(aggregate, 0))
        orthogonalize(self.p, self.epsilon)
        torch.bmm(self.matrix.transpose(1, 2), self.p, out=self.q)
        return self.q.reshape(-1).clone().view(torch.uint8)

    def decompress(self, payload: Payload | torch.Tensor,
                   out: torch.Tensor | None = None) -> torch.Tensor:
        """From round 1's sum Q: y = P Q^T (into ``out``); e = M - y / workers."""
        self.q.view(-1).copy_(self._values(payload, 1))
        out = self.output(out)
        torch.bmm(self.p, self.q.transpose(1, 2), out=out.view(self.matrix.shape))
        if self.ef:  # e = M - y / W, two roundings, in the other error buffer
            error = self.spare if self.spare is not None else torch.empty_like(self.error)
            torch.div(out, self.workers, out=error)
            torch.sub(self.matrix.view(-1), error, out=error)
            self.spare, self.error = self.error, error
        return out

    def rollback(self) -> None:
        """Back to the state before the last ``compress``: its error, Q and draws."""
        if self.undo is None:
            return
        error, q, self.draws = self.undo
        if error is not self.error:  # decoded since: the error before is the spare one
            self.spare, self.error = self.error, error
        self.q.copy_(q)
        self.undo = None

    def state_dict(self) -> dict:
        return {"error": None if self.error is None else self.error.clone(),
                "q": self.q.clone(), "draws": self.draws}

    def load_state_dict(self, state: dict) -> None:
        check_state_keys(self, state, ("error", "q", "draws"))
        self.undo = None
        if self.error is not None:
            load_buffer(self, "error", self.error, state["error"])
        elif state["error"] is not None:
            raise ValueError("PowerSGD state has an error buffer but error feedback is off")
        load_buffer(self, "q", self.q, state["q"])
        draws = state["draws"]
        if isinstance(draws, bool) or not isinstance(draws, int) or draws < 0:
            raise ValueError(f"PowerSGD state 'draws' must be an int >= 0, got {draws!r}")
        self.draws = draws
