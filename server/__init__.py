"""The scheduler and the parameter server (``python -m bps.server`` runs the role of
``DMLC_ROLE``, like ``bpslaunch``)."""

from bps.server.scheduler import run_scheduler
from bps.server.server import run_server

__all__ = ["run_scheduler", "run_server"]
