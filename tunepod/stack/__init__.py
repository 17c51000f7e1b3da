"""The local stack: Prefect server and worker, MLflow server, webhook receiver, as background processes.

``up``/``down``/``status``/``deploy`` are idempotent and may each run in a new process: what runs is
recorded under ``<home>/stack/``. Prefect and MLflow are driven by command and HTTP, never imported.
"""

from tunepod.stack.config import StackConfig
from tunepod.stack.manage import ServiceStatus, StackError, deploy, down, status, up

__all__ = ["ServiceStatus", "StackConfig", "StackError", "deploy", "down", "status", "up"]
