"""``python -m tunepod.webhook serve|sign ...``: the same commands as ``tunepod webhook``."""

from tunepod.webhook.cli import webhook_app

webhook_app(prog_name="python -m tunepod.webhook")
