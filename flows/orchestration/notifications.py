"""Someone hears about it: Prefect notifications for a rejected candidate, a failed run and a
crashed run of the flow ``retrain``.

``ppo notify --webhook URL`` saves a Custom Webhook notification block (Prefect's own, portable:
Slack, Teams, Mattermost, Discord, ntfy and most paging services take a JSON POST) and creates
two automations on the server that send through it:

- ``retrain-notify-rejected``: the event ``ppo.candidate.rejected`` that every run that rejects
  a candidate emits (:func:`flows.orchestration.outcome.announce_decision`), with the decision, the failed
  rules and the report's location;
- ``retrain-notify-failed``: a run of ``retrain`` entering ``Failed`` or ``Crashed`` (a crash is
  also what the heartbeat automation of ``automations.yaml`` marks when a worker dies), with the
  run's name, its state and the state's message.

The URL must be ``http://`` or ``https://`` with a host (:func:`check_webhook_url`): anything
else (``file:///etc/passwd``, ``hooks.example/ppo`` without a scheme, ``ftp://...``) is refused
before anything is saved, since the server would save it and then fail to send every
notification without a word to the operator.

Secrets stay secret. The URL (Slack-style URLs carry their token in the path) and every header
value are kept in the block's ``secrets``, which Prefect stores encrypted and its API shows
obfuscated; the block's ``url`` and ``headers`` hold only ``{{placeholders}}`` the sender fills
in. The command reads them from an environment variable or a file as well as from its
arguments, so a token need not be on a command line (``ps``, shell history).
``ppo notify --test`` sends one notification through the saved block and says whether the
receiver answered.

Running it again replaces both automations and the block (a new URL, say), never duplicates them.
The server sends the notifications itself (its triggers and actions services), so they go out
whether the run ended normally, failed, or died with its worker.
"""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any, cast
from urllib.parse import urlsplit
from uuid import UUID

from prefect.automations import Automation
from prefect.blocks.notifications import CustomWebhookNotificationBlock
from prefect.events.actions import SendNotification
from prefect.events.schemas.automations import EventTrigger, Posture
from prefect.types import SecretDict

BLOCK_NAME = "ppo-retrain-notify"
"""The saved webhook block's name (``prefect block ls``)."""

FLOW = {"prefect.resource.role": "flow", "prefect.resource.name": "retrain"}
"""The flow whose runs the automations watch."""

REJECTED_BODY = (
    "{{ event.resource['prefect.resource.name'] }}\n"
    "{% for reason in event.payload.reasons %}{{ reason }}\n{% endfor %}"
    "report: {{ event.payload.report }}"
)
ENDED_BODY = (
    "flow run {{ flow_run.name }} of retrain ended {{ flow_run.state.name }}: "
    "{{ flow_run.state.message }}\n"
    "A failed run changed no production version; a crashed one resumes from its last "
    "checkpoint when its deployment's trigger starts it again."
)

AUTOMATIONS: dict[str, dict[str, Any]] = {
    "retrain-notify-rejected": {
        "description": "Tell someone when the gate rejects a candidate.",
        "events": {"ppo.candidate.rejected"},
        "match": {"prefect.resource.id": "ppo.registry.*"},
        "match_related": {},
        "subject": "retrain: candidate rejected",
        "body": REJECTED_BODY,
    },
    "retrain-notify-failed": {
        "description": "Tell someone when a run of the flow retrain fails or crashes.",
        "events": {"prefect.flow-run.Failed", "prefect.flow-run.Crashed"},
        "match": {"prefect.resource.id": "prefect.flow-run.*"},
        "match_related": FLOW,
        "subject": "retrain: run {{ flow_run.name }} {{ flow_run.state.name }}",
        "body": ENDED_BODY,
    },
}
"""Each automation's trigger (the events that fire it, on which resources) and message (Jinja
templates over the triggering ``event`` and its ``flow_run``)."""


WEBHOOK_SCHEMES = ("http", "https")
"""The schemes a webhook URL may have: the server sends a JSON POST, which only HTTP carries."""


def check_webhook_url(url: str) -> None:
    """Refuse (:class:`ValueError`, one line giving the reason) a webhook URL that is not
    ``http://`` or ``https://`` with a host: no scheme, another scheme (``file``, ``ftp``), no
    host, a port that is not one, or a space or control character anywhere in it."""
    if any(ch.isspace() or ord(ch) < 0x20 or ord(ch) == 0x7F for ch in url):
        raise ValueError(f"the webhook URL {url!r} holds a space or a control character")
    scheme = re.match(r"([A-Za-z][A-Za-z0-9+.-]*)://", url)
    if scheme is None:
        raise ValueError(
            f"the webhook URL {url!r} does not start with http:// or https:// (give it as "
            "https://HOST/...)"
        )
    if scheme[1].lower() not in WEBHOOK_SCHEMES:
        raise ValueError(
            f"the webhook URL {url!r} is {scheme[1]}://, not http:// or https://: the server "
            "sends each notification as an HTTP POST"
        )
    parts = urlsplit(url)
    if not parts.hostname:
        raise ValueError(f"the webhook URL {url!r} names no host")
    try:
        parts.port  # noqa: B018 (parsing it is the check)
    except ValueError as error:
        raise ValueError(f"the webhook URL {url!r} has no valid port: {error}") from None


URL_SECRET = "webhook_url"
"""The name of the URL in the block's ``secrets`` (its ``url`` is ``{{webhook_url}}``)."""


def webhook_block(url: str, headers: dict[str, str] | None = None):
    """The Custom Webhook block for ``url`` and ``headers``, every one of their values in its
    ``secrets`` (header ``i`` as ``header_i``), its ``url`` and ``headers`` placeholders."""
    check_webhook_url(url)
    headers = headers or {}
    secrets = {URL_SECRET: url} | {f"header_{i}": v for i, v in enumerate(headers.values())}
    return CustomWebhookNotificationBlock(
        name="ppo retraining",
        url="{{" + URL_SECRET + "}}",
        json_data={"subject": "{{subject}}", "body": "{{body}}"},
        headers={name: f"{{{{header_{i}}}}}" for i, name in enumerate(headers)} or None,
        cookies=None,
        secrets=SecretDict(secrets),
    )


def send_test() -> None:
    """Send one notification through the saved block, or raise :class:`RuntimeError` naming why
    it was not delivered (no block saved, no answer, an error status). The message names
    neither the URL nor a header: they are secrets."""
    import httpx

    try:
        block = CustomWebhookNotificationBlock.load(BLOCK_NAME)
    except ValueError:
        raise RuntimeError(
            f"no notification block {BLOCK_NAME} on this server: run `ppo notify --webhook ...` "
            "first"
        ) from None
    block = cast(CustomWebhookNotificationBlock, block)
    try:
        block.notify(
            "A test notification from `ppo notify --test`: this receiver gets the rejected "
            "candidates, failed and crashed runs of retrain.",
            "retrain: test notification",
        )
    except httpx.HTTPStatusError as error:
        raise RuntimeError(
            f"the receiver answered HTTP {error.response.status_code} "
            f"{error.response.reason_phrase}"
        ) from None
    except httpx.HTTPError as error:
        raise RuntimeError(f"the receiver did not answer ({type(error).__name__})") from None


def set_up_notifications(url: str, headers: dict[str, str] | None = None) -> list[str]:
    """Save the webhook block for ``url`` (with ``headers``, e.g. a token; all kept as secrets,
    :func:`webhook_block`) as :data:`BLOCK_NAME` and create the automations of
    :data:`AUTOMATIONS` that send through it, replacing earlier ones of the same names; returns
    the names created. A URL :func:`check_webhook_url` refuses is refused before anything is
    saved."""
    block_id = webhook_block(url, headers).save(BLOCK_NAME, overwrite=True)
    created = []
    for name, spec in AUTOMATIONS.items():
        _delete_existing(name)
        Automation(
            name=name,
            description=spec["description"],
            enabled=True,
            trigger=EventTrigger(
                posture=Posture.Reactive,
                expect=spec["events"],
                match=spec["match"],
                match_related=spec["match_related"],
                threshold=1,
                within=timedelta(0),
            ),
            actions=[
                SendNotification(
                    block_document_id=UUID(str(block_id)),
                    subject=spec["subject"],
                    body=spec["body"],
                )
            ],
        ).create()
        created.append(name)
    return created


def _delete_existing(name: str) -> None:
    while True:
        try:
            # read() is Prefect's sync-or-async dispatch: synchronous here, outside an event loop
            cast(Automation, Automation.read(name=name)).delete()
        except ValueError:  # none (left) of that name
            return
