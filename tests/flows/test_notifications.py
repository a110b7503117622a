"""Someone hears about it: `ppo notify` on a real Prefect server sends a rejected candidate, a
failed run and a crashed run of the flow to a webhook (a receiver on 127.0.0.1 records what it
was sent). The crash of a run whose worker really died is in test_worker_crash.py."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from flows.cli import app
from flows.orchestration import notifications
from flows.orchestration.run_params import set_params
from tests.flows.conftest import git_commit
from tests.flows.servers import (
    BIN,
    WebhookReceiver,
    api,
    command,
    notify,
    run_flow,
    start_server,
    stop,
    wait_for,
)

TOKEN = "Bearer s3cr3t-t0ken"


@pytest.mark.slow
def test_a_rejected_a_failed_and_a_crashed_run_reach_the_webhook(tiny_project, tmp_path):
    """The URL read from a file and the token from the environment, both kept as the block's
    secrets: the server's API shows neither, and every notification carries the token."""
    project = tiny_project
    env, _, server = start_server(tmp_path)
    receiver = WebhookReceiver()
    try:
        notify(env, project, "http://127.0.0.1:9/replaced")
        url_file = tmp_path / "webhook-url"
        url_file.write_text(receiver.url + "\n")
        env = {**env, "PPO_WEBHOOK_TOKEN": TOKEN}
        # again: replaces the block and both automations
        notify(
            env,
            project,
            None,
            f"--webhook-file={url_file}",
            "--header-env=Authorization=PPO_WEBHOOK_TOKEN",
        )
        blocks = json.dumps(api(env, "block_documents/filter", {}))
        assert "webhook_url" in blocks and "s3cr3t" not in blocks and receiver.url not in blocks
        tested = command(env, project, str(BIN / "ppo"), "notify", "--test")
        assert tested.returncode == 0 and "test notification sent" in tested.stderr, tested.stderr
        [message] = receiver.with_subject("test notification")
        assert receiver.headers[-1]["Authorization"] == TOKEN
        receiver.status = 503
        tested = command(env, project, str(BIN / "ppo"), "notify", "--test")
        assert tested.returncode == 1, tested.stderr
        assert "the test notification failed: the receiver answered HTTP 503" in tested.stderr
        receiver.status, receiver.received[:], receiver.headers[:] = 200, [], []
        automations = api(env, "automations/filter", {})
        assert sorted(a["name"] for a in automations) == [
            "retrain-notify-failed",
            "retrain-notify-rejected",
        ]

        # rejected: no candidate gains 10 in score
        set_params(str(project), {"promote.min_improvement": 10.0})
        git_commit(project, "a gate no candidate passes")
        done = run_flow(env, project)
        assert done.returncode == 0 and "decision:   rejected" in done.stdout, done.stdout
        wait_for(lambda: receiver.with_subject("candidate rejected"), 120, "the rejection")
        [message] = receiver.with_subject("candidate rejected")
        assert message["body"].startswith("rejected (score ")
        assert "FAIL: score" in message["body"] and "needs >= +10.0000" in message["body"]
        # a path in the project, not where the project lies on this machine
        assert message["body"].endswith("\nreport: reports/eval/report.md"), message["body"]

        # failed: a malformed prompt file fails the prepare stage, and the run
        with (project / "data" / "raw" / "prompts.jsonl").open("a") as raw:
            raw.write("{not json\n")
        done = run_flow(env, project)
        assert done.returncode != 0
        wait_for(lambda: receiver.with_subject("Failed"), 120, "the failure")
        [message] = receiver.with_subject("Failed")
        assert message["subject"].startswith("retrain: run ")
        assert "ended Failed" in message["body"] and "stage prepare failed" in message["body"]

        # crashed: what the heartbeat automation of automations.yaml does to a run whose worker
        # died (test_worker_crash.py kills one for real)
        flow = api(env, "flows/name/retrain")
        run = api(
            env,
            "flow_runs/",
            {"flow_id": flow["id"], "name": "dead-worker", "state": {"type": "RUNNING"}},
        )
        api(
            env,
            f"flow_runs/{run['id']}/set_state",
            {"state": {"type": "CRASHED", "message": "No heartbeat from this run"}, "force": True},
        )
        wait_for(lambda: receiver.with_subject("Crashed"), 120, "the crash")
        [message] = receiver.with_subject("Crashed")
        assert message["subject"] == "retrain: run dead-worker Crashed"
        assert "ended Crashed: No heartbeat from this run" in message["body"]
        assert len(receiver.received) == 3  # one each, nothing for the replaced URL
        assert [h["Authorization"] for h in receiver.headers] == [TOKEN] * 3
    finally:
        receiver.close()
        stop(server)


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("file:///etc/passwd", "is file://, not http:// or https://"),
        ("hooks.example/ppo", "does not start with http:// or https://"),
        ("ftp://hooks.example/ppo", "is ftp://, not http:// or https://"),
        ("https:///ppo", "names no host"),
        ("http://hooks.example:99999/ppo", "has no valid port"),
        ("http://hooks.example/a b", "holds a space or a control character"),
    ],
)
def test_a_webhook_that_is_not_an_http_url_is_refused_before_anything_is_saved(
    monkeypatch, url, reason
):
    """`ppo notify --webhook URL` with a server to save to: a URL the server could never POST
    to is one line with the reason, and nothing reaches the server (neither the command's
    set-up nor the block's save is called); an http(s) URL with a host goes on to both."""
    saved: list[str] = []
    monkeypatch.setattr(notifications, "set_up_notifications", lambda u, h: saved.append(u) or [])
    env = {"PREFECT_API_URL": "http://127.0.0.1:9/api"}  # nothing listens: no save can succeed
    result = CliRunner().invoke(app, ["notify", "--webhook", url], env=env)
    assert result.exit_code == 2, result.output
    [line] = result.output.splitlines()
    assert line.startswith(f"error: the webhook URL {url!r} {reason}"), line
    assert line.endswith("nothing was saved") and saved == [], line
    monkeypatch.undo()
    monkeypatch.setattr(
        notifications.CustomWebhookNotificationBlock,
        "save",
        lambda *a, **k: pytest.fail(f"{url} was saved"),
    )
    with pytest.raises(ValueError, match=reason):
        notifications.set_up_notifications(url)

    for good in ("http://127.0.0.1:8080/hook", "https://hooks.slack.com/services/T0/B0/x"):
        monkeypatch.setattr(
            notifications, "set_up_notifications", lambda u, h: saved.append(u) or ["made"]
        )
        result = CliRunner().invoke(app, ["notify", "--webhook", good], env=env)
        assert result.exit_code == 0 and saved[-1] == good, result.output


@pytest.mark.parametrize(
    ("args", "reason"),
    [
        (["--webhook", "https://h.example/x", "--webhook-env", "HOOK"], "give the webhook once"),
        ([], "give the webhook: --webhook URL"),
        (["--webhook-env", "PPO_UNSET_VARIABLE"], "PPO_UNSET_VARIABLE is unset or empty"),
        (["--webhook-file", "/nonexistent/url"], "--webhook-file /nonexistent/url: no such file"),
        (["--webhook", "https://h.example/x", "--header-env", "Authorization"], "is not NAME=VAR"),
        (
            ["--webhook", "https://h.example/x", "--header", "A=1", "--header-env", "A=HOME"],
            "the header 'A' is given twice",
        ),
    ],
)
def test_a_webhook_or_header_given_wrong_is_one_line_and_saves_nothing(monkeypatch, args, reason):
    monkeypatch.setattr(
        notifications, "set_up_notifications", lambda *a: pytest.fail("something was saved")
    )
    monkeypatch.delenv("PPO_UNSET_VARIABLE", raising=False)
    env = {"PREFECT_API_URL": "http://127.0.0.1:9/api"}
    result = CliRunner().invoke(app, ["notify", *args], env=env)
    assert result.exit_code == 2, result.output
    [line] = result.output.splitlines()
    assert reason in line and line.endswith("nothing was saved"), line


def test_every_value_of_the_webhook_block_is_a_secret():
    """What the Prefect API returns of a block is everything but its secrets: the URL (a
    Slack-style URL's token is in its path) and header values live there alone."""
    url, token = "https://hooks.slack.com/services/T0/B0/pathsecret", "Bearer t0ken"
    block = notifications.webhook_block(url, {"Authorization": token})
    shown = block.model_dump_json()
    assert "pathsecret" not in shown and "t0ken" not in shown, shown
    sent = block._build_request_args("body", "subject")
    assert sent["url"] == url and sent["headers"] == {"Authorization": token}
