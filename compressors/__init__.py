"""bps.compressors: the Compressor interface, the registry and the built-in compressors.

    >>> import torch
    >>> from bps.compressors import build
    >>> chain = build({"compressor": "onebit", "scaling": True, "ef": "vanilla"}, numel=8)
    >>> chain.set_lr(0.1)
    >>> payload = chain.compress(torch.randn(8))   # 1-D uint8 tensor: the wire bytes
    >>> chain.decompress(payload).shape
    torch.Size([8])
"""

if __name__ != "bps.compressors":  # run from the repository's root as ``compressors``
    # numba caches each kernel beside its file, naming the module it was compiled in;
    # every process that imports bps.compressors would then fail to load those kernels
    raise ImportError(f"import bps.compressors, not {__name__!r} (the folder itself): its "
                      "numba kernels would be cached under a name no other process imports")

from .base import (
    Compressor,
    CorrectedCompress,
    Description,
    ErrorPassCompress,
    FastErrorUpdate,
    MultiRound,
    PayloadSum,
    ResidualCompress,
    WholeTensor,
    payload_tensor,
)
from .error_feedback import ErrorFeedback
from .momentum import Momentum
from .registry import (
    build,
    compressor_class,
    description,
    payload_bound,
    register,
    registered_names,
    supports_device,
    unregister,
    validate_compression_params,
)
from .sparse import resolve_k
from .wire import state_from_wire, state_to_wire

__all__ = [
    "Compressor",
    "CorrectedCompress",
    "Description",
    "ErrorFeedback",
    "ErrorPassCompress",
    "FastErrorUpdate",
    "Momentum",
    "MultiRound",
    "PayloadSum",
    "ResidualCompress",
    "WholeTensor",
    "build",
    "compressor_class",
    "description",
    "payload_bound",
    "payload_tensor",
    "register",
    "registered_names",
    "resolve_k",
    "state_from_wire",
    "state_to_wire",
    "supports_device",
    "unregister",
    "validate_compression_params",
]
