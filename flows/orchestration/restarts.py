"""A bound on restarts after crashes.

Each deployment of ``prefect.yaml`` starts itself again when one of its runs crashes (its
process or machine died; ``automations.yaml`` marks a run whose heartbeats stopped), and the new
run resumes from the last checkpoint. A run that crashes for a reason that stays (the machine
runs out of memory at the same step every time) would start itself for ever; so the trigger
passes ``restart_limit``, and a restart whose deployment's last ``restart_limit`` finished runs
all crashed fails at once instead: a failed run starts nothing, and its message says what to do.
"""

from __future__ import annotations

from uuid import UUID

from prefect import get_client
from prefect.client.schemas.filters import (
    DeploymentFilter,
    DeploymentFilterId,
    FlowRunFilter,
    FlowRunFilterState,
    FlowRunFilterStateType,
)
from prefect.client.schemas.objects import StateType
from prefect.client.schemas.sorting import FlowRunSort

FINAL = [StateType.COMPLETED, StateType.FAILED, StateType.CRASHED, StateType.CANCELLED]


class CrashLoop(RuntimeError):
    """A restart after ``restart_limit`` crashes in a row: the run stops before any stage."""


def crashes_in_a_row(deployment_id: str, limit: int) -> int:
    """How many of the deployment's last ``limit`` finished runs crashed, counted from the
    latest back to the first one that did not."""
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(
            deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[UUID(deployment_id)])),
            flow_run_filter=FlowRunFilter(
                state=FlowRunFilterState(type=FlowRunFilterStateType(any_=FINAL))
            ),
            sort=FlowRunSort.EXPECTED_START_TIME_DESC,
            limit=limit,
        )
    crashed = 0
    for run in runs:
        if run.state_type != StateType.CRASHED:
            break
        crashed += 1
    return crashed


def check_restart(restart_limit: int, deployment_id: str | None, deployment_name: str) -> None:
    """Raise :class:`CrashLoop` when this run restarts a deployment whose last
    ``restart_limit`` runs all crashed; a run without a deployment, or with a limit of 0, is
    not a restart."""
    if restart_limit <= 0 or deployment_id is None:
        return
    crashed = crashes_in_a_row(deployment_id, restart_limit)
    if crashed >= restart_limit:
        raise CrashLoop(
            f"the last {crashed} runs of retrain/{deployment_name} crashed; this restart stops "
            "here instead of crashing again (restart_limit in prefect.yaml). Look at the worker's "
            "log for why they died (memory, a lost machine), then run "
            f"`prefect deployment run retrain/{deployment_name}`: it resumes from the last "
            "checkpoint"
        )
