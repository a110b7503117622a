"""The Prefect side of the pipeline: the flow's server, deployments, DVC session, records,
restarts, notifications and the run's outcome. The stages and the ``ppo`` command are in
:mod:`flows`."""
