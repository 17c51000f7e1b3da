"""Evaluate the latest checkpoint of a tiny_llm training run on the held-out test split.

Run it (from the repository root, with tunepod importable: `pip install -e .` or `PYTHONPATH=.`):

    python examples/tiny_llm/train_llm.py       # first: trains under .tunepod/local/
    python examples/tiny_llm/evaluate_llm.py    # then: scores its latest checkpoint

tunepod runs it as the evaluate step's job with TUNEPOD_CHECKPOINT_DIR pointing at a trial's
checkpoints. The model is rebuilt from the checkpoint alone (its model_config); a sharded checkpoint
(of an FSDP2, tensor- or pipeline-parallel trial) is read whole into this one process. The result
file gets test_perplexity (exp of the mean next-byte cross-entropy over every window of the test
split), and the log a short greedy sample, to show what the model learned.
"""

import torch
from tiny_gpt import TinyGPT, load_tokens, mean_loss, perplexity, windows

from tunepod import runtime

SAMPLE_PROMPT = b"def "
SAMPLE_TOKENS = 120

ctx = runtime.init()
checkpoint = ctx.load_latest_checkpoint()
if checkpoint is None:
    raise SystemExit(
        f"no valid checkpoint in {ctx.checkpoint_dir}; train first, or point TUNEPOD_CHECKPOINT_DIR at one"
    )

torch.set_num_threads(1)
config = checkpoint.state["model_config"]
model = TinyGPT(**config)
model.load_state_dict(checkpoint.state["model"])
model.eval()

test_inputs, test_targets = windows(load_tokens(ctx.data_dir, "test"), config["context"])
test_perplexity = perplexity(mean_loss(model, test_inputs, test_targets))

prompt = torch.tensor(list(SAMPLE_PROMPT), dtype=torch.int64)
sample = bytes(model.generate(prompt, SAMPLE_TOKENS).tolist()).decode("utf-8", errors="replace")
print(f"{checkpoint.path}: test_perplexity {test_perplexity:.3f} on {test_targets.numel()} bytes", flush=True)
print(f"greedy sample:\n{sample}", flush=True)
ctx.finish(test_perplexity=test_perplexity)
