"""Mutation testing of the tuning loop's library code against its simulation (``make mutate``)."""
