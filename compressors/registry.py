"""build() and register(): compression_params -> the compressor chain (docs/compression.md).

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

import torch

from bps.common.config import (
    accept_compressor,
    forget_compressor,
    resolve_k,
    validate_compression_params,
)

from .base import Compressor, check_dtype
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
from .rng import DEFAULT_SEED
from .topk import TopK
from .topk_torch import TopKTorch

Factory = Callable[[dict, int, torch.dtype], Compressor]
Options = Callable[[dict, int], dict]


def _seed(params: dict) -> int:
    return DEFAULT_SEED if params["seed"] is None else params["seed"]


# each built-in class and its constructor options from (params, numel)
_BUILTIN: dict[str, tuple[type[Compressor], Options]] = {
    "onebit": (OneBit, lambda p, n: {"scaling": p["scaling"]}),
    "topk": (TopK, lambda p, n: {"k": resolve_k(p, n)}),
    "randomk": (RandomK, lambda p, n: {"k": resolve_k(p, n), "seed": _seed(p)}),
    "dithering": (Dithering, lambda p, n: {
        "levels": p["k"], "natural": p["partition"] == "natural",
        "l2": p["normalize"] == "l2", "seed": _seed(p)}),
    "bytegrad": (ByteGrad, lambda p, n: {"chunk": p["chunk"]}),
    "powersgd": (PowerSGD, lambda p, n: {
        "shape": p["shape"], "rank": p["rank"], "ef": p["ef"] == "vanilla",
        "warm_start": p["warm_start"], "epsilon": p["orthogonalization_epsilon"],
        "seed": _seed(p)}),
}


# the classes that declare device_kernels and their twins with torch kernels
_TORCH_TWINS: dict[type[Compressor], type[Compressor]] = {
    OneBit: OneBitTorch, TopK: TopKTorch, RandomK: RandomKTorch, ByteGrad: ByteGradTorch,
    PowerSGD: PowerSGDTorch, Dithering: DitheringTorch}


def _builtin_factory(cls: type[Compressor], options: Options) -> Factory:
    return lambda p, n, dt: cls(n, dt, **options(p, n))


_FACTORIES: dict[str, Factory] = {name: _builtin_factory(cls, options)
                                  for name, (cls, options) in _BUILTIN.items()}
BUILTIN = tuple(_FACTORIES)


def registered_names() -> tuple:
    return tuple(_FACTORIES)


def register(name: str, factory: Factory) -> None:
    """Add a compressor under ``name``: ``factory(params, numel, dtype) -> Compressor``.

    ``params`` is the validated compression_params dict; the factory reads what it needs
    (``params["k"]`` is optional for user compressors: an int >= 1 or a float in (0, 1)).
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"compressor name must be a non-empty str, got {name!r}")
    if name in _FACTORIES:
        raise ValueError(f"compressor {name!r} is already registered")
    if not callable(factory):
        raise TypeError(f"factory for {name!r} must be callable, got {factory!r}")
    _FACTORIES[name] = factory
    accept_compressor(name)


def unregister(name: str) -> None:
    """Remove a user compressor (built-in ones stay)."""
    if name in BUILTIN:
        raise ValueError(f"built-in compressor {name!r} cannot be removed")
    _FACTORIES.pop(name, None)
    forget_compressor(name)


def payload_bound(params: dict, numel: int, dtype: torch.dtype = torch.float32) -> int | None:
    """Most bytes the payload of ``params``'s compressor can take for ``numel`` elements,
    as its class states it (:meth:`Compressor.max_payload_bytes`); ``None`` for
    registered compressors. ``params`` is a validated compression_params dict.

        >>> from bps.common.config import validate_compression_params
        >>> payload_bound(validate_compression_params({"compressor": "onebit"}), 64)
        12
    """
    entry = _BUILTIN.get(params["compressor"])
    if entry is None:
        return None
    cls, options = entry
    return cls.max_payload_bytes(numel, dtype, **options(params, numel))


def supports_device(params: dict | None) -> bool:
    """Whether ``params``'s worker chain can run on a device with torch kernels (its
    compressor's class declares ``device_kernels``); ask before ``build(..., device=)``
    and keep the host chain where it cannot.

        >>> supports_device({"compressor": "topk", "k": 0.01})   # registered ones: False
        True
    """
    params = validate_compression_params(params)
    entry = _BUILTIN.get(params["compressor"])
    return entry is not None and entry[0].device_kernels and entry[0] in _TORCH_TWINS


def build(params: dict | None, numel: int, dtype: torch.dtype = torch.float32,
          role: str = "worker", device: torch.device | str | None = None) -> Compressor:
    """The compressor chain for one partition.

    Workers get ``Momentum(ErrorFeedback(C))``, servers ``ErrorFeedback(C)``, each
    decorator only where configured. ``params`` is validated here; it must name a
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
    if torch_kernels and supports_device(params):
        cls, options = _BUILTIN[params["compressor"]]
        chain = _TORCH_TWINS[cls](numel, dtype, device=device, **options(params, numel))
    else:
        chain = _FACTORIES[params["compressor"]](params, numel, dtype)
    if not isinstance(chain, Compressor):
        raise TypeError(f"factory of {params['compressor']!r} returned "
                        f"{type(chain).__name__}, expected a Compressor")
    if getattr(chain, "rounds", 1) > 1:  # several rounds: the compressor's own error
        return chain
    if params["ef"] == "vanilla":
        chain = ErrorFeedback(chain)
    if role == "worker" and params["momentum"] == "nesterov":
        chain = Momentum(chain, params["mu"])
    return chain
