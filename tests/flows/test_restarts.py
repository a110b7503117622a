"""Restarts after crashes are bounded (flows/orchestration/restarts.py), on a real local Prefect server."""

from __future__ import annotations

import pytest
import yaml

from flows.orchestration.local_server import LocalServer
from tests.flows.conftest import ROOT
from tests.flows.servers import migrated_home


@pytest.fixture(scope="module")
def prefect_api(tmp_path_factory):
    import os

    from prefect.settings import temporary_settings

    home = migrated_home(tmp_path_factory.mktemp("prefect-home"))  # no migration to wait for
    before = os.environ.get("PREFECT_HOME")
    os.environ["PREFECT_HOME"] = str(home)  # the server's database, not the user's
    server = LocalServer()
    try:
        server.wait_until_up()
        with temporary_settings(updates=server.settings()):
            yield
    finally:
        server.stop()
        if before is None:
            del os.environ["PREFECT_HOME"]
        else:
            os.environ["PREFECT_HOME"] = before


def deployment_with_runs(name: str, states: list[str]) -> str:
    """A deployment ``retrain/NAME`` with one finished run in each state, oldest first."""
    from prefect import get_client
    from prefect.states import State, StateType

    with get_client(sync_client=True) as client:
        flow_id = client.create_flow_from_name("retrain")
        deployment_id = client.create_deployment(flow_id=flow_id, name=name)
        for state in states:
            run = client.create_flow_run_from_deployment(deployment_id)
            client.set_flow_run_state(run.id, State(type=StateType.RUNNING), force=True)
            client.set_flow_run_state(run.id, State(type=StateType[state]), force=True)
        # A run in progress (this restart itself) is not counted.
        run = client.create_flow_run_from_deployment(deployment_id)
        client.set_flow_run_state(run.id, State(type=StateType.RUNNING), force=True)
    return str(deployment_id)


def test_crashes_are_counted_from_the_latest_back(prefect_api):
    from flows.orchestration.restarts import crashes_in_a_row

    deployment = deployment_with_runs("counted", ["CRASHED", "COMPLETED", "CRASHED", "CRASHED"])
    assert crashes_in_a_row(deployment, 3) == 2
    assert crashes_in_a_row(deployment, 1) == 1
    assert crashes_in_a_row(deployment_with_runs("none", ["COMPLETED"]), 3) == 0


def test_a_restart_after_too_many_crashes_stops_and_says_what_to_do(prefect_api):
    from flows.orchestration.restarts import CrashLoop, check_restart

    deployment = deployment_with_runs("looping", ["FAILED", "CRASHED", "CRASHED", "CRASHED"])
    with pytest.raises(CrashLoop, match=r"the last 3 runs of retrain/looping crashed") as stop:
        check_restart(3, deployment, "looping")
    assert "prefect deployment run retrain/looping" in str(stop.value)
    check_restart(4, deployment, "looping")  # one of the last four did not crash
    check_restart(0, deployment, "looping")  # not a restart
    check_restart(3, None, "looping")  # not a deployment run


def test_every_crash_trigger_passes_a_restart_limit():
    spec = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    for deployment in spec["deployments"]:
        resumes = [t for t in deployment["triggers"] if t["expect"] == ["prefect.flow-run.Crashed"]]
        assert len(resumes) == 1, deployment["name"]
        assert resumes[0]["parameters"]["restart_limit"] >= 1, deployment["name"]
