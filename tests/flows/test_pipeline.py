"""The Prefect flow's helpers: params.yaml edits and the deployments it serves."""

from __future__ import annotations

import shutil

import pytest

from flows.orchestration.deployments import deployments
from flows.orchestration.run_params import params_for_this_run, set_params
from flows.pipeline import retrain
from ppo_core.config import ConfigError
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


def test_the_served_deployments_are_those_of_prefect_yaml_with_the_configured_schedule(project):
    set_params(str(project), {"schedule.cron": "30 2 * * *", "schedule.timezone": "Europe/Berlin"})
    manual, scheduled, on_new_data, on_new_feedback = deployments(retrain, str(project))
    everyone = (manual, scheduled, on_new_data, on_new_feedback)
    assert [d.name for d in everyone] == [
        "manual",
        "scheduled",
        "on-new-data",
        "on-new-feedback",
    ]
    assert manual.schedules == [] and on_new_data.schedules == [] == on_new_feedback.schedules
    [entry] = scheduled.schedules
    assert (entry.schedule.cron, entry.schedule.timezone) == ("30 2 * * *", "Europe/Berlin")
    # The project is pinned where the deployments are served, never a run parameter.
    assert manual.parameters == {"backup": True}
    assert scheduled.parameters == {"from_production": True, "backup": True}
    for on_new in (on_new_data, on_new_feedback):
        assert on_new.parameters == {
            "from_production": True,
            "new_data_only": True,
            "backup": True,
        }
    assert sorted(sorted(t.expect) for t in on_new_data.triggers) == [
        ["ppo.data.ingested"],
        ["prefect.flow-run.Crashed"],
    ]
    assert sorted(sorted(t.expect) for t in on_new_feedback.triggers) == [
        ["ppo.feedback.ingested"],
        ["prefect.flow-run.Crashed"],
    ]
    for deployment in everyone:
        # a crashed run of this deployment (and only of this one) starts it again
        [resume] = [t for t in deployment.triggers if "prefect.flow-run.Crashed" in t.expect]
        names = {spec.root["prefect.resource.name"] for spec in resume.match_related}
        assert names == {"retrain", deployment.name}
    for deployment in everyone:
        assert deployment.enforce_parameter_schema
        # one run at a time; a run started meanwhile waits in line
        assert deployment.concurrency_limit == 1
        assert deployment.concurrency_options.collision_strategy == "ENQUEUE"


def test_params_are_built_once_per_text_and_again_when_the_file_changes(project):
    from flows.orchestration.project import load_params

    first = load_params(str(project))
    assert load_params(str(project)) is first  # the same text: not built again
    with params_for_this_run(str(project), {"ppo.epochs": 2}):
        during = load_params(str(project))
        assert during is not first and during.ppo.epochs == 2
    after = load_params(str(project))
    assert after.ppo.epochs == first.ppo.epochs
    (project / "params.yaml").write_text("ppo:\n  epochs: [1\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_params(str(project))  # a broken file is never answered from the cache
