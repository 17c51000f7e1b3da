"""Staging benchmark: tunepod's S3 and folder stages against ``aws s3 sync``, ``s5cmd``, ``cp -r`` and
``rsync -a`` on the same data (``python -m benchmarks.staging``; see ``__main__`` and
benchmarks/README.md)."""
