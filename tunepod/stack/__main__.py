"""``python -m tunepod.stack up|down|status|deploy``: the stack commands without the main CLI."""

from tunepod.stack.cli import app

app()
