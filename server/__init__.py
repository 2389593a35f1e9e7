"""The scheduler and the parameter server (``python -m bps.server`` runs the role of
``DMLC_ROLE``, like ``bpslaunch``): ``bps.server.scheduler.run_scheduler(env)``,
``bps.server.server.run_server(env)``."""
