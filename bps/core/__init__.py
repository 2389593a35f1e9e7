"""The front-end core: what every front end (``DistributedTrainer``, the DDP hook) shares.

``frontend`` (the core object: optimizer binding, pipeline, figures, loss scale,
non-finite errors, checkpoints), ``grad_pipeline`` (per parameter: divide, reduce in the
node, push and pull partitions, broadcast), ``runtime`` (what ``bps.init()`` sets up),
``join`` (uneven inputs), ``loss_scale``, ``trainer_stats`` and ``model_sync``.
"""
