"""The local stack: Prefect server and worker, MLflow server, webhook receiver and the runner that forks
each ``tunepod run``, as background processes.

``up``/``down``/``status``/``deploy`` (``tunepod.stack.manage``) are idempotent and may each run in a new
process: what runs is recorded under ``<home>/stack/``. Prefect and MLflow are driven by command and
HTTP, never imported. Nothing is imported here: ``tunepod run`` reaches the runner
(``tunepod.stack.runner``) through this package before anything heavy is loaded.
"""
