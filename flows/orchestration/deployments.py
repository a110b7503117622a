"""The deployments of the flow ``retrain``, as ``prefect.yaml`` declares them, served without a
work pool by ``python -m flows.pipeline serve``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import yaml
from prefect import serve
from prefect.client.schemas.objects import ConcurrencyLimitConfig
from prefect.events import DeploymentEventTrigger
from prefect.schedules import Cron

from flows.orchestration.project import PROJECT_ENV, load_params

if TYPE_CHECKING:
    from prefect import Flow
    from prefect.deployments.runner import RunnerDeployment


def serve_deployments(flow: Flow[..., Any], repo_dir: str = ".") -> None:
    """Serve the deployments of ``flow`` that ``prefect.yaml`` declares (:func:`deployments`)
    for the project in ``repo_dir``, without a work pool."""
    # The runs that `serve` starts inherit this process's environment: this pins their project.
    os.environ[PROJECT_ENV] = str(Path(repo_dir).resolve())
    # One run at a time across all of them: a schedule firing during a manual run waits instead
    # of racing it for the same workspace.
    serve(*deployments(flow, repo_dir), limit=1)


# The deployments' definitions, also read by `prefect deploy --all`.
DEPLOYMENTS_FILE = Path(__file__).resolve().parents[2] / "prefect.yaml"


def deployments(flow: Flow[..., Any], repo_dir: str = ".") -> list[RunnerDeployment]:
    """The deployments of ``flow`` (``retrain``, :mod:`flows.pipeline`, which passes itself)
    that the project's ``prefect.yaml`` (else this code's) declares ('retrain/manual',
    'retrain/scheduled', 'retrain/on-new-data', 'retrain/on-new-feedback'), for `serve`: the
    same names, descriptions, parameters, triggers and concurrency limits, and the schedule from
    the project's ``schedule.cron`` and ``schedule.timezone`` (which the file's build steps read
    for `prefect deploy`).

    None takes the project folder as a parameter (:data:`PROJECT_ENV` pins it); Prefect checks
    each run's parameters against the flow's signature, so a run that names another folder, or
    a parameter the flow does not take, is refused before it starts.
    """
    when = load_params(repo_dir).schedule
    own = Path(repo_dir) / "prefect.yaml"
    declared = yaml.safe_load((own if own.is_file() else DEPLOYMENTS_FILE).read_text())
    served = []
    for spec in declared["deployments"]:
        limit = spec.get("concurrency_limit")
        served.append(
            flow.to_deployment(
                name=spec["name"],
                description=spec.get("description"),
                parameters=spec.get("parameters") or {},
                schedules=(
                    [Cron(when.cron, timezone=when.timezone)] if spec.get("schedules") else None
                ),
                triggers=[DeploymentEventTrigger(**t) for t in spec.get("triggers") or []],
                concurrency_limit=None if limit is None else ConcurrencyLimitConfig(**limit),
                enforce_parameter_schema=spec.get("enforce_parameter_schema", True),
            )
        )
    # to_deployment returns a coroutine only when it is called from async code.
    return cast("list[RunnerDeployment]", served)
