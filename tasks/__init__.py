"""Prefect tasks: a decorator (retries, names, tags) around one call into ``tunepod``. No logic here."""
