"""The signed-webhook receiver: a verified delivery becomes a Prefect event that starts a pipeline run.

    config = load_webhook_config("deployments/webhooks.yaml")
    app = create_app(config, in_process(api_url), Path(".tunepod/webhook"))  # publisher_process.in_process

Modules: ``signatures`` (sign and verify, GitHub's dedupe key and push age, pure), ``config`` (hooks,
secrets, payload -> overrides), ``dedupe`` (delivery id -> event id, SQLite), ``specs`` (overrides
checked against the hook's spec, recent verdicts kept), ``sendable`` (what Prefect can take of an
event), ``events`` (``EventSink``, Prefect REST), ``publisher`` (the log's events to a sink, a thread),
``publisher_process`` (the same in a process of its own), ``allowlist`` (the S3 objects a hook's
deliveries may name, pure), ``app`` (FastAPI), ``cli`` (``tunepod webhook serve|sign``).

Names are loaded on first use: importing ``tunepod.webhook.cli`` must not pull in FastAPI.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tunepod.webhook.app import create_app
    from tunepod.webhook.config import WebhookConfig, WebhookConfigError, load_webhook_config
    from tunepod.webhook.events import EventSink, EventSinkError, PrefectEventSink
    from tunepod.webhook.signatures import SignatureError, verify_github, verify_standard

_HOMES = {
    "create_app": "app",
    "WebhookConfig": "config",
    "WebhookConfigError": "config",
    "load_webhook_config": "config",
    "EventSink": "events",
    "EventSinkError": "events",
    "PrefectEventSink": "events",
    "SignatureError": "signatures",
    "verify_github": "signatures",
    "verify_standard": "signatures",
}

__all__ = [
    "EventSink",
    "EventSinkError",
    "PrefectEventSink",
    "SignatureError",
    "WebhookConfig",
    "WebhookConfigError",
    "create_app",
    "load_webhook_config",
    "verify_github",
    "verify_standard",
]


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
