"""A training job's output, read from CloudWatch Logs.

SageMaker writes each instance's output to group ``/aws/sagemaker/TrainingJobs``, one stream
``<job>/algo-<n>-<timestamp>`` per instance.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from tunepod import world
from tunepod.launch.sagemaker.clients import error_code

LOG_GROUP = "/aws/sagemaker/TrainingJobs"


def log_hint(job_id: str) -> str:
    """Where a training job's output is: CloudWatch Logs, one stream per instance."""
    return f"CloudWatch Logs group {LOG_GROUP}, streams {job_id}/algo-<n>-<timestamp>"


class CloudWatchLogReader:
    """The tail of a training job's output, read from CloudWatch Logs.

    ``make_client`` builds the boto3 ``logs`` client on first use (a launcher whose jobs never fail
    never needs one). Reading never raises: logs are what an error message shows, so a missing stream
    or permission becomes a line saying so. Thread safety: safe from several threads.
    """

    def __init__(self, make_client: Callable[[], Any]) -> None:
        self._make_client = make_client
        self._client: Any | None = None
        self._lock = world.lock()

    def tail(self, job_id: str, lines: int) -> list[str]:
        """The last ``lines`` lines of every instance's stream (algo-1 first), or why there are none."""
        try:
            client = self._client_once()
            streams = _log_streams(client, job_id)
            if not streams:
                return [f"(no CloudWatch log streams for {job_id} yet: its instances have not started)"]
            tails = [(stream, _stream_tail(client, stream, lines)) for stream in streams]
        except Exception as exc:
            return [f"(cannot read CloudWatch Logs for {job_id}: {_error_text(exc)})"]
        if len(tails) == 1:
            return tails[0][1]
        return [line for stream, text in tails for line in (f"==> {stream} <==", *text)]

    def _client_once(self) -> Any:
        with self._lock:
            if self._client is None:
                self._client = self._make_client()
            return self._client


def _log_streams(client: Any, job_id: str) -> list[str]:
    """The job's stream names, ``algo-1`` first (a prefix search: ``<job>/`` matches no other job)."""
    names: list[str] = []
    request: dict[str, Any] = {"logGroupName": LOG_GROUP, "logStreamNamePrefix": f"{job_id}/"}
    while True:
        response = client.describe_log_streams(**request)
        names += [str(stream["logStreamName"]) for stream in response.get("logStreams", [])]
        if not response.get("nextToken"):
            break
        request["nextToken"] = response["nextToken"]
    return sorted(names, key=_instance_order)


def _instance_order(stream: str) -> tuple[int, str]:
    match = re.search(r"/algo-(\d+)", stream)
    return (int(match.group(1)) if match else 0, stream)


def _stream_tail(client: Any, stream: str, lines: int) -> list[str]:
    # startFromHead=False: the newest ``limit`` events, in order; an event is usually one line.
    response = client.get_log_events(
        logGroupName=LOG_GROUP, logStreamName=stream, startFromHead=False, limit=min(lines, 10_000)
    )
    text = [line for event in response.get("events", []) for line in str(event["message"]).splitlines()]
    return text[-lines:]


def _error_text(exc: BaseException) -> str:
    code = error_code(exc)
    if code == "ResourceNotFoundException":
        return f"{LOG_GROUP} does not exist yet in this account and region"
    if code == "AccessDeniedException":
        return "access denied; fix: allow logs:DescribeLogStreams and logs:GetLogEvents on it"
    return f"{type(exc).__name__}: {exc}"
