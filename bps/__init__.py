"""bps: parameter-server gradient compression for PyTorch data-parallel training."""
