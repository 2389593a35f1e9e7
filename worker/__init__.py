"""Worker side: partitioning and placement, the push/pull engine, intra-node reduction."""

if __name__ != "bps.worker":  # run from the repository's root as ``worker``: see bps.compressors
    raise ImportError(f"import bps.worker, not {__name__!r} (the folder itself): its numba "
                      "kernels would be cached under a name no other process imports")
