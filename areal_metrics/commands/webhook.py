"""`alerts --webhook URL`: each alert POSTed as JSON with a human `text` (the body Slack's incoming webhooks take).

    {"text": "[critical] non_finite · run grpo-7 · step 120: reward was NaN on rank 0", "alert": {...the event...}}

A POST that fails for a reason that can pass (no connection, a timeout, 408, 429, 5xx) is retried
with exponential backoff; a 4xx that cannot pass (a wrong URL, a refused token) stops the verb
with exit status 1, before the alert's offset is committed. The caller commits an alert's offset
in its consumer group right after the receiver accepted it, so a restart resumes after the last
delivered alert: none is lost, none is posted twice. Each POST carries the header
`Idempotency-Key: <alert_id>` for receivers that deduplicate.
"""

from __future__ import annotations

import hashlib
import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass

from areal_metrics.producers.contract.events import AlertEvent
from areal_metrics.producers.runtime.backoff import Backoff

from areal_metrics.commands.arguments import check_http_url
from areal_metrics.errors import ServiceUnavailable

RETRY = Backoff(initial_s=0.5, factor=2.0, max_s=60.0)
RETRIED_STATUS = frozenset({408, 425, 429}) | frozenset(range(500, 600))


def check_url(url: str) -> str:
    """An http(s) URL with a host, else UserError (exit 2)."""
    return check_http_url("--webhook", url, "an http:// or https:// URL")


def group_for(url: str) -> str:
    """The durable consumer group of a webhook when --group is not given: one per URL, the URL not in its name."""
    return f"areal-alerts-webhook-{hashlib.sha256(url.encode()).hexdigest()[:12]}"


def text(alert: AlertEvent) -> str:
    """One line a person reads in a chat channel."""
    where = [f"run {alert.run_id}"] + ([f"step {alert.step}"] if alert.step is not None else [])
    if alert.node:
        where.append(f"node {alert.node}")
    return f"[{alert.severity}] {alert.kind} · {' · '.join(where)}: {alert.message}"


def body(alert: AlertEvent) -> bytes:
    return json.dumps({"text": text(alert), "alert": alert.to_dict()}, ensure_ascii=False).encode()


@dataclass
class Poster:
    """POSTs alerts to one URL, retrying what can pass; `sleep` and `clock` are the test's to replace."""

    url: str
    timeout_s: float = 10.0
    sleep: Callable[[float], None] = time.sleep
    clock: Callable[[], float] = time.monotonic

    def post(self, alert: AlertEvent, deadline: float | None = None) -> int:
        """Deliver one alert; the number of tries it took. ServiceUnavailable past `deadline` or on a final 4xx."""
        data = body(alert)
        tries = 0
        while True:
            tries += 1
            outcome = self._try(data, alert.alert_id)
            if outcome is None:
                return tries
            status, reason = outcome
            if status is not None and status not in RETRIED_STATUS:
                raise ServiceUnavailable(f"the webhook refused alert {alert.alert_id}: HTTP {status} {reason}; "
                                         "not delivered (check the URL); a restart resumes with this alert")
            wait = RETRY.delay(tries)
            if deadline is not None and self.clock() + wait > deadline:
                raise ServiceUnavailable(f"the webhook did not accept alert {alert.alert_id} after {tries} tries "
                                         f"({reason}); a restart resumes with this alert")
            self.sleep(wait)

    def _try(self, data: bytes, key: str) -> tuple[int | None, str] | None:
        """None when accepted (2xx); else (HTTP status or None for no answer, reason)."""
        request = urllib.request.Request(self.url, data=data, method="POST", headers={
            "Content-Type": "application/json; charset=utf-8", "Idempotency-Key": key,
            "User-Agent": "areal-metrics-alerts"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                response.read()
                return None
        except urllib.error.HTTPError as exc:
            return exc.code, str(exc.reason)[:200]
        except (urllib.error.URLError, OSError) as exc:
            return None, " ".join(str(getattr(exc, "reason", exc)).split())[:200]
