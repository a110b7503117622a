"""The Prefect flow's helpers: params.yaml edits and the deployments it serves."""

from __future__ import annotations

import shutil

import pytest

from flows.pipeline import deployments
from flows.run_params import set_params
from tests.flows.conftest import ROOT


@pytest.fixture
def project(tmp_path):
    shutil.copy2(ROOT / "params.yaml", tmp_path / "params.yaml")
    return tmp_path


def test_set_params_keeps_comments_and_leaves_no_temporary_file(project):
    victim = project / "victim.txt"
    victim.write_text("keep me")
    (project / ".params.yaml.tmp").symlink_to(victim)  # a fixed temporary name would follow it
    set_params(str(project), {"ppo.epochs": 2, "schedule.timezone": "Europe/Berlin"})
    text = (project / "params.yaml").read_text()
    assert text.startswith("# The pipeline's parameters")
    assert "  epochs: 2\n" in text and "  timezone: Europe/Berlin\n" in text
    assert victim.read_text() == "keep me"
    assert sorted(p.name for p in project.iterdir()) == [
        ".params.yaml.tmp",
        "params.yaml",
        "victim.txt",
    ]
    with pytest.raises(KeyError, match="no key 'ppo.epoch'"):
        set_params(str(project), {"ppo.epoch": 3})


def test_the_scheduled_deployment_fires_on_cron_in_the_configured_time_zone(project):
    set_params(str(project), {"schedule.cron": "30 2 * * *", "schedule.timezone": "Europe/Berlin"})
    manual, scheduled = deployments(str(project))
    assert (manual.name, manual.schedules) == ("manual", [])
    [entry] = scheduled.schedules
    assert (entry.schedule.cron, entry.schedule.timezone) == ("30 2 * * *", "Europe/Berlin")
    # The project is pinned where the deployments are served, never a run parameter.
    assert manual.parameters == {}
    assert scheduled.parameters == {"from_production": True}
    assert manual.enforce_parameter_schema and scheduled.enforce_parameter_schema
