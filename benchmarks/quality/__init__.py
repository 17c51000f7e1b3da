"""Tuning quality: wall time until a study first reaches a target, TPE + Hyperband against random search."""
