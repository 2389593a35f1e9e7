"""The compressors by name: compression_params checked and turned into chains.

A compressor's knowledge lives in its class: its keys (``keys``, :meth:`check_params`),
its constructor's options (:meth:`options`), its payload bound and its abilities
(``compressors/base.py``). This module only names the classes: a built-in is one line
of ``_BUILTIN``, a user compressor one :func:`register` call.

Example::

    >>> import torch
    >>> from bps.compressors import build
    >>> params = {"compressor": "topk", "k": 0.5, "ef": "vanilla",
    ...           "momentum": "nesterov", "mu": 0.9}
    >>> worker = build(params, numel=4)                 # Momentum(ErrorFeedback(TopK))
    >>> server = build(params, numel=4, role="server")  # ErrorFeedback(TopK)
    >>> worker.set_lr(0.1)
    >>> aggregate = server.decompress(worker.compress(torch.ones(4)))
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from bps.common.config import SHARED_DEFAULTS, Key, check_shared, refuse_unused

from .base import Compressor, Description, MultiRound, check_dtype
from .bytegrad import ByteGrad
from .bytegrad_torch import ByteGradTorch
from .device import forced_by_env, resolve_device
from .dithering import Dithering
from .dithering_torch import DitheringTorch
from .error_feedback import ErrorFeedback
from .momentum import Momentum
from .onebit import OneBit
from .onebit_torch import OneBitTorch
from .powersgd import PowerSGD
from .powersgd_torch import PowerSGDTorch
from .randomk import RandomK
from .randomk_torch import RandomKTorch
from .terngrad import TernGrad, TernGradTorch
from .topk import TopK
from .topk_torch import TopKTorch

Factory = Callable[[dict, int, torch.dtype], Compressor]


@dataclass(frozen=True)
class _Entry:
    """A registered compressor: its class (what it reads of compression_params) or a
    plain factory (given every key), and its twin with torch kernels, if any."""

    cls: type[Compressor] | None
    factory: Factory | None
    device: type[Compressor] | None = None

    def make(self, params: dict, numel: int, dtype: torch.dtype) -> Compressor:
        if self.cls is None:
            return self.factory(params, numel, dtype)
        return self.cls(numel, dtype, **self.cls.options(params, numel))


# name, class, its twin with torch kernels (the device path); the registration of each
# built-in compressor
_BUILTIN: tuple[tuple[str, type[Compressor], type[Compressor] | None], ...] = (
    ("onebit", OneBit, OneBitTorch),
    ("topk", TopK, TopKTorch),
    ("randomk", RandomK, RandomKTorch),
    ("dithering", Dithering, DitheringTorch),
    ("bytegrad", ByteGrad, ByteGradTorch),
    ("powersgd", PowerSGD, PowerSGDTorch),
    ("terngrad", TernGrad, TernGradTorch),
)
_ENTRIES: dict[str, _Entry] = {name: _Entry(cls, None, twin) for name, cls, twin in _BUILTIN}
BUILTIN = tuple(_ENTRIES)


def registered_names() -> tuple[str, ...]:
    """The names ``compression_params["compressor"]`` may take, built-in ones first."""
    return tuple(_ENTRIES)


def description(name: str) -> Description:
    """What generic code needs of compressor ``name`` (``Compressor.description``): the
    conformance tests, the warm-up, the benches and the examples ask it. Raises
    ValueError for an unknown name, or one registered without a description (a factory,
    or a class that states none).

        >>> description("topk").defaults
        {'k': 0.01}
    """
    entry = _ENTRIES.get(name)
    if entry is None:
        raise ValueError(f"unknown compressor {name!r}: registered are "
                         f"{', '.join(registered_names())}")
    found = None if entry.cls is None else entry.cls.description
    if not isinstance(found, Description):
        what = "a factory" if entry.cls is None else f"class {entry.cls.__name__}"
        raise ValueError(f"compressor {name!r} ({what}) has no description: its class sets "
                         "description = Description(examples=...) (compressors/base.py), "
                         "which the conformance tests, warm-up, benches and examples need")
    return found


def _owners() -> dict[str, list[tuple[str, Key]]]:
    """Each compressor key and the registered compressors that declare it, in order."""
    owners: dict[str, list[tuple[str, Key]]] = {}
    for name, entry in _ENTRIES.items():
        if entry.cls is not None:
            for key, spec in entry.cls.keys.items():
                owners.setdefault(key, []).append((name, spec))
    return owners


def _check_keys(name: str, cls: type[Compressor]) -> None:
    """Refuse a class whose keys clash with the shared ones, or whose defaults differ
    from another compressor's for the same key (a default is accepted everywhere)."""
    owners = _owners()
    for key, spec in cls.keys.items():
        if key in SHARED_DEFAULTS:
            raise ValueError(f"compressor {name!r}: key {key!r} is shared by every "
                             "configuration (bps.common.config); choose another name")
        for other, theirs in owners.get(key, []):
            if theirs.default != spec.default:
                raise ValueError(f"compressor {name!r}: key {key!r} defaults to "
                                 f"{spec.default!r}, compressor {other!r}'s to "
                                 f"{theirs.default!r}; one key has one default")


def register(name: str, compressor: type[Compressor] | Factory,
             device: type[Compressor] | None = None) -> None:
    """Add a compressor under ``name``.

    ``compressor``: a :class:`Compressor` subclass, which states what it reads (its
    ``keys`` table, :meth:`~Compressor.check_params`, :meth:`~Compressor.options`), or a
    plain ``factory(params, numel, dtype) -> Compressor``, given every key. ``device``:
    its twin with torch kernels (built with ``device=`` and the same options), which
    puts its chains on the gradient's device.

        >>> from bps.compressors.onebit import OneBit
        >>> register("signs", lambda params, numel, dtype: OneBit(numel, dtype))
        >>> unregister("signs")
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"compressor name must be a non-empty str, got {name!r}")
    if name in _ENTRIES:
        raise ValueError(f"compressor {name!r} is already registered")
    if isinstance(compressor, type) and issubclass(compressor, Compressor):
        _check_keys(name, compressor)
        entry = _Entry(compressor, None, device)
    elif callable(compressor):
        if device is not None:
            raise TypeError(f"compressor {name!r}: a device twin needs a Compressor class, "
                            "not a factory")
        entry = _Entry(None, compressor)
    else:
        raise TypeError(f"compressor {name!r} must be a Compressor class or a callable "
                        f"factory, got {compressor!r}")
    _ENTRIES[name] = entry


def unregister(name: str) -> None:
    """Remove a user compressor (built-in ones stay)."""
    if name in BUILTIN:
        raise ValueError(f"built-in compressor {name!r} cannot be removed")
    _ENTRIES.pop(name, None)


def compressor_class(params: dict) -> type[Compressor] | None:
    """The class of validated ``params``'s compressor; None without one, or for a
    factory (its class is known once it built one). The planner asks it for
    abilities declared on the class (``WholeTensor``)."""
    entry = _ENTRIES.get(params["compressor"])
    return None if entry is None else entry.cls


def validate_compression_params(params: dict | None) -> dict:
    """Check a ``compression_params`` dict (docs/compression.md) and return a new, complete one.

    The shared keys are checked by ``bps.common.config``, the others by the rules that
    the compressor classes declare: every key present in the result; absent keys get
    their defaults (``mu``/``seed`` stay ``None`` for the trainer to fill,
    ``min_compress_bytes`` comes from ``BYTEPS_MIN_COMPRESS_BYTES``, else 65536). A key
    given with a value other than its default where the configuration does not use it
    is refused, naming the compressors that do (a registered factory is given every
    key).

        >>> p = validate_compression_params({"compressor": "topk", "k": 0.01, "ef": "vanilla"})
        >>> p["k"], p["partition"], p["mu"]
        (0.01, 'linear', None)
        >>> validate_compression_params({"compressor": "onebit"})["scaling"]
        True

    Raises:
        TypeError: a value of the wrong type (a bool is not an int, ``"3"`` is not a number).
        ValueError: an unknown key, a missing required key, a value out of range, a key
        that does not apply. Each names the key, the value and what is accepted.
    """
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise TypeError(f"compression_params must be a dict or None, got {type(params).__name__}")
    owners = _owners()
    unknown = sorted(str(key) for key in params
                     if key not in SHARED_DEFAULTS and key not in owners)
    if unknown:
        raise ValueError(
            f"compression_params has unknown key(s) {', '.join(map(repr, unknown))}: "
            f"accepted keys are {', '.join([*SHARED_DEFAULTS, *owners])}")
    out = {**SHARED_DEFAULTS, **{key: specs[0][1].default for key, specs in owners.items()}}
    out.update(params)
    check_shared(out, params, registered_names())
    name = out["compressor"]
    entry = _ENTRIES.get(name)
    cls = None if entry is None else entry.cls
    mine = {} if cls is None else cls.keys
    for key, specs in owners.items():
        spec = mine.get(key, specs[0][1])  # another's key: checked by its first owner's rule
        out[key] = spec.checked(key, out[key])
    for key, spec in mine.items():
        if spec.is_default(out[key]):
            if spec.required is not None:
                raise ValueError(f"compression_params[{key!r}] is required for compressor "
                                 f"{name!r}: expected {spec.required}")
            if spec.fill is not None:
                out[key] = spec.fill
    if cls is not None:
        cls.check_params(out)
    if entry is None or entry.cls is not None:
        for key, specs in owners.items():
            if key in params and key not in mine and not specs[0][1].is_default(params[key]):
                raise refuse_unused(key, params[key], name, tuple(n for n, _ in specs))
    return out


def payload_bound(params: dict, numel: int, dtype: torch.dtype = torch.float32) -> int | None:
    """Most bytes the payload of ``params``'s compressor can take for ``numel`` elements,
    as its class states it (:meth:`Compressor.max_payload_bytes`); ``None`` for a
    registered factory. ``params`` is a validated compression_params dict.

        >>> payload_bound(validate_compression_params({"compressor": "onebit"}), 64)
        12
    """
    cls = compressor_class(params)
    if cls is None:
        return None
    return cls.max_payload_bytes(numel, dtype, **cls.options(params, numel))


def supports_device(params: dict | None) -> bool:
    """Whether ``params``'s worker chain can run on a device with torch kernels (its
    compressor was registered with a ``device`` twin); ask before ``build(...,
    device=)`` and keep the host chain where it cannot.

        >>> supports_device({"compressor": "topk", "k": 0.01})   # registered ones: False
        True
    """
    params = validate_compression_params(params)
    entry = _ENTRIES.get(params["compressor"])
    return entry is not None and entry.device is not None


def build(params: dict | None, numel: int, dtype: torch.dtype = torch.float32,
          role: str = "worker", device: torch.device | str | None = None) -> Compressor:
    """The compressor chain for one partition.

    Workers get ``Momentum(ErrorFeedback(C))``, servers ``ErrorFeedback(C)``, each
    decorator only where configured (a :class:`~bps.compressors.base.MultiRound`
    compressor keeps its own error: bare). ``params`` is validated here; it must name a
    ``compressor``, and ``mu`` must be set when ``momentum`` is (the trainer fills it
    from the optimizer). A missing ``seed`` means DEFAULT_SEED (1).

    ``device`` (default cpu) is where the chain's buffers live. A worker chain for a
    device other than the CPU runs torch kernels there (compressors/device.py), as it
    does on the CPU with ``BPS_DEVICE_KERNELS=1``; a compressor without them
    (``supports_device`` False) raises TypeError for a device, and keeps its host
    kernels under the switch. Server chains are host chains.
    """
    device = resolve_device(device)
    if role == "worker" and device.type != "cpu" and not supports_device(params):
        raise TypeError(f"compressor {(params or {}).get('compressor')!r} has no torch "
                        f"kernels: its chain cannot run on {device} (ask supports_device "
                        "first and keep the host chain)")
    if role == "server" and device.type != "cpu":
        raise ValueError(f"server chains run on the CPU, got device {device}")
    torch_kernels = role == "worker" and (device.type != "cpu" or forced_by_env())
    params = validate_compression_params(params)
    if role not in ("worker", "server"):
        raise ValueError(f"role must be 'worker' or 'server', got {role!r}")
    if params["compressor"] is None:
        raise ValueError("compression_params has no 'compressor': nothing to build "
                         f"(accepted: {', '.join(registered_names())})")
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 1:
        raise ValueError(f"numel must be an int >= 1, got {numel!r}")
    check_dtype(dtype)
    if role == "worker" and params["momentum"] is not None and params["mu"] is None:
        raise ValueError("compression_params['mu'] is None but momentum 'nesterov' is set: "
                         "pass mu (a float in [0, 1), usually the optimizer's momentum)")
    entry = _ENTRIES[params["compressor"]]
    if torch_kernels and entry.device is not None:
        chain = entry.device(numel, dtype, device=device, **entry.cls.options(params, numel))
    else:
        chain = entry.make(params, numel, dtype)
    if not isinstance(chain, Compressor):
        raise TypeError(f"factory of {params['compressor']!r} returned "
                        f"{type(chain).__name__}, expected a Compressor")
    if isinstance(chain, MultiRound):  # several rounds: the compressor's own error
        return chain
    return _decorated(chain, params, role)


def _decorated(chain: Compressor, params: dict, role: str) -> Compressor:
    """``chain`` inside error feedback and (workers) momentum, where configured."""
    if params["ef"] == "vanilla":
        chain = ErrorFeedback(chain)
    if role == "worker" and params["momentum"] == "nesterov":
        chain = Momentum(chain, params["mu"])
    return chain
