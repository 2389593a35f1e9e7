"""The Compressor interface and the helpers every compressor shares.

A compressor turns a 1-D CPU tensor of ``numel`` elements into the exact wire bytes
(a 1-D ``torch.uint8`` tensor) and back. Payloads are self-describing: decoding needs
only ``numel`` and ``dtype``, which both ends know. Byte order is little-endian.

Kernels see numpy views of the tensors (zero-copy). Gathers and scatters are
dtype-agnostic, so they run on the raw bits (``bit_view``): one specialisation per
element width serves float16, bfloat16, float32 and float64.
"""

from __future__ import annotations

import warnings
from typing import ClassVar

import numpy as np
import torch

from .sparse import add_last_values

Payload = torch.Tensor | bytes | bytearray | memoryview | np.ndarray

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
# what numba kernels compute in directly; float16/bfloat16 go through float32 or torch ops
KERNEL_FLOAT_DTYPES = (torch.float32, torch.float64)
_BITS_DTYPE = {2: torch.int16, 4: torch.int32, 8: torch.int64}
_UNSIGNED = {2: np.uint16, 4: np.uint32, 8: np.uint64}
# the exponent bits of each dtype: all set means inf or NaN
_EXPONENT_MASK = {torch.float16: 0x7C00, torch.bfloat16: 0x7F80, torch.float32: 0x7F800000,
                  torch.float64: 0x7FF0000000000000}


class NonFiniteError(ValueError):
    """A tensor with inf or NaN entries: what every compressor's ``compress`` raises for
    such an input, before it changes any state (its RNG included). The trainer raises
    its subclass ``bps.NonFiniteGradientError``, naming the parameter, node and step."""


def check_dtype(dtype: torch.dtype) -> torch.dtype:
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"dtype {dtype} is not supported: expected one of {SUPPORTED_DTYPES}")
    return dtype


def bit_view(tensor: torch.Tensor) -> np.ndarray:
    """The tensor's raw bits as an unsigned-int numpy array of the same width (no copy)."""
    size = tensor.element_size()
    return tensor.view(_BITS_DTYPE[size]).numpy().view(_UNSIGNED[size])


def magnitude_bits(values: np.ndarray) -> tuple[np.ndarray, np.unsignedinteger]:
    """The raw bits of float32/float64 ``values`` as unsigned ints of the same width (no
    copy) and the mask of all bits but the sign: ``bits & mask`` orders as ``|values|``,
    with NaN above inf."""
    bits = values.view(_UNSIGNED[values.itemsize])
    return bits, bits.dtype.type(np.iinfo(bits.dtype).max >> 1)


def nonfinite_bits(bits: np.ndarray, dtype: torch.dtype) -> bool:
    """Whether the raw ``bits`` of ``dtype`` values (a few, e.g. a sparse payload's k
    values) hold an inf or NaN."""
    mask = bits.dtype.type(_EXPONENT_MASK[dtype])
    return bool(np.any((bits & mask) == mask))


def float_view(tensor: torch.Tensor) -> np.ndarray:
    """A float32/float64 numpy array of the values: zero-copy for float32/float64,
    a float32 copy for float16/bfloat16 (exact)."""
    if tensor.dtype in KERNEL_FLOAT_DTYPES:
        return tensor.numpy()
    return tensor.float().numpy()


def payload_bytes(payload: Payload) -> np.ndarray:
    """The payload as a 1-D uint8 numpy array, without copying where possible.

    Accepts a uint8 tensor, bytes, bytearray, memoryview (e.g. a zmq frame buffer) or
    numpy array. The result is aligned to 8 bytes (copied if the buffer is not), so
    kernels may view its parts as wider types.
    """
    if isinstance(payload, torch.Tensor):
        if payload.dtype != torch.uint8 or payload.dim() != 1:
            raise ValueError(
                f"payload tensor must be 1-D torch.uint8, got {payload.dtype} "
                f"with shape {tuple(payload.shape)}"
            )
        if payload.device.type != "cpu":
            raise ValueError(f"payload tensor must be on the CPU, got {payload.device}")
        array = payload.contiguous().numpy()
    elif isinstance(payload, (bytes, bytearray, memoryview)):
        array = np.frombuffer(payload, dtype=np.uint8)
    elif isinstance(payload, np.ndarray):
        array = payload.reshape(-1).view(np.uint8)
    else:
        raise ValueError(
            f"payload must be a uint8 tensor, bytes, bytearray or memoryview, "
            f"got {type(payload).__name__}"
        )
    if array.size and array.ctypes.data % 8:
        array = array.copy()  # numpy allocations are 16-byte aligned
    return array


def payload_tensor(payload: Payload) -> torch.Tensor:
    """The payload as a 1-D uint8 tensor (zero-copy where possible; read-only buffers
    such as bytes are shared, not copied: do not write into the result)."""
    if isinstance(payload, torch.Tensor):
        payload_bytes(payload)  # validates dtype, shape and device
        return payload
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch warns on read-only buffers
        return torch.from_numpy(payload_bytes(payload))


def sub_array(buffer: np.ndarray, offset: int, dtype: type, count: int) -> np.ndarray:
    """``count`` elements of ``dtype`` at byte ``offset`` of a uint8 array (a view)."""
    itemsize = np.dtype(dtype).itemsize
    return buffer[offset : offset + count * itemsize].view(dtype)


class Compressor:
    """Base class of compressors and of the chain decorators.

    Subclasses implement :meth:`compress` and :meth:`decompress`; state-free compressors
    keep the default ``set_lr``/``state_dict``/``load_state_dict``. A compressor may add
    ``fast_update_error(corrected, payload)``: subtract ``decompress(payload)`` from
    ``corrected`` in place, faster than decoding, or ``compress_residual(corrected)``:
    compress and leave that residual in ``corrected`` in the same pass (error feedback
    uses either); and may override ``decompress_add`` (see there). The payload
    must not share memory with ``x``: the chain decorators reuse their buffers, so ``x``
    is overwritten by the next step (error feedback even updates it in place right after).

    Example::

        >>> import torch
        >>> from bps.compressors import build
        >>> c = build({"compressor": "onebit", "scaling": True}, numel=4)
        >>> payload = c.compress(torch.tensor([1.0, -2.0, 3.0, -4.0]))
        >>> c.decompress(payload)
        tensor([ 2.5000, -2.5000,  2.5000, -2.5000])
    """

    # Pushes per step. A compressor with rounds > 1 (powersgd) is called as
    # ``compress(x)`` (round 0), ``compress_round(r, sum of round r - 1)`` for r = 1 ..
    # rounds - 1, then ``decompress(sum of the last round, out)``. Every round's payload
    # is a float32 vector of ``round_numel(r)`` elements that the servers sum as it is;
    # such a compressor keeps its own error (build adds no ErrorFeedback around it).
    rounds = 1
    # Declared ability: the class has a twin with torch kernels that build() uses for a
    # chain on a device (or with BPS_DEVICE_KERNELS=1); see compressors/device.py.
    device_kernels: ClassVar[bool] = False
    # where the chain's buffers, inputs, outputs and payloads live (torch-kernel chains)
    device: torch.device = torch.device("cpu")

    def __init__(self, numel: int, dtype: torch.dtype = torch.float32):
        if isinstance(numel, bool) or not isinstance(numel, int) or numel < 1:
            raise ValueError(f"numel must be an int >= 1, got {numel!r}")
        self.numel = numel
        self.dtype = check_dtype(dtype)

    @classmethod
    def max_payload_bytes(cls, numel: int, dtype: torch.dtype = torch.float32,
                          **options: object) -> int | None:
        """Most bytes a payload of ``numel`` elements can take, for the constructor's
        ``options``; ``None``: no bound stated (a user compressor is trusted to compress).
        The trainer weighs keys by it and sends a partition raw where it would not shrink.
        """
        return None

    def compress(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def decompress(self, payload: Payload, out: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError

    def decompress_add(self, payload: Payload, total: torch.Tensor,
                       scratch: torch.Tensor | None = None) -> torch.Tensor:
        """``total += decompress(payload)`` (``total``: a contiguous 1-D CPU tensor of
        numel elements in the compressor's dtype); returns ``total``. A server sums its
        pushes this way. This default decodes into ``scratch`` (reused if given) and adds;
        sparse and sign compressors add in place without decoding.

        Example::

            >>> import torch
            >>> from bps.compressors.topk import TopK
            >>> c, total = TopK(numel=3, k=1), torch.ones(3)
            >>> c.decompress_add(c.compress(torch.tensor([0.0, -2.0, 1.0])), total)
            tensor([ 1., -1.,  1.])
        """
        return self.output(total, "total").add_(self.decompress(payload, scratch))

    def set_lr(self, lr: float) -> None:
        """Learning rate of the current step (used by error feedback)."""

    def scale_momentum(self, factor: float) -> None:
        """Have the next ``compress`` take the momentum the chain carries ``factor`` times
        larger (a GradScaler's change of loss scale: the gradients that follow are
        ``factor`` times larger); ``rollback`` returns to it unscaled. Only
        :class:`Momentum` has any; error feedback follows the scale through ``set_lr``'s
        learning rate instead."""

    def cancel(self) -> None:
        """Undo a ``set_lr`` whose ``compress`` is not coming (a decorator refused the
        input before its inner compressor saw it)."""

    def rollback(self) -> None:
        """Undo the last ``set_lr`` and ``compress``: the state (error, momentum, RNG,
        learning rates) is again what it was before them. One step back only; a
        ``compress`` that raised changed nothing to undo. Stateless compressors keep
        this no-op; a registered compressor with state implements it, else a skipped
        step (``bps.NonFiniteGradientError``) cannot restore it."""

    def set_workers(self, count: int) -> None:
        """The number of worker nodes whose pushes the servers sum (the engine calls it;
        a compressor whose error is its share of the aggregate's keeps it)."""

    def round_numel(self, round_: int) -> int:
        """Elements of round ``round_``'s payload (compressors with rounds > 1)."""
        raise NotImplementedError

    def compress_round(self, round_: int, aggregate: Payload) -> torch.Tensor:
        """Round ``round_``'s payload from the servers' sum of round ``round_ - 1``."""
        raise NotImplementedError

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        if state:
            raise ValueError(f"{type(self).__name__} has no state, got keys {sorted(state)}")

    # helpers for subclasses -------------------------------------------------------------

    def check_input(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"compress expects a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 1 or x.numel() != self.numel or x.dtype != self.dtype:
            raise ValueError(
                f"compress expects a 1-D {self.dtype} tensor of {self.numel} elements, "
                f"got {x.dtype} with shape {tuple(x.shape)}"
            )
        if x.device != self.device:
            raise ValueError(f"compress expects {self.where()}, got {x.device}")
        return x.contiguous()

    def where(self) -> str:
        """Where the chain's tensors live, for messages: "a CPU tensor" or "a tensor on ..."."""
        return "a CPU tensor" if self.device.type == "cpu" else f"a tensor on {self.device}"

    def output(self, out: torch.Tensor | None, name: str = "out") -> torch.Tensor:
        if out is None:
            return torch.empty(self.numel, dtype=self.dtype, device=self.device)
        if (
            not isinstance(out, torch.Tensor)
            or out.dim() != 1
            or out.numel() != self.numel
            or out.dtype != self.dtype
            or out.device != self.device
            or not out.is_contiguous()
        ):
            raise ValueError(
                f"{name} must be a contiguous 1-D {self.dtype} tensor of {self.numel} "
                f"elements ({self.where()}), got {getattr(out, 'dtype', type(out).__name__)} "
                f"with shape {tuple(getattr(out, 'shape', ()))} on {getattr(out, 'device', None)}"
            )
        return out

    def staging(self) -> np.ndarray:
        """An all-zero float32/float64 array of numel elements, made on first use, for
        ``sparse.add_last_values`` (which leaves it all zero again)."""
        staging = getattr(self, "_staging", None)
        if staging is None:
            staging = self._staging = torch.zeros(self.numel, dtype=self.dtype).numpy()
        return staging

    def add_entries(self, indices: np.ndarray, raw_values: np.ndarray,
                    total: torch.Tensor) -> torch.Tensor:
        """``total += y`` for the sparse ``y`` that decoding writes (zeros, then
        ``y[indices[j]] = value j`` in order, so a repeated index keeps its last value),
        touching only the indexed elements; ``raw_values`` are the values' raw bits and
        the indices are checked. float32/float64 only."""
        target = float_view(self.output(total, "total"))
        add_last_values(indices, raw_values.view(target.dtype), self.staging(), target)
        return total

    def nonfinite_input(self) -> NonFiniteError:
        """The error ``compress`` raises for an input with inf or NaN entries."""
        return NonFiniteError(f"{type(self).__name__}: compress input (numel={self.numel}, "
                              f"{self.dtype}) has inf or NaN entries")

    def check_finite_values(self, bits: np.ndarray) -> None:
        """Refuse a payload whose values (raw bits of the dtype) hold an inf or NaN."""
        if nonfinite_bits(bits, self.dtype):
            raise self.bad_payload("a value is inf or NaN")

    def bad_payload(self, what: str) -> ValueError:
        return ValueError(f"{type(self).__name__} payload for numel={self.numel}, "
                          f"dtype={self.dtype} is invalid: {what}")

    def check_size(self, payload: np.ndarray, expected: int) -> None:
        if payload.size != expected:
            raise self.bad_payload(f"{payload.size} bytes, expected exactly {expected}")


def add_decompressed(compressor: object, payload: Payload, total: torch.Tensor,
                     scratch: torch.Tensor | None = None) -> torch.Tensor:
    """``compressor.decompress_add(payload, total, scratch)``, or decode and add for a
    registered compressor that has no ``decompress_add``."""
    method = getattr(compressor, "decompress_add", None)
    if method is not None:
        return method(payload, total, scratch)
    return total.add_(compressor.decompress(payload, scratch))


def check_state_keys(owner: object, state: dict, keys: tuple) -> None:
    """Raise a ValueError naming the keys a state dict lacks or has in excess."""
    if not isinstance(state, dict):
        raise ValueError(f"{type(owner).__name__} state must be a dict, got {type(state).__name__}")
    if set(state) != set(keys):
        raise ValueError(
            f"{type(owner).__name__} state has keys {sorted(state)}, expected {sorted(keys)}"
        )


def load_buffer(owner: object, name: str, target: torch.Tensor, value: object) -> None:
    """Copy a saved tensor into a state buffer after checking dtype and shape."""
    if (
        not isinstance(value, torch.Tensor)
        or value.dtype != target.dtype
        or tuple(value.shape) != tuple(target.shape)
    ):
        raise ValueError(
            f"{type(owner).__name__} state {name!r} must be a {target.dtype} tensor of shape "
            f"{tuple(target.shape)}, got {getattr(value, 'dtype', type(value).__name__)} "
            f"{tuple(getattr(value, 'shape', ()))}"
        )
    target.copy_(value)
