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
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Literal, Protocol, runtime_checkable

import numpy as np
import torch

from bps.common.config import Key

Payload = torch.Tensor | bytes | bytearray | memoryview | np.ndarray

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
# what numba kernels compute in directly; float16/bfloat16 go through float32 or torch ops
KERNEL_FLOAT_DTYPES = (torch.float32, torch.float64)
_BITS_DTYPE = {2: torch.int16, 4: torch.int32, 8: torch.int64}
_UNSIGNED = {2: np.uint16, 4: np.uint32, 8: np.uint64}
NUMPY_FLOAT = {torch.float16: np.float16, torch.float32: np.float32, torch.float64: np.float64}
# the exponent bits of each dtype: all set means inf or NaN
EXPONENT_MASK = {torch.float16: 0x7C00, torch.bfloat16: 0x7F80, torch.float32: 0x7F800000,
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
    """The tensor's raw bits as an unsigned-int numpy array of the same width (no copy).
    Numpy views the dtypes it has; only bfloat16 takes a torch view first (each torch
    call lets other threads take the GIL, see bench/key_overhead.py --convoy)."""
    size = tensor.element_size()
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.view(_BITS_DTYPE[size])
    return array_bits(tensor.numpy())


def array_bits(values: np.ndarray) -> np.ndarray:
    """A numpy array's raw bits as unsigned ints of its width (a view, no torch call).

        >>> array_bits(np.array([1.0, -2.0], dtype=np.float32)).tolist()
        [1065353216, 3221225472]
    """
    return values.view(_UNSIGNED[values.itemsize])


def scalar_bits(values: list[float], dtype: torch.dtype) -> np.ndarray:
    """The raw bits of ``values`` (numbers float32 holds exactly, such as payloads'
    scales) in ``dtype``, as unsigned ints of its width.

        >>> scalar_bits([1.0, -2.0], torch.float32).tolist()
        [1065353216, 3221225472]
    """
    if dtype == torch.bfloat16:
        return bit_view(torch.tensor(values, dtype=dtype))
    return np.array(values, dtype=NUMPY_FLOAT[dtype]).view(_UNSIGNED[dtype.itemsize])


def magnitude_bits(values: np.ndarray) -> tuple[np.ndarray, np.unsignedinteger]:
    """The raw bits of float32/float64 ``values`` as unsigned ints of the same width (no
    copy) and the mask of all bits but the sign: ``bits & mask`` orders as ``|values|``,
    with NaN above inf."""
    bits = array_bits(values)
    return bits, bits.dtype.type(np.iinfo(bits.dtype).max >> 1)


def nonfinite_bits(bits: np.ndarray, dtype: torch.dtype) -> bool:
    """Whether the raw ``bits`` of ``dtype`` values (a few, e.g. a sparse payload's k
    values) hold an inf or NaN."""
    mask = bits.dtype.type(EXPONENT_MASK[dtype])
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
        payload = payload.contiguous()
        if payload.data_ptr() % 8:  # numpy's ctypes address costs more than torch's
            return payload.numpy().copy()  # numpy allocations are 16-byte aligned
        return payload.numpy()
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


@dataclass(frozen=True)
class Description:
    """What code that serves every compressor needs of one, stated by its class (the
    ``description`` attribute): conformance tests, the warm-up (``compressors/warm.py``),
    the benches and the examples loop over ``registered_names()`` and read this, never a
    compressor's name. A registered class without one works in training; those loops
    refuse it, naming what it lacks.

    ``examples``: ``compression_params`` beyond ``"compressor"``, each valid; tests run every
    one and the warm-up compiles each (vary the options whose code paths differ). ``typical``:
    what the examples and benches run where the user gives no option (default: the first
    example). ``dtypes``: the tensor dtypes it accepts. ``payloads_sum``: its payloads are
    vectors the servers add as they are, never decoded on their own (:class:`MultiRound`), so
    per-payload checks (decoding against a reference, ``decompress_add``) do not apply.
    ``tolerance``: how far its decoded values (host kernels, torch kernels, an independent
    reference) may be apart: ``"exact"`` (bit for bit), ``"scale_ulp"`` (the payload's last 4
    bytes, a float32 scale that is a float64 sum, added in another order, 1 ulp apart; the rest
    exact) or ``"rounding"`` (matrix products summed in another order). ``reads_all``:
    ``compress`` reads every element, so an inf or NaN anywhere is refused (False: only those it
    samples). ``ties``: its payload is defined where magnitudes tie (False: references agree
    only on distinct magnitudes). ``feedback``: the benches and examples run it with error
    feedback and the chain's Nesterov momentum (False: bare, the optimizer keeping its momentum:
    an unbiased compressor whose variance error feedback would feed back). ``label``: a few
    words for tables.

        >>> from bps.compressors.topk import TopK
        >>> TopK.description.examples[0], TopK.description.tolerance
        ({'k': 0.1}, 'exact')
    """

    examples: tuple[dict, ...]
    typical: dict | None = None
    dtypes: tuple[torch.dtype, ...] = SUPPORTED_DTYPES
    payloads_sum: bool = False
    tolerance: Literal["exact", "scale_ulp", "rounding"] = "exact"
    reads_all: bool = True
    ties: bool = True
    feedback: bool = True
    label: str = ""

    def __post_init__(self) -> None:
        if not self.examples or not all(isinstance(e, dict) for e in self.examples):
            raise ValueError(f"a Description needs examples (dicts), got {self.examples!r}")
        if any("compressor" in e for e in (*self.examples, self.typical or {})):
            raise ValueError("a Description's examples leave out 'compressor'")
        if self.tolerance not in ("exact", "scale_ulp", "rounding"):
            raise ValueError(f"tolerance must be 'exact', 'scale_ulp' or 'rounding', "
                             f"got {self.tolerance!r}")

    @property
    def defaults(self) -> dict:
        """``typical``, else the first example."""
        return dict(self.examples[0] if self.typical is None else self.typical)


class Compressor:
    """Base class of compressors and of the chain decorators.

    A compressor implements :meth:`compress` and :meth:`decompress`; the rest has
    defaults a state-free compressor keeps. What it reads of ``compression_params`` is
    its own: the ``keys`` table (each key's rule and default, ``bps.common.config.Key``),
    :meth:`check_params` for rules between keys and :meth:`options`, which turns the
    validated dict into its constructor's options. Optional abilities are the protocols
    below (:class:`MultiRound`, :class:`FastErrorUpdate`, :class:`ResidualCompress`,
    :class:`WholeTensor`); the worker and the chain decorators ask those, nothing else.
    The payload must not share memory with ``x``: the chain decorators reuse their
    buffers, so ``x`` is overwritten by the next step (error feedback even updates it in
    place right after).

    Example::

        >>> import torch
        >>> from bps.compressors import build
        >>> c = build({"compressor": "onebit", "scaling": True}, numel=4)
        >>> payload = c.compress(torch.tensor([1.0, -2.0, 3.0, -4.0]))
        >>> c.decompress(payload)
        tensor([ 2.5000, -2.5000,  2.5000, -2.5000])
    """

    # its compression_params keys beyond the shared ones (bps.common.config)
    keys: ClassVar[dict[str, Key]] = {}
    # what generic code (tests, warm-up, benches, examples) needs of it; see Description
    description: ClassVar[Description | None] = None
    # where the chain's buffers, inputs, outputs and payloads live (torch-kernel chains)
    device: torch.device = torch.device("cpu")

    def __init__(self, numel: int, dtype: torch.dtype = torch.float32):
        if isinstance(numel, bool) or not isinstance(numel, int) or numel < 1:
            raise ValueError(f"numel must be an int >= 1, got {numel!r}")
        self.numel = numel
        self.dtype = check_dtype(dtype)

    @classmethod
    def check_params(cls, params: dict) -> None:
        """Rules between keys, once each key of ``keys`` passed its own (``params``: the
        whole dict, shared keys checked); raise ValueError naming the key. Default: none."""

    @classmethod
    def options(cls, params: dict, numel: int) -> dict:
        """The constructor's keyword options for a partition of ``numel`` elements, from
        validated ``params``; :meth:`max_payload_bytes` takes the same. Default: none."""
        return {}

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

    divides_input = False  # divide_input works (error feedback, momentum: host kernels)
    divisor = 1.0  # divide_input's, for the next compress only

    def divide_input(self, divisor: float) -> None:
        """Have the next ``compress`` take ``x / divisor`` (each value rounded as torch
        divides) in place of ``x``, divided in its first pass over ``x`` rather than in
        one of its own; only chains whose ``divides_input`` is True (the worker's average
        over nodes, where nothing else reads the divided gradient)."""
        if not self.divides_input:
            raise TypeError(f"{type(self).__name__} cannot divide its input")
        self.divisor = float(divisor)

    def take_divisor(self) -> float:
        """The divisor of this compress (``divide_input``'s, or 1); the next one's is 1."""
        divisor, self.divisor = self.divisor, 1.0
        return divisor

    def cancel(self) -> None:
        """Undo a ``set_lr`` whose ``compress`` is not coming (a decorator refused the
        input before its inner compressor saw it)."""

    def rollback(self) -> None:
        """Undo the last ``set_lr`` and ``compress``: the state (error, momentum, RNG,
        learning rates) is again what it was before them. One step back only; a
        ``compress`` that raised changed nothing to undo. Stateless compressors keep
        this no-op; a registered compressor with state implements it, else a skipped
        step (``bps.NonFiniteGradientError``) cannot restore it."""

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

    def nonfinite_input(self) -> NonFiniteError:
        """The error ``compress`` raises for an input with inf or NaN entries."""
        return NonFiniteError(f"{type(self).__name__}: compress input (numel={self.numel}, "
                              f"{self.dtype}) has inf or NaN entries")

    def bad_payload(self, what: str) -> ValueError:
        return ValueError(f"{type(self).__name__} payload for numel={self.numel}, "
                          f"dtype={self.dtype} is invalid: {what}")

    def check_size(self, payload: np.ndarray, expected: int) -> None:
        if payload.size != expected:
            raise self.bad_payload(f"{payload.size} bytes, expected exactly {expected}")


# Optional abilities. A compressor has one by implementing its methods (a registered
# class too, without naming the protocol); the worker and the decorators ask
# ``isinstance(chain, Protocol)`` and never a compressor's name.

@runtime_checkable
class MultiRound(Protocol):
    """Several pushes per step, each summed by the servers before the next (PowerSGD:
    its factors P, then Q).

    Called as ``compress(x)`` (round 0), ``compress_round(r, sum of round r - 1)`` for
    r = 1 .. rounds - 1, then ``decompress(sum of the last round, out)``. Every round's
    payload is a float32 vector of ``round_numel(r)`` elements that the servers sum as
    it is; the engine cuts a round larger than a key may be into pieces. Such a
    compressor keeps its own error (``build`` adds no ErrorFeedback around it) and gets
    the number of worker nodes from ``set_workers`` (its error is its share of the sum).

        >>> from bps.compressors.powersgd import PowerSGD
        >>> c = PowerSGD(numel=6, shape=(3, 2), rank=1)
        >>> isinstance(c, MultiRound), c.rounds, [c.round_numel(r) for r in range(2)]
        (True, 2, [3, 2])
    """

    rounds: int

    def set_workers(self, count: int) -> None: ...

    def round_numel(self, round_: int) -> int: ...

    def compress_round(self, round_: int, aggregate: Payload) -> torch.Tensor: ...


@runtime_checkable
class FastErrorUpdate(Protocol):
    """Error feedback's update without decoding: ``fast_update_error(corrected, payload)``
    subtracts ``decompress(payload)`` from ``corrected`` in place (sign and sparse
    compressors touch what their payload names).

        >>> import torch
        >>> from bps.compressors.topk import TopK
        >>> c, corrected = TopK(numel=3, k=1), torch.tensor([0.0, -2.0, 1.0])
        >>> isinstance(c, FastErrorUpdate)
        True
        >>> c.fast_update_error(corrected, c.compress(corrected))
        tensor([0., 0., 1.])
    """

    def fast_update_error(self, corrected: torch.Tensor, payload: Payload) -> torch.Tensor: ...


@runtime_checkable
class ResidualCompress(Protocol):
    """Compress and leave the residual in one pass: ``compress_residual(corrected)``
    returns the payload with ``corrected - decompress(payload)`` written into
    ``corrected`` (dithering, whose quantiser knows each decoded value as it codes it).
    Error feedback prefers it to :class:`FastErrorUpdate`."""

    def compress_residual(self, corrected: torch.Tensor) -> torch.Tensor: ...


@runtime_checkable
class ErrorPassCompress(Protocol):
    """A worker's step of error feedback around this compressor in one call (onebit):
    ``compress_with_error(x, divisor, ratio, error, out)`` (float32/float64 arrays,
    ``divisor`` and ``ratio`` scalars of their dtype) builds ``g' = x / divisor + ratio *
    error`` into ``out`` with the bits of error feedback's own pass (``divisor`` 1: ``x +
    ratio * error``), and returns the payload of ``g'`` with ``out`` holding ``g' -
    D(payload)``, the new error; or None where a value of ``g'`` is not finite."""

    def compress_with_error(self, x: np.ndarray, divisor: np.floating, ratio: np.floating,
                            error: np.ndarray, out: np.ndarray) -> torch.Tensor | None: ...


@runtime_checkable
class PayloadSum(Protocol):
    """A server's step of error feedback around this compressor with the sum of the
    pushes built in its pass, the pushes never decoded on their own (onebit, bytegrad):
    ``check_payload(payload)`` raises ValueError for a payload ``decompress`` refuses, and
    ``compress_sum_residual(payloads, ratio, error, out)`` (float32/float64 arrays) builds
    ``g' = (D(p_0) + D(p_1) + ...) + ratio * error`` with the bits of decoding, adding in
    order and error feedback's pass, and returns the payload of ``g'`` with ``out`` holding
    ``g' - D(payload)``, the new error; or None where a value of ``g'`` is not finite."""

    def check_payload(self, payload: Payload) -> None: ...

    def compress_sum_residual(self, payloads: list[Payload], ratio: float,
                              error: np.ndarray, out: np.ndarray) -> torch.Tensor | None: ...


@runtime_checkable
class CorrectedCompress(Protocol):
    """A chain that builds its input ``g' = g + ratio * e`` itself, in a pass the
    decorator before it writes (error feedback, for Nesterov momentum's fused pass):
    ``compress_corrected(build)`` with ``build(error, ratio, out) -> all finite``."""

    def compress_corrected(self, build: Callable[[np.ndarray, float, np.ndarray], bool]
                           ) -> torch.Tensor: ...


@runtime_checkable
class WholeTensor(Protocol):
    """A compressor that takes a parameter whole, in a shape of its own, not cut into
    partitions (PowerSGD: its factors need every row of the matrix). Its keys carry the
    shape as ``params["shape"]``; during ``warmup_steps`` the parameter travels raw, in
    partitions like any raw tensor. Tensors of one shape may travel together as one
    batch (``batches``). Asked of the class, by the planner.

        >>> from bps.compressors.powersgd import PowerSGD
        >>> issubclass(PowerSGD, WholeTensor)
        True
        >>> PowerSGD.tensor_shape((64, 3, 3, 3), {"rank": 1, "min_compression_rate": 2.0})
        [64, 27]
    """

    @classmethod
    def tensor_shape(cls, shape: tuple[int, ...] | None, params: dict) -> list[int] | None:
        """The shape a parameter of ``shape`` is compressed in; None: it travels raw."""
        ...

    @classmethod
    def batches(cls, params: dict) -> bool:
        """Whether tensors of one shape travel together, as one key of shape (b, *shape)."""
        ...


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
