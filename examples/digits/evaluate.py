"""Evaluate the latest checkpoint of a digits training run on the held-out test split.

Run it (from the repository root, with tunepod importable: `pip install -e .` or `PYTHONPATH=.`):

    python examples/digits/evaluate.py        # after `python examples/digits/train.py`, under .tunepod/local/

tunepod runs it as the evaluate step's job with TUNEPOD_CHECKPOINT_DIR pointing at a trial's
checkpoints. The model is rebuilt from the checkpoint alone (its model_config); the result file gets
test_accuracy.
"""

import numpy as np
import torch
from torch import nn

from tunepod import runtime

ctx = runtime.init()
checkpoint = ctx.load_latest_checkpoint()
if checkpoint is None:
    raise SystemExit(
        f"no valid checkpoint in {ctx.checkpoint_dir}; train first, or point TUNEPOD_CHECKPOINT_DIR at one"
    )

# The architecture of train.py's build_model, sized by the hyperparameters saved with the weights.
config = checkpoint.state["model_config"]
model = nn.Sequential(
    nn.Linear(config["in_features"], config["hidden"]),
    nn.ReLU(),
    nn.Linear(config["hidden"], config["num_classes"]),
)
model.load_state_dict(checkpoint.state["model"])
model.eval()

test = np.load(ctx.data_dir / "test.npz")
x, y = torch.from_numpy(test["x"]), torch.from_numpy(test["y"])
with torch.no_grad():
    test_accuracy = (model(x).argmax(dim=1) == y).float().mean().item()

print(f"{checkpoint.path}: test_accuracy {test_accuracy:.4f} on {len(y)} images", flush=True)
ctx.finish(test_accuracy=test_accuracy)
