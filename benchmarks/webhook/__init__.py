"""Webhook intake: tunepod's receiver against a bare FastAPI endpoint (``python -m benchmarks.webhook``).

Modules: ``baseline`` (the bare endpoint, its own uvicorn process), ``servers`` (starting both servers
the way ``tunepod webhook serve`` runs), ``sink`` (the Prefect server the receiver publishes to, and
counting the events it stored), ``load`` (the bounded httpx load generator and the same-id race),
``run`` (the sides and the order they run in), ``report`` (tables and figures).
"""
