"""Chains that run on the gradient's device: torch kernels with one host sync per compress.

A compressor with torch kernels (``onebit_torch``, ``topk_torch``, ``randomk_torch``,
``bytegrad_torch``) and the decorators around it compress in two halves:
``encode(x) -> (payload, status)`` computes everything into spare buffers and changes
no state; ``status`` is a 2-element int64 tensor on the device, ``(code, detail)``. The
caller reads it once (the only host sync), then ``commit()`` makes the new state
current, or ``discard()`` drops it and raises the error the code names::

    OK                  0
    CHAIN_NONFINITE     1    a decorator's g' (Nesterov lookahead, error feedback) has inf/NaN
    INPUT_NONFINITE     2    the compressor's input has inf/NaN (detail: a chunk, or -1)
    RANGE_OVERFLOW      3    bytegrad: a chunk's max - min overflows float32 (detail: the chunk)
                             onebit: the scale is beyond float32 (detail: the mean's bits)

``BPS_DEVICE_KERNELS=1`` has ``build`` use these kernels on CPU tensors too (tests, debugging).

Example::

    >>> import torch
    >>> from bps.compressors.topk_torch import TopKTorch
    >>> chain = TopKTorch(numel=4, dtype=torch.float32, k=2, device="cpu")
    >>> payload, status = chain.encode(torch.tensor([1.0, -3.0, 0.5, 2.0]))
    >>> status.tolist()       # read once: OK, so commit
    [0, -1]
    >>> chain.commit()
"""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np
import torch

from .base import KERNEL_FLOAT_DTYPES, Compressor, NonFiniteError, Payload, payload_tensor

ENV_SWITCH = "BPS_DEVICE_KERNELS"
OK, CHAIN_NONFINITE, INPUT_NONFINITE, RANGE_OVERFLOW = 0, 1, 2, 3
_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def forced_by_env(environ: dict | None = None) -> bool:
    """Whether ``BPS_DEVICE_KERNELS`` is 1: torch kernels also for CPU tensors.

        >>> forced_by_env({"BPS_DEVICE_KERNELS": "1"}), forced_by_env({})
        (True, False)
    """
    value = (os.environ if environ is None else environ).get(ENV_SWITCH, "0")
    if value not in ("0", "1"):
        raise ValueError(f"environment variable {ENV_SWITCH} must be 0 or 1, got {value!r}")
    return value == "1"


def resolve_device(device: torch.device | str | None) -> torch.device:
    """``device`` as a torch.device with an index for CUDA (the current device if none)."""
    device = torch.device("cpu" if device is None else device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def int_view(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's raw bits as a signed int tensor of the same width (no copy)."""
    return tensor.view(_INT_OF_WIDTH[tensor.element_size()])


def flag_status(bad: torch.Tensor, code: int, detail: torch.Tensor | int = -1) -> torch.Tensor:
    """``(code, detail)`` where the 0-dim bool ``bad`` is True, else ``(OK, -1)``."""
    codes = torch.where(bad, code, OK).to(torch.int64)  # Python scalars: no host transfer
    return torch.stack([codes, torch.where(bad, detail, -1).to(torch.int64)])


def first_bad(status: torch.Tensor, later: torch.Tensor) -> torch.Tensor:
    """``status`` if it is not OK, else ``later``: the first stage that refused wins.
    ``later`` may be a host tensor (a stage that synced already): it goes up without a
    sync."""
    if later.device != status.device:
        later = later.to(status.device, non_blocking=True)
    return torch.where(status[0] != OK, status, later)


def to_device_async(array: np.ndarray | torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host array or tensor on ``device`` without a host sync: through pinned memory
    for CUDA (the caching host allocator keeps the pinned block until the copy is done)."""
    tensor = torch.from_numpy(array) if isinstance(array, np.ndarray) else array
    if device.type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


class StagedChain:
    """The staged protocol of device chains (see the module docstring); ``compress``
    runs ``encode``, reads the status once and commits or discards."""

    device: torch.device
    # whether compress runs the two halves: a decorator's follows its inner chain
    staged: bool = True
    # whether encode_kernels launches kernels only (no host sync), given its inner chain's
    kernels_only: bool = True

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(payload, status)`` of ``x``; decorators: the input checked, then
        :meth:`prepare` and :meth:`encode_kernels` (compressors define their own)."""
        x = self.check_input(x)
        self.prepare()
        return self.encode_kernels(x)

    def graph_key(self) -> tuple | None:
        """Whether this step's ``encode`` can be replayed from a captured CUDA graph: a
        hashable tuple of what its kernels bake in besides the input (the addresses of
        the buffers they read and write), or None where it cannot (host work or a host
        sync inside, or Python numbers that change between steps). A chain that returns a
        tuple splits ``encode`` into :meth:`prepare` and :meth:`encode_kernels`."""
        return None

    def prepare(self) -> None:
        """The part of ``encode`` that a graph's replay would miss: changes to Python
        state, and device scalars written before the kernels (none here)."""

    def encode_kernels(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``encode`` after :meth:`prepare`: kernels only, on a checked input."""
        return self.encode(x)

    def commit(self) -> None:
        """Make the state that the last ``encode`` staged current."""

    def discard(self) -> None:
        """Drop what the last ``encode`` staged (and undo this step's ``set_lr``)."""

    def status_error(self, code: int, detail: int) -> Exception:
        """The error a non-OK status code stands for."""
        return NonFiniteError(f"{type(self).__name__}: compress input (numel={self.numel}, "
                              f"{self.dtype}) has inf or NaN entries")

    def run_staged(self, x: torch.Tensor) -> torch.Tensor:
        payload, status = self.encode(x)
        code, detail = status.tolist()  # the one host sync of a compress
        if code != OK:
            self.discard()
            raise self.status_error(code, detail)
        self.commit()
        return payload


def decorator_graph_key(chain, name: str,
                        buffers: Callable[[], list[torch.Tensor]]) -> tuple | None:
    """A decorator's ``graph_key``: None where its inner chain's is None, where its
    ``encode_kernels`` would sync with the host, or where its dtype is float16/bfloat16
    (the numbers it writes into device scalars round as float32 ones there); else
    ``name``, the addresses of ``buffers()`` (made on first use) and the inner key."""
    inner = chain.inner.graph_key() if is_staged(chain.inner) else None
    if inner is None or chain.dtype not in KERNEL_FLOAT_DTYPES or not chain.kernels_only:
        return None
    return (name, *(buffer.data_ptr() for buffer in buffers()), inner)


def write_scalar(scalar: torch.Tensor | None, value: float,
                 like: torch.Tensor) -> torch.Tensor:
    """``value`` in a 0-dim tensor of ``like``'s dtype and device (``scalar``, or a new
    one where None), rounded as a multiply by the Python number rounds it: beyond
    float32's range, inf (where ``fill_`` would refuse it)."""
    if scalar is None:
        scalar = torch.empty((), dtype=like.dtype, device=like.device)
    if scalar.dtype == torch.float32:
        with np.errstate(over="ignore"):
            value = float(np.float32(value))
    return scalar.fill_(value)


def is_staged(chain: object) -> bool:
    """Whether ``chain`` compresses with torch kernels in two halves (a device chain)."""
    return isinstance(chain, StagedChain) and chain.staged


class TorchKernels(StagedChain, Compressor):
    """Base of the compressors with torch kernels: inputs, outputs and payloads live on
    ``device``; ``compress`` is encode, one status read, commit."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device | str | None):
        Compressor.__init__(self, numel, dtype)
        self.device = resolve_device(device)

    # whether ``encode`` is kernels only, with no host sync and no per-step Python number
    graphable: bool = False

    def compress(self, x: torch.Tensor) -> torch.Tensor:
        return self.run_staged(x)

    def graph_key(self) -> tuple | None:
        return () if self.graphable else None

    def encode_residual(self, corrected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``encode(corrected)``, then ``corrected -= decompress(payload)`` in place
        (error feedback's residual; ``corrected`` is a scratch buffer of the chain)."""
        raise NotImplementedError

    def decode_key(self, payload: np.ndarray) -> tuple | None:
        """Check a payload still on the host as ``decompress`` would, raising the same
        errors, and return what decoding it depends on besides its bytes (the key of
        :meth:`decode_checked`'s CUDA graph); None where the checks run on the device.
        A compressor may also define ``decode_upload(payload) -> np.ndarray``: the bytes
        that go up for ``decode_checked`` instead of the payload, made on the host
        (randomk: its drawn indices with the payload; dithering: the decoded values)."""
        return None

    def decode_checked(self, payload: torch.Tensor, key: tuple) -> torch.Tensor:
        """The decoding of a payload (on the device) that :meth:`decode_key` passed with
        ``key``, as a new tensor of the chain's dtype: kernels only, no host sync."""
        raise NotImplementedError

    def status_error(self, code: int, detail: int) -> Exception:
        return self.nonfinite_input()

    def nonfinite_input(self) -> NonFiniteError:
        return NonFiniteError(f"{self.algorithm()}: compress input (numel={self.numel}, "
                              f"{self.dtype}) has inf or NaN entries")

    def bad_payload(self, what: str) -> ValueError:
        return ValueError(f"{self.algorithm()} payload for numel={self.numel}, "
                          f"dtype={self.dtype} is invalid: {what}")

    def algorithm(self) -> str:
        """The name messages give: the host class's (they speak of the same payload)."""
        return type(self).__name__.removesuffix("Torch")

    def device_payload(self, payload: Payload) -> torch.Tensor:
        """The payload as a 1-D uint8 tensor on the chain's device of the right size
        (bytes-like payloads are copied there)."""
        if isinstance(payload, torch.Tensor):
            if payload.dtype != torch.uint8 or payload.dim() != 1:
                raise ValueError(f"payload tensor must be 1-D torch.uint8, got {payload.dtype} "
                                 f"with shape {tuple(payload.shape)}")
            if payload.device != self.device:
                raise ValueError(f"payload tensor must be on {self.device}, "
                                 f"got {payload.device}")
        else:
            payload = payload_tensor(payload).to(self.device)
        if payload.numel() != self.payload_size:
            raise self.bad_payload(f"{payload.numel()} bytes, expected exactly "
                                   f"{self.payload_size}")
        return payload.contiguous()
