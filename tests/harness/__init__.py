"""What the tests share; no test module imports another test module, only this package
(and tests/conftest.py's fixtures). Each module is small and imports little at the top,
since several are also the programs that cluster processes run:

- ``paths``: the repository's folders, and loading a script that is no module
  (bench/, examples/).
- ``ps_job``: the worker program of the parameter-server tests (run by its path under
  ``bpslaunch local``), its data and key tables, and ``run_command`` and ``BPSLAUNCH``
  for starting launchers.
- ``roles``: roles started one by one as real processes, read line by line.
- ``cluster_job``: the worker program of the cluster-launch tests.
- ``trainer_job``: the toy job of the front-end tests (a model whose gradient is known
  in closed form): the worker program (``python -m tests.harness.trainer_job``), its
  launcher, and the numpy simulation of the whole pipeline that the tests compare with.
- ``reference_compressors``: independent plain-Python references of the compressors.
- ``samples``: the inputs the compressor tests draw.
- ``key_engine``: a server's key engine with its replies on an inproc socket.
- ``netem_runs``: the lock between test processes that start ``bpslaunch netem`` runs.
"""
