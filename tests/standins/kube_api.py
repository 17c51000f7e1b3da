"""A STAND-IN for a Kubernetes API server with the HyperPod (or Kubeflow) training operator: no API
server can run on this machine, so the hyperpod_eks launcher's tests talk to this instead.

It serves the real REST paths over real HTTP on 127.0.0.1 (``http.server`` in a thread), so the
launcher uses the real ``kubernetes`` client through a kubeconfig that ``write_kubeconfig`` writes
(server ``http://127.0.0.1:PORT``, no authentication).

Emulated, and only this:

- custom objects ``hyperpodpytorchjobs.sagemaker.amazonaws.com/v1`` and ``pytorchjobs.kubeflow.org/v1``:
  create (409 AlreadyExists on a taken name), get, list with an equality ``labelSelector``, delete
  (404 when missing, 409 when ``preconditions.uid`` differs; Foreground keeps the object, with a
  ``deletionTimestamp``, until its pods are gone; Background removes it first);
- pods: list (``labelSelector``), get, and ``/log`` with ``tailLines`` and ``previous``;
- errors as ``Status`` objects; ``refuse_with`` makes every request answer one error (e.g. 403);
- a lost reply: ``lose_replies`` makes the next requests of one kind (``create hyperpodpytorchjobs``)
  take effect and then close the connection without an answer, as a dropped connection or a
  timed-out client does after the API server has acted;
- Secrets, as data only (``add_secret``): a container's ``valueFrom.secretKeyRef`` reads them when its
  pod starts (a missing Secret or key leaves the variable unset, where the kubelet would hold the pod
  in CreateContainerConfigError); ``valueFrom.fieldRef`` of ``metadata.name`` is the pod's name (the
  downward API);
- a tiny operator: each created job gets all its pods at once (labels from the template, an owner
  reference to the job), and each pod's container ``command`` runs as a LOCAL process tree in a new
  session with the container's env (``$(VAR)`` and ``$$`` expanded as Kubernetes does) and
  ``workingDir``; the image's python becomes ``sys.executable`` (also under a ``/bin/sh -c SCRIPT
  NAME`` wrapper, which runs as it is). The claim's mount path is the same local path. stdout and
  stderr together are the pod log.
- rendezvous, all on 127.0.0.1 with a free port per job (every pod shares this machine's network,
  where a cluster gives each pod its own address and a Service name):
  - Kubeflow: the training operator v1's env (pkg/controller.v1/pytorch ``setPodEnv``, v1.9) is
    appended to the container's env: ``PYTHONUNBUFFERED=1``; with a Master, ``MASTER_ADDR`` and
    ``PET_MASTER_ADDR`` (127.0.0.1 for the Service ``<job>-master-0``), ``MASTER_PORT`` and
    ``PET_MASTER_PORT``, ``WORLD_SIZE`` (pods x nprocPerNode), ``RANK`` and ``PET_NODE_RANK`` (Master
    0, Worker i is i + 1) and ``PET_NNODES`` (the pod count); under ``elasticPolicy`` (Workers only)
    ``PET_RDZV_ENDPOINT`` (127.0.0.1 for ``<job>-worker-0``), ``PET_RDZV_BACKEND`` (default c10d),
    ``PET_NNODES`` (``min:max``, else the Worker count), ``PET_MAX_RESTARTS`` and ``PET_RDZV_ID`` when
    set; ``PET_NPROC_PER_NODE`` from ``nprocPerNode``. ``torch.distributed.run`` reads them as the
    defaults of its flags.
  - HyperPod: ``hyperpodrun`` becomes ``sys.executable -m torch.distributed.run`` with an explicit
    c10d rendezvous, ``--rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:PORT --rdzv-id=<job uid>``, in
    every pod. The real HyperPod elastic agent gets its rendezvous from the training operator instead,
    which the stand-in does not emulate.
  - A one-pod job's torchrun (both operators) gets ``--standalone`` in place of all this, so that
    the contract's many one-node jobs never race for a free port.
- conditions walk Created -> Running (Kubeflow) / PodsRunning (HyperPod) once every pod runs ->
  Succeeded (Kubeflow) / Completed (HyperPod) once every pod has succeeded, or Failed as soon as one
  pod fails, naming it and its exit code; the other pods' processes are then SIGKILLed, as a failed
  job's workers are torn down. Each condition has reason, message and lastTransitionTime. Pods get
  ``status.phase`` and ``containerStatuses[].state.terminated.exitCode`` (128 + signal for a killed
  process, as kubelet reports).
- deleting a job sends SIGTERM to its pods' processes, then SIGKILL after ``grace_s``; ``crash``
  SIGKILLs them like a node failure.
- ``ttlSecondsAfterFinished``: a job that ended by itself (Succeeded, Completed or Failed) is deleted
  that long after it ended, in the Background (the object at once, then its pods), so that a GET
  answers 404 from then on.
- HyperPod's log monitoring (``runPolicy.logMonitoringConfiguration``) and its restart in place. The
  operator reads each running pod's log every ``LOG_POLL_S``; a line's time is when it read it. A
  rule fires when no line matched its ``logPattern`` within ``expectedStartCutOffInSeconds`` of the
  container's start, or for ``expectedRecurringFrequencyInSeconds`` since its last match (as the
  HyperPod SDK's schema words them: "time to first match" and "time interval between two subsequent
  matches", so before a first match only the cut-off applies); a line matching ``stopPattern``
  deactivates the rule for the rest of that run. When a rule fires while the job's restarts
  (``status.restartCount``, the field of the SDK's job status) are fewer than ``jobMaxRetryCount``,
  the job gets a Restarting condition (reason ``HangDetected``, the message naming the rule, its
  pattern and the pod), every pod's processes get SIGTERM, then SIGKILL after ``grace_s``, and the
  containers start again at once in the same pods (same names and uids: ``restartCount`` of the
  pod's container status goes up, ``lastState`` is the ended run; the new run writes a new log, the
  ended run's is ``/log?previous=true``), then PodsRunning again, every rule starting afresh. With no
  retry left the pods are stopped the same way and the job is Failed (reason ``HangDetected``,
  naming the rule). Assumed where AWS's docs say nothing, as the simulation's twin of the operator
  (``tests/simulation/backends/hyperpod_eks.py``) does: the condition types and reason, a fired
  rule counting against ``jobMaxRetryCount`` like a failure, a whole-job restart of the containers.
  Also assumed: every pod's log is judged on its own, a pattern matches anywhere in a line (Go's
  ``regexp.MatchString``; compiled here by Python's ``re``, which reads tunepod's patterns as RE2
  does; a pattern ``re`` cannot compile is refused at create with 422 Invalid).

Not emulated: authentication, RBAC, watches, resourceVersion semantics, namespaces as objects, other
resources, Services and DNS (every rendezvous address is 127.0.0.1), restarts after a failure
(``jobMaxRetryCount``/``backoffLimit``/``maxRestarts``: a failed pod fails the job; only a fired log
rule restarts one), HyperPod's ``restartPolicy`` (its evaluation window, ``maxFullJobRestarts``,
``numRestartBeforeFullJobRestart``), process-level restarts through the elastic agent, a restart's
backoff, the log rules' metric fields (``metricThreshold``, ``metricEvaluationDataPoints``: tunepod
renders neither) and the SLOW state they lead to, ``activeDeadlineSeconds``, ``cleanPodPolicy``
(ended pods stay until their job is deleted), Kubeflow's success policy (the stand-in waits for
every pod, where the real operator ends a job with a Master when the Master succeeds), schema
validation of the objects, scheduling and resources.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

from ports import free_port

CRDS = {"hyperpodpytorchjobs": "sagemaker.amazonaws.com", "pytorchjobs": "kubeflow.org"}
TOKEN_ENV = "KUBE_STANDIN_POD_UID"
LOG_POLL_S = 0.25
"""How often the operator reads the logs of a job with log monitoring rules."""
HANG_REASON = "HangDetected"
"""The reason of the Restarting or Failed condition a fired log rule sets (as the simulation's twin)."""
_OBJECTS = re.compile(
    r"^/apis/(?P<group>[^/]+)/v1/namespaces/(?P<ns>[^/]+)/(?P<plural>[^/]+)(?:/(?P<name>[^/]+))?$"
)
_PODS = re.compile(r"^/api/v1/namespaces/(?P<ns>[^/]+)/pods(?:/(?P<name>[^/]+)(?P<log>/log)?)?$")
_EXPAND = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


class ApiError(Exception):
    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message


def now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' expansion: ``$$`` -> ``$``, ``$(NAME)`` -> its value when defined, else kept."""
    return _EXPAND.sub(lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), text)


def local_argv(command: list[str], torchrun_flags: list[str]) -> list[str]:
    """The container command as a command on this machine: ``hyperpodrun`` and the image's torchrun
    become this Python's ``torch.distributed.run`` with ``torchrun_flags`` (the rendezvous the
    operator would supply; see the module docstring) first."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", *torchrun_flags]
    if command[:2] == ["/bin/sh", "-c"] and len(command) > 4:
        # A wrapper script (tunepod's exit recorder): it runs as it is, its arguments are the command.
        return [*command[:4], *local_argv(command[4:], torchrun_flags)]
    if command[0] == "hyperpodrun":
        return [*torchrun, *command[1:]]
    if Path(command[0]).name.startswith("python"):
        if command[1:3] == ["-m", "torch.distributed.run"]:
            return [*torchrun, *command[3:]]
        return [sys.executable, *command[1:]]
    return command


def kubeflow_env(obj: dict[str, Any], replica: str, index: int, port: int) -> dict[str, str]:
    """What Kubeflow's training operator v1 appends to a pod's env (``setPodEnv``, v1.9), with
    127.0.0.1 for the Services it names (``<job>-master-0``, ``<job>-worker-0``)."""
    spec = obj["spec"]
    replicas = spec["pytorchReplicaSpecs"]
    total = sum(r.get("replicas", 1) for r in replicas.values())
    nproc = spec.get("nprocPerNode")
    env = {"PYTHONUNBUFFERED": "1"}
    if "Master" in replicas:
        rank = index + 1 if replica == "worker" else index
        procs = int(nproc) if str(nproc).isdigit() else 1
        env |= {"MASTER_PORT": str(port), "PET_MASTER_PORT": str(port)}
        env |= {"MASTER_ADDR": "127.0.0.1", "PET_MASTER_ADDR": "127.0.0.1"}
        env |= {"WORLD_SIZE": str(total * procs), "RANK": str(rank), "PET_NODE_RANK": str(rank)}
    if nproc is not None:
        env["PET_NPROC_PER_NODE"] = str(nproc)
    elastic = spec.get("elasticPolicy")
    if elastic is None:
        env["PET_NNODES"] = str(total)
        return env
    env["PET_RDZV_ENDPOINT"] = f"127.0.0.1:{port}"
    env["PET_RDZV_BACKEND"] = elastic.get("rdzvBackend", "c10d")
    if "minReplicas" in elastic or "maxReplicas" in elastic:
        env["PET_NNODES"] = f"{elastic.get('minReplicas')}:{elastic.get('maxReplicas')}"
    else:
        env["PET_NNODES"] = str(replicas["Worker"].get("replicas", 1))
    if "maxRestarts" in elastic:
        env["PET_MAX_RESTARTS"] = str(elastic["maxRestarts"])
    if "rdzvId" in elastic:
        env["PET_RDZV_ID"] = elastic["rdzvId"]
    return env


def torchrun_flags(obj: dict[str, Any], num_pods: int, port: int) -> list[str]:
    """Flags put before the command's own torchrun arguments (see the module docstring)."""
    if num_pods == 1:
        return ["--standalone"]
    if obj["kind"] == "PyTorchJob":
        return []  # the operator's PET_* env does it
    endpoint = f"127.0.0.1:{port}"
    return ["--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={obj['metadata']['uid']}"]


def pids_of(token: str) -> list[int]:
    """Live processes whose environment carries ``TOKEN_ENV=token`` (torchrun's workers start new
    sessions, so a process group does not hold them all)."""
    marker = f"{TOKEN_ENV}={token}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            stat = (entry / "stat").read_bytes()
        except OSError:
            continue
        if marker in environ.split(b"\0") and stat[stat.rindex(b")") + 2 :][:1] not in (b"Z", b"X"):
            pids.append(int(entry.name))
    return pids


def kill_all(token: str, signum: signal.Signals) -> None:
    for pid in pids_of(token):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)


class LogRule:
    """One rule of a HyperPodPyTorchJob's ``runPolicy.logMonitoringConfiguration``, compiled (see the
    module docstring for what the stand-in assumes of the operator's evaluation)."""

    def __init__(self, rule: dict[str, Any]) -> None:
        self.name = str(rule["name"])
        self.log_pattern = str(rule["logPattern"])
        self.pattern = re.compile(self.log_pattern)
        self.stop = re.compile(rule["stopPattern"]) if rule.get("stopPattern") else None
        start, recur = (
            rule.get("expectedStartCutOffInSeconds"),
            rule.get("expectedRecurringFrequencyInSeconds"),
        )
        self.start_s = None if start is None else float(start)
        self.recur_s = None if recur is None else float(recur)

    @classmethod
    def of(cls, obj: dict[str, Any]) -> list[LogRule]:
        """The rules of ``obj`` (a HyperPodPyTorchJob; any other kind has none). Raises ``re.error``
        for a pattern Python cannot compile."""
        if obj["kind"] != "HyperPodPyTorchJob":
            return []
        rules = (obj["spec"].get("runPolicy") or {}).get("logMonitoringConfiguration") or []
        return [cls(rule) for rule in rules]


class LogWatch:
    """The operator's reading of one pod's log during one run of its container: each rule's last
    match (when the operator read the line) and whether its ``stopPattern`` deactivated it."""

    def __init__(self, pod: Pod, rules: list[LogRule]) -> None:
        self.pod = pod
        self.log = pod.log
        self.started_at = pod.started_at
        self.rules = rules
        self.matched_at: dict[str, float] = {}
        self.stopped: set[str] = set()
        self._offset = 0
        self._partial = b""

    def fired(self, at: float) -> str | None:
        """Read what the log gained, then say why a rule fires now (None: none does)."""
        for line in self._new_lines():
            for rule in self.rules:
                if rule.name in self.stopped:
                    continue
                if rule.stop is not None and rule.stop.search(line):
                    self.stopped.add(rule.name)
                elif rule.pattern.search(line):
                    self.matched_at[rule.name] = at
        pod = self.pod.body["metadata"]["name"]
        for rule in self.rules:
            if rule.name in self.stopped:
                continue
            last = self.matched_at.get(rule.name)
            if last is None and rule.start_s is not None and at - self.started_at > rule.start_s:
                return (
                    f"log monitoring rule {rule.name!r} found the job hanging: no line of pod {pod} "
                    f"matched {rule.log_pattern!r} within {rule.start_s:g}s of its start"
                )
            if last is not None and rule.recur_s is not None and at - last > rule.recur_s:
                return (
                    f"log monitoring rule {rule.name!r} found the job hanging: no line of pod {pod} "
                    f"matched {rule.log_pattern!r} for {rule.recur_s:g}s"
                )
        return None

    def _new_lines(self) -> list[str]:
        try:
            with open(self.log, "rb") as log:
                log.seek(self._offset)
                data = log.read()
        except FileNotFoundError:
            return []
        self._offset += len(data)
        *lines, self._partial = (self._partial + data).split(b"\n")
        return [line.decode(errors="replace") for line in lines]


class Pod:
    """One pod and the local process running its container."""

    def __init__(
        self,
        body: dict[str, Any],
        job_name: str,
        log: Path,
        torchrun_flags: list[str],
        secrets: dict[str, dict[str, str]],
    ) -> None:
        self.body = body
        self.secrets = secrets
        self.job_name = job_name
        self.log = log
        self.first_log = log
        self.torchrun_flags = torchrun_flags
        self.token = body["metadata"]["uid"]
        self.process: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0
        """When the container's current run started (``time.monotonic``)."""
        self.restarts = 0
        self.previous_log: Path | None = None
        """The log of the container's last run before a restart (``/log?previous=true``)."""

    def restart(self) -> None:
        """Start the container again in the same pod, as the kubelet does: restartCount goes up, the
        new run writes a new log, and the last run's log and end stay readable as the previous ones."""
        self.restarts += 1
        self.previous_log = self.log
        self.log = self.first_log.with_suffix(f".{self.restarts}.log")
        last = self.body["status"]["containerStatuses"][0]["state"]
        self.start()
        self.body["status"]["containerStatuses"][0]["lastState"] = last

    def start(self) -> None:
        container = self.body["spec"]["containers"][0]
        env: dict[str, str] = {}
        for var in container.get("env") or []:
            if "fieldRef" in var.get("valueFrom", {}):
                assert var["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name", var
                env[var["name"]] = self.body["metadata"]["name"]
            elif "valueFrom" in var:
                ref = var["valueFrom"]["secretKeyRef"]
                if ref["key"] in self.secrets.get(ref["name"], {}):
                    env[var["name"]] = self.secrets[ref["name"]][ref["key"]]
            else:
                env[var["name"]] = expand(var.get("value", ""), env)
        command = [expand(part, env) for part in container["command"] + container.get("args", [])]
        argv = local_argv(command, self.torchrun_flags)
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(
                argv,
                env={**os.environ, **env, TOKEN_ENV: self.token},
                cwd=container.get("workingDir"),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.started_at = time.monotonic()
        running = {"running": {"startedAt": now()}}
        self.body["status"] = {
            "phase": "Running",
            "containerStatuses": [
                {"name": container["name"], "restartCount": self.restarts, "state": running}
            ],
        }

    def finished(self, code: int) -> int:
        exit_code = 128 - code if code < 0 else code
        terminated = {
            "exitCode": exit_code,
            "reason": "Completed" if code == 0 else "Error",
            "finishedAt": now(),
        }
        self.body["status"]["phase"] = "Succeeded" if code == 0 else "Failed"
        self.body["status"]["containerStatuses"][0]["state"] = {"terminated": terminated}
        return exit_code

    def terminate(self) -> None:
        """SIGTERM to the container's process group (the exit wrapper forwards it to the command)."""
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)

    def stop(self, grace_s: float) -> None:
        """SIGTERM to the container's process group, SIGKILL to every process left after ``grace_s``."""
        self.terminate()
        deadline = time.monotonic() + grace_s
        while pids_of(self.token) and time.monotonic() < deadline:
            time.sleep(0.05)
        self.kill()

    def kill(self) -> None:
        """SIGKILL every process of the pod; loops, as one may be forking while the first round lands."""
        while pids_of(self.token):
            kill_all(self.token, signal.SIGKILL)
            time.sleep(0.05)


class KubeApiStandIn:
    """The stand-in server and operator; see the module docstring. ``calls`` counts requests by
    ``VERB resource`` (``list hyperpodpytorchjobs``, ``get pods/log``)."""

    def __init__(self, state_dir: Path, grace_s: float = 3.0) -> None:
        self.state_dir = state_dir
        self.grace_s = grace_s
        self.calls: Counter[str] = Counter()
        self.refusal: ApiError | None = None
        self._lock = threading.RLock()
        self._lost_replies: Counter[str] = Counter()
        self._secrets: dict[tuple[str, str], dict[str, str]] = {}
        self._request = threading.local()  # the call the handler thread serves
        self._objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        self._pods: dict[tuple[str, str], Pod] = {}
        self._versions = itertools.count(1)
        self._threads: list[threading.Thread] = []
        self._stopping = threading.Event()
        standin = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                standin._serve(self, "GET")

            def do_POST(self) -> None:
                standin._serve(self, "POST")

            def do_DELETE(self) -> None:
                standin._serve(self, "DELETE")

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"

    # -------------------------------------------------------------------------------------- lifecycle

    def __enter__(self) -> KubeApiStandIn:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self._spawn(lambda: self._server.serve_forever(poll_interval=0.05))
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop serving (idempotent) and kill every process the pods still run."""
        self._stopping.set()
        self._server.shutdown()
        self._server.server_close()
        with self._lock:
            pods = list(self._pods.values())
        for pod in pods:
            pod.stop(grace_s=0)
        for thread in self._threads:
            thread.join(timeout=10)

    def write_kubeconfig(self, path: Path, context: str = "standin") -> Path:
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "standin", "cluster": {"server": self.url}}],
            "users": [{"name": "standin", "user": {}}],
            "contexts": [{"name": context, "context": {"cluster": "standin", "user": "standin"}}],
            "current-context": context,
        }
        path.write_text(json.dumps(config))  # JSON is YAML, and the client reads it as such
        return path

    def refuse_with(self, code: int, reason: str, message: str) -> None:
        """Answer every request with this error until ``refuse_with`` is called again with code 0."""
        self.refusal = ApiError(code, reason, message) if code else None

    def lose_replies(self, call: str, count: int = 1) -> None:
        """The next ``count`` requests ``call`` (as ``calls`` names them) take effect, then the
        connection closes without a reply."""
        with self._lock:
            self._lost_replies[call] += count

    def add_secret(self, namespace: str, name: str, data: dict[str, str]) -> None:
        """A Secret whose keys pods read through ``valueFrom.secretKeyRef``."""
        with self._lock:
            self._secrets[(namespace, name)] = dict(data)

    def crash(self, namespace: str, name: str) -> None:
        """SIGKILL every process of the job's pods, as a node failure would."""
        for pod in self._pods_of(namespace, name):
            pod.kill()

    # -------------------------------------------------------------------------------------- HTTP

    def _serve(self, request: BaseHTTPRequestHandler, verb: str) -> None:
        url = urlparse(request.path)
        query = {key: values[-1] for key, values in parse_qs(url.query).items()}
        length = int(request.headers.get("Content-Length") or 0)
        body = json.loads(request.rfile.read(length)) if length else {}
        self._request.call = None
        try:
            if self.refusal is not None:
                raise self.refusal
            code, answer = self._route(verb, url.path, query, body)
        except ApiError as error:
            code, answer = error.code, self._status(error)
        if self._reply_lost(self._request.call):
            request.close_connection = True
            return
        data = answer.encode() if isinstance(answer, str) else json.dumps(answer).encode()
        request.send_response(code)
        request.send_header("Content-Type", "text/plain" if isinstance(answer, str) else "application/json")
        request.send_header("Content-Length", str(len(data)))
        request.end_headers()
        request.wfile.write(data)

    def _route(self, verb: str, path: str, query: dict[str, str], body: dict[str, Any]) -> tuple[int, Any]:
        if match := _OBJECTS.match(path):
            group, ns, plural, name = match.group("group", "ns", "plural", "name")
            if CRDS.get(plural) != group:
                raise ApiError(404, "NotFound", "the server could not find the requested resource")
            action = {"POST": "create", "DELETE": "delete"}.get(verb, "get" if name else "list")
            self._count(f"{action} {plural}")
            return getattr(self, f"_{action}_object")(plural, ns, name, query, body)
        if (match := _PODS.match(path)) and verb == "GET":
            ns, name, log = match.group("ns", "name", "log")
            self._count("get pods/log" if log else "get pods" if name else "list pods")
            return 200, self._pod_answer(ns, name, bool(log), query)
        raise ApiError(404, "NotFound", f"the stand-in does not emulate {verb} {path}")

    def _count(self, call: str) -> None:
        self._request.call = call
        with self._lock:  # handler threads serve requests concurrently
            self.calls[call] += 1

    def _reply_lost(self, call: str | None) -> bool:
        with self._lock:
            if call is None or self._lost_replies[call] <= 0:
                return False
            self._lost_replies[call] -= 1
            return True

    @staticmethod
    def _status(error: ApiError) -> dict[str, Any]:
        return {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": error.message,
            "reason": error.reason,
            "code": error.code,
        }

    # -------------------------------------------------------------------------------------- objects

    def _create_object(
        self, plural: str, ns: str, _: None, q: dict[str, str], body: dict[str, Any]
    ) -> tuple[int, Any]:
        name = body["metadata"]["name"]
        with self._lock:
            if (plural, ns, name) in self._objects:
                raise ApiError(409, "AlreadyExists", f'{plural}.{CRDS[plural]} "{name}" already exists')
            try:
                LogRule.of(body)
            except re.error as error:
                raise ApiError(
                    422, "Invalid", f"the stand-in cannot compile a log pattern: {error}"
                ) from None
            obj = copy.deepcopy(body)
            obj["metadata"].update(namespace=ns, uid=str(uuid.uuid4()), creationTimestamp=now(), generation=1)
            self._objects[(plural, ns, name)] = obj
            self._set_condition(obj, "Created", "created")
            self._spawn(lambda: self._operate(plural, ns, name))
            return 201, copy.deepcopy(obj)

    def _get_object(self, plural: str, ns: str, name: str, q: dict[str, str], b: Any) -> tuple[int, Any]:
        with self._lock:
            return 200, copy.deepcopy(self._must_get(plural, ns, name))

    def _list_object(self, plural: str, ns: str, _: None, query: dict[str, str], b: Any) -> tuple[int, Any]:
        wanted = self._selector(query.get("labelSelector", ""))
        with self._lock:
            items = [
                copy.deepcopy(obj)
                for (p, n, _), obj in self._objects.items()
                if (p, n) == (plural, ns) and wanted.items() <= (obj["metadata"].get("labels") or {}).items()
            ]
        return 200, {"apiVersion": f"{CRDS[plural]}/v1", "kind": "List", "metadata": {}, "items": items}

    def _delete_object(
        self, plural: str, ns: str, name: str, query: dict[str, str], body: dict[str, Any]
    ) -> tuple[int, Any]:
        policy = query.get("propagationPolicy") or body.get("propagationPolicy") or "Background"
        with self._lock:
            obj = self._must_get(plural, ns, name)
            uid = (body.get("preconditions") or {}).get("uid")
            if uid is not None and uid != obj["metadata"]["uid"]:
                raise ApiError(
                    409,
                    "Conflict",
                    f"Precondition failed: UID in precondition: {uid}, in object: {obj['metadata']['uid']}",
                )
            if not obj["metadata"].get("deletionTimestamp"):
                obj["metadata"]["deletionTimestamp"] = now()
                if policy == "Foreground":
                    obj["metadata"]["finalizers"] = ["foregroundDeletion"]
                else:
                    del self._objects[(plural, ns, name)]
                self._spawn(lambda: self._remove(plural, ns, name, obj))
            return 200, copy.deepcopy(obj)

    def _remove(self, plural: str, ns: str, name: str, obj: dict[str, Any]) -> None:
        """The garbage collector: stop and drop the pods, then the object (if still the same one)."""
        pods = self._pods_of(ns, name)
        for pod in pods:
            pod.stop(self.grace_s)
        with self._lock:
            for pod in pods:
                self._pods.pop((ns, pod.body["metadata"]["name"]), None)
            if self._objects.get((plural, ns, name)) is obj:
                del self._objects[(plural, ns, name)]

    def _must_get(self, plural: str, ns: str, name: str) -> dict[str, Any]:
        obj = self._objects.get((plural, ns, name))
        if obj is None:
            raise ApiError(404, "NotFound", f'{plural}.{CRDS[plural]} "{name}" not found')
        return obj

    @staticmethod
    def _selector(text: str) -> dict[str, str]:
        wanted = {}
        for term in filter(None, text.split(",")):
            key, sep, value = term.replace("==", "=").partition("=")
            if not sep or key.endswith("!"):
                raise ApiError(
                    400, "BadRequest", f"the stand-in understands only key=value selectors, not {term!r}"
                )
            wanted[key] = value
        return wanted

    # -------------------------------------------------------------------------------------- pods

    def _pod_answer(self, ns: str, name: str | None, log: bool, query: dict[str, str]) -> Any:
        with self._lock:
            if name is None:
                wanted = self._selector(query.get("labelSelector", ""))
                items = [
                    copy.deepcopy(pod.body)
                    for (n, _), pod in self._pods.items()
                    if n == ns and wanted.items() <= pod.body["metadata"]["labels"].items()
                ]
                return {"apiVersion": "v1", "kind": "PodList", "metadata": {}, "items": items}
            pod = self._pods.get((ns, name))
            if pod is None:
                raise ApiError(404, "NotFound", f'pods "{name}" not found')
            if not log:
                return copy.deepcopy(pod.body)
            path = pod.log
            if query.get("previous", "").lower() == "true":
                if pod.previous_log is None:
                    raise ApiError(
                        400,
                        "BadRequest",
                        f'previous terminated container "pytorch" in pod "{name}" not found',
                    )
                path = pod.previous_log
        if not path.exists():
            raise ApiError(400, "BadRequest", f'container "pytorch" in pod "{name}" is waiting to start')
        lines = path.read_text(errors="replace").splitlines(keepends=True)
        return "".join(lines[-int(query["tailLines"]) :] if "tailLines" in query else lines)

    def _pods_of(self, ns: str, name: str) -> list[Pod]:
        with self._lock:
            return [pod for (n, _), pod in self._pods.items() if n == ns and pod.job_name == name]

    # -------------------------------------------------------------------------------------- operator

    def _operate(self, plural: str, ns: str, name: str) -> None:
        """Run every pod of the job to its end and walk the job's conditions the way the operator
        does: running once all pods run, done once all succeed, failed at the first failure; a
        HyperPodPyTorchJob whose log rule fires is restarted in place while ``jobMaxRetryCount``
        allows, else failed."""
        with self._lock:
            obj = self._objects.get((plural, ns, name))
            if obj is None or obj["metadata"].get("deletionTimestamp"):
                return  # deleted before the operator got to it
            replicas = self._replicas(plural, obj)
            port = free_port()
            pods = [self._make_pod(obj, *replica, num_pods=len(replicas), port=port) for replica in replicas]
            for pod in pods:
                pod.start()
            self._set_condition(obj, self._running_type(plural), "running")
            rules = LogRule.of(obj)
            retries = int((obj["spec"].get("runPolicy") or {}).get("jobMaxRetryCount") or 0) if rules else 0
        while self._run(plural, ns, name, obj, pods, rules, retries):
            with self._lock:
                if not self._is_live(plural, ns, name, obj) or self._stopping.is_set():
                    break  # deleted (or the stand-in stopped) meanwhile: nothing to restart
                for pod in pods:
                    pod.restart()
                self._set_condition(obj, self._running_type(plural), "running")
        with self._lock:
            ended_by_itself = self._is_live(plural, ns, name, obj)
        ttl = (obj["spec"].get("runPolicy") or {}).get("ttlSecondsAfterFinished")
        if ended_by_itself and ttl is not None and not self._stopping.wait(float(ttl)):
            self._expire(plural, ns, name, obj)

    def _run(
        self,
        plural: str,
        ns: str,
        name: str,
        obj: dict[str, Any],
        pods: list[Pod],
        rules: list[LogRule],
        retries: int,
    ) -> bool:
        """One run of the job's pods, to its end or until a log rule fires. True: a rule fired, the
        pods were stopped and the caller starts them again; False: the job ended (conditions set)."""
        exits: queue.Queue[tuple[Pod, int]] = queue.Queue()
        for pod in pods:
            process = pod.process
            self._spawn(lambda pod=pod, process=process: exits.put((pod, process.wait() if process else 1)))
        watches = {pod: LogWatch(pod, rules) for pod in pods} if rules else {}
        failed = False
        for _ in pods:
            while True:
                try:
                    pod, code = exits.get(timeout=LOG_POLL_S if watches and not failed else None)
                    break
                except queue.Empty:
                    fired = next(filter(None, (w.fired(time.monotonic()) for w in watches.values())), None)
                    if fired is not None:
                        restart = self._hanging(plural, ns, name, obj, pods, exits, fired, retries)
                        if restart is not None:
                            return restart
                        watches.clear()  # being deleted: its pods' ends are the garbage collector's
            watches.pop(pod, None)  # an ended container's log says nothing more
            with self._lock:
                exit_code = pod.finished(code)
                fails_job = code != 0 and not failed and self._is_live(plural, ns, name, obj)
                if fails_job:
                    pod_name = pod.body["metadata"]["name"]
                    self._set_condition(obj, "Failed", f"failed: pod {pod_name} exited with code {exit_code}")
            if fails_job:
                # The other workers are torn down, as a failed job's are. Outside the lock: killing
                # waits until every process is gone.
                failed = True
                for other in pods:
                    other.kill()
        with self._lock:
            if not failed and self._is_live(plural, ns, name, obj):
                done = "Completed" if plural == "hyperpodpytorchjobs" else "Succeeded"
                self._set_condition(obj, done, "completed successfully")
        return False

    def _hanging(
        self,
        plural: str,
        ns: str,
        name: str,
        obj: dict[str, Any],
        pods: list[Pod],
        exits: queue.Queue[tuple[Pod, int]],
        why: str,
        retries: int,
    ) -> bool | None:
        """A log rule fired: Restarting while retries are left, the pods stopped (SIGTERM, SIGKILL
        after ``grace_s``), then Failed when none was left. True: the caller restarts the pods;
        None: the job is being deleted, nothing was done."""
        with self._lock:
            if not self._is_live(plural, ns, name, obj) or self._stopping.is_set():
                return None
            status = obj.setdefault("status", {})
            restarts = int(status.get("restartCount", 0))
            restart = restarts < retries
            if restart:
                status["restartCount"] = restarts + 1
                self._set_condition(obj, "Restarting", f"is restarting: {why}", reason=HANG_REASON)
        for pod in pods:
            pod.terminate()
        deadline = time.monotonic() + self.grace_s
        for pod in pods:
            pod.stop(max(0.0, deadline - time.monotonic()))
        running = sum(1 for pod in pods if pod.body["status"]["phase"] == "Running")
        ended = [exits.get() for _ in range(running)]  # every process is gone: their waits return
        with self._lock:
            for pod, code in ended:
                pod.finished(code)
            if not restart and self._is_live(plural, ns, name, obj):
                self._set_condition(obj, "Failed", f"failed: {why}", reason=HANG_REASON)
        return restart

    @staticmethod
    def _running_type(plural: str) -> str:
        return "PodsRunning" if plural == "hyperpodpytorchjobs" else "Running"

    def _expire(self, plural: str, ns: str, name: str, obj: dict[str, Any]) -> None:
        """``ttlSecondsAfterFinished`` ran out: delete the job in the Background (object, then pods)."""
        with self._lock:
            if self._objects.get((plural, ns, name)) is not obj or obj["metadata"].get("deletionTimestamp"):
                return  # deleted (or replaced) meanwhile
            del self._objects[(plural, ns, name)]
        self._remove(plural, ns, name, obj)

    def _is_live(self, plural: str, ns: str, name: str, obj: dict[str, Any]) -> bool:
        """Whether ``obj`` is still the object under its name and not being deleted (a deleted job's
        pods end by the garbage collector's hand, which decides no condition)."""
        return self._objects.get((plural, ns, name)) is obj and not obj["metadata"].get("deletionTimestamp")

    @staticmethod
    def _replicas(plural: str, obj: dict[str, Any]) -> list[tuple[str, int, dict[str, Any]]]:
        """(replica type, index, pod template) of every pod the operator would create."""
        if plural == "hyperpodpytorchjobs":
            specs = [(r["name"], r.get("replicas", 1), r["template"]) for r in obj["spec"]["replicaSpecs"]]
        else:
            specs = [
                (t.lower(), r.get("replicas", 1), r["template"])
                for t, r in obj["spec"]["pytorchReplicaSpecs"].items()
            ]
        return [(kind, i, template) for kind, count, template in specs for i in range(count)]

    def _make_pod(
        self,
        obj: dict[str, Any],
        replica: str,
        index: int,
        template: dict[str, Any],
        *,
        num_pods: int,
        port: int,
    ) -> Pod:
        meta = obj["metadata"]
        labels = dict(template["metadata"].get("labels") or {})
        if obj["kind"] == "PyTorchJob":
            labels.update(
                {
                    "training.kubeflow.org/job-name": meta["name"],
                    "training.kubeflow.org/replica-type": replica,
                    "training.kubeflow.org/replica-index": str(index),
                }
            )
        name = f"{meta['name']}-{replica}-{index}"
        owner = {
            "apiVersion": obj["apiVersion"],
            "kind": obj["kind"],
            "name": meta["name"],
            "uid": meta["uid"],
            "controller": True,
        }
        body = {
            "apiVersion": "v1",
            "kind": "Pod",
            "spec": copy.deepcopy(template["spec"]),
            "metadata": {
                "name": name,
                "namespace": meta["namespace"],
                "uid": str(uuid.uuid4()),
                "labels": labels,
                "ownerReferences": [owner],
                "creationTimestamp": now(),
            },
            "status": {"phase": "Pending"},
        }
        if obj["kind"] == "PyTorchJob":
            container = body["spec"]["containers"][0]
            injected = kubeflow_env(obj, replica, index, port)
            container["env"] = [
                *(container.get("env") or []),
                *({"name": k, "value": v} for k, v in injected.items()),
            ]
        log = self.state_dir / f"{meta['namespace']}-{name}-{body['metadata']['uid']}.log"
        secrets = {name: data for (ns, name), data in self._secrets.items() if ns == meta["namespace"]}
        pod = Pod(body, meta["name"], log, torchrun_flags(obj, num_pods, port), secrets)
        self._pods[(meta["namespace"], name)] = pod
        return pod

    def _set_condition(self, obj: dict[str, Any], kind: str, what: str, reason: str = "") -> None:
        conditions = obj.setdefault("status", {}).setdefault("conditions", [])
        for condition in conditions:
            if (
                condition["type"] in ("Running", "PodsRunning", "Restarting")
                and condition["status"] == "True"
            ):
                condition.update(status="False", lastTransitionTime=now())
        stamp = now()
        conditions.append(
            {
                "type": kind,
                "status": "True",
                "reason": reason or f"{obj['kind']}{kind}",
                "message": f"{obj['kind']} {obj['metadata']['namespace']}/{obj['metadata']['name']} {what}",
                "lastUpdateTime": stamp,
                "lastTransitionTime": stamp,
            }
        )
        obj["metadata"]["resourceVersion"] = str(next(self._versions))

    def _spawn(self, target: Any) -> None:
        thread = threading.Thread(target=target, daemon=True)
        thread.start()
        self._threads.append(thread)
