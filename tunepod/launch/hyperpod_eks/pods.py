"""What a job's pods tell after the fact: their logs and their containers' exit codes.

The renderer keeps a job's pods after it ends (``cleanPodPolicy: None``) until its TTL or a cancel
deletes the job, so a failed job's log and exit codes can be read here.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from tunepod.errors import TunepodError
from tunepod.launch.hyperpod_eks.api import KubeApi, ObjectRef


def read_logs(api: KubeApi, ref: ObjectRef, tail: int) -> str:
    """The last ``tail`` lines of each pod's log, rank 0's pod first; a header names each pod when
    there are several. A line saying so when no pod is left."""
    pods = sorted(api.list_pods(ref), key=_rank_order)
    if not pods:
        return f"(no pods of {ref.title} left to read logs from; see {ref.kubectl('describe')})"
    texts = [(pod["metadata"]["name"], _pod_log(api, ref, pod, tail)) for pod in pods]
    if len(texts) == 1:
        return texts[0][1]
    return "\n".join(f"==> pod {name} <==\n{text}" for name, text in texts)


def exit_codes(api: KubeApi, ref: ObjectRef) -> list[str]:
    """``pod NAME exit code N (reason)`` for each pod whose container has terminated, rank 0 first;
    one line saying why when the pods cannot be listed (an error message must not fail in turn)."""
    try:
        pods = sorted(api.list_pods(ref), key=_rank_order)
    except TunepodError as exc:
        return [f"pods unavailable ({exc})"]
    return [line for pod in pods if (line := _exit(pod))]


def _pod_log(api: KubeApi, ref: ObjectRef, pod: Mapping[str, Any], tail: int) -> str:
    containers = (pod.get("spec") or {}).get("containers") or [{}]
    try:
        return api.pod_log(ref.namespace, pod["metadata"]["name"], containers[0].get("name"), tail)
    except TunepodError as exc:
        return f"(log unavailable: {exc})"


def _rank_order(pod: Mapping[str, Any]) -> tuple[bool, int, str]:
    """Rank 0's pod first: Kubeflow's master, then replicas by their trailing index."""
    name = str(pod["metadata"]["name"])
    labels = pod["metadata"].get("labels") or {}
    is_master = labels.get("training.kubeflow.org/replica-type", "").lower() == "master" or "-master-" in name
    index = re.search(r"(\d+)$", name)
    return (not is_master, int(index.group(1)) if index else 0, name)


def _exit(pod: Mapping[str, Any]) -> str:
    """``pod NAME exit code N`` for a pod whose container has terminated, else ""."""
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    for container in statuses:
        terminated = (container.get("state") or {}).get("terminated")
        if terminated and terminated.get("exitCode") is not None:
            reason = f" ({terminated['reason']})" if terminated.get("reason") else ""
            return f"pod {pod['metadata']['name']} exit code {terminated['exitCode']}{reason}"
    return ""
