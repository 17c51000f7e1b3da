"""Checkpoint benchmarks: tunepod's saves and resumes against plain torch.save, torch.load, dd and cp
(``python -m benchmarks.checkpoints``; see ``__main__`` and benchmarks/README.md)."""
