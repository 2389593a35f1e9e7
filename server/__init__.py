"""The scheduler and the parameter server (``python -m bps.server`` runs the role of
``DMLC_ROLE``): ``bps.server.scheduler.run_scheduler(env)``,
``bps.server.server.run_server(env)``, both through ``bps.server.role.serve(env)``."""
