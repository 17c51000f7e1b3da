"""1,000 trivial trials, 16 in flight: tunepod's orchestration overhead and per-trial bookkeeping
against the ideal (trials x sleep / parallel) and against Ray Tune on the same trials."""
