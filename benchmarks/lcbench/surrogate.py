"""The LCBench surrogate of YAHPO Gym 1.0.2, queried with onnxruntime directly (no yahpo-gym).

yahpo-gym pins ``configspace<=0.6.1``, which the peers' ConfigSpace 1.x breaks, so this module encodes
the inputs itself, as yahpo-gym 1.0.2 does (``BenchmarkSet._config_to_xs``; the scenario's names from
``yahpo_gym/benchmarks/lcbench.py``):

- ``x_cat`` (int32, one column): the instance's code in ``encoding.json``;
- ``x_cont`` (float32, eight columns): the raw values in ``CONTINUOUS_INPUTS`` order. No log or other
  transform is applied outside the model: the ONNX graph scales its inputs and outputs itself.
- the output's six columns are ``TARGETS`` in that order, on their original scales (accuracies in
  percent, cross-entropies, ``time`` in seconds since the start of training).

The model was checked against yahpo-gym 1.0.2 itself (``tests/unit/test_lcbench_surrogate.py`` holds
reference values it computed). One query row costs ~20 microseconds, so a whole 52-epoch curve is one
call of 52 rows, and many curves are one call.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

DATA_DIR = Path(__file__).parent / "data"
NUM_EPOCHS = 52
INSTANCE_PARAM = "OpenML_task_id"
FIDELITY_PARAM = "epoch"
# The model's x_cont columns, in yahpo-gym 1.0.2's cont_names order.
CONTINUOUS_INPUTS = (
    "epoch",
    "batch_size",
    "learning_rate",
    "momentum",
    "weight_decay",
    "num_layers",
    "max_units",
    "max_dropout",
)
# The model's output columns, in yahpo-gym 1.0.2's y_names order.
TARGETS = (
    "time",
    "val_accuracy",
    "val_cross_entropy",
    "val_balanced_accuracy",
    "test_cross_entropy",
    "test_balanced_accuracy",
)
Config = Mapping[str, float]


@dataclass(frozen=True)
class Param:
    """One hyperparameter of the search space, as config_space.json defines it."""

    name: str
    low: float
    high: float
    log: bool
    integer: bool

    def sample(self, rng: np.random.Generator, size: int) -> np.ndarray:
        """``size`` values drawn uniformly (in log space when ``log``). Integers are drawn as ConfigSpace
        draws them, over [low - 0.5, high + 0.5] then rounded, so that the end values are as likely as
        the others."""
        low, high = (self.low - 0.5, self.high + 0.5) if self.integer else (self.low, self.high)
        if self.log:
            values = np.exp(rng.uniform(math.log(low), math.log(high), size))
        else:
            values = rng.uniform(low, high, size)
        # Clipped: exp(log(x)) can land an ulp outside the bounds, which yahpo-gym's check refuses.
        return np.clip(np.round(values) if self.integer else values, self.low, self.high)


@dataclass(frozen=True)
class Curves:
    """Learning curves of ``n`` configurations over epochs 1..52: each array is ``(n, 52)``; column k is
    epoch k + 1. ``time`` is cumulative training seconds up to the end of that epoch (on LCBench's
    original hardware), made non-decreasing (see ``Lcbench.curves``)."""

    val_accuracy: np.ndarray
    val_balanced_accuracy: np.ndarray
    val_cross_entropy: np.ndarray
    time: np.ndarray


class Lcbench:
    """The surrogate: its instances, its 7-parameter search space and learning curves.

    Not thread-safe to share across processes; one per process (the ONNX session is loaded once).
    """

    def __init__(self, data_dir: Path = DATA_DIR, num_threads: int = 1) -> None:
        import onnxruntime  # an optional dependency: pip install 'tunepod[bench]'

        options = onnxruntime.SessionOptions()
        # One thread: the harness runs arms in parallel processes; more threads only contend.
        options.intra_op_num_threads = num_threads
        options.inter_op_num_threads = 1
        self._session = onnxruntime.InferenceSession(
            str(data_dir / "model.onnx"), sess_options=options, providers=["CPUExecutionProvider"]
        )
        self._codes: dict[str, int] = json.loads((data_dir / "encoding.json").read_text())[INSTANCE_PARAM]
        space = json.loads((data_dir / "config_space.json").read_text())["hyperparameters"]
        self.instances: tuple[str, ...] = tuple(
            next(hp["choices"] for hp in space if hp["name"] == INSTANCE_PARAM)
        )
        self.space: tuple[Param, ...] = tuple(
            Param(hp["name"], hp["lower"], hp["upper"], hp["log"], hp["type"] == "uniform_int")
            for hp in space
            if hp["name"] not in (INSTANCE_PARAM, FIDELITY_PARAM)
        )

    def sample(self, rng: np.random.Generator, size: int) -> list[dict[str, float]]:
        """``size`` configurations drawn uniformly from the space (log-uniform where the space says)."""
        columns = {param.name: param.sample(rng, size) for param in self.space}
        return [{name: float(values[i]) for name, values in columns.items()} for i in range(size)]

    def query(self, instance: str, configs: Sequence[Config], epochs: Sequence[int]) -> np.ndarray:
        """The raw model: ``(len(configs), len(epochs), len(TARGETS))`` for every config at every epoch,
        in one ONNX call."""
        x_cont = self.encode(configs, epochs)
        x_cat = np.full((len(x_cont), 1), self.code(instance), dtype=np.int32)
        (output,) = self._session.run(None, {"x_cat": x_cat, "x_cont": x_cont})
        return np.asarray(output).reshape(len(configs), len(epochs), len(TARGETS))

    def curves(self, instance: str, configs: Sequence[Config]) -> Curves:
        """Every config's curves over epochs 1..52. The surrogate's ``time`` dips by a fraction of a
        second between neighbouring epochs in ~0.2% of cases (a regression model, not a clock); it is
        made non-decreasing so that a simulated epoch never ends before the one before it."""
        output = self.query(instance, configs, range(1, NUM_EPOCHS + 1))
        column = {name: output[:, :, index] for index, name in enumerate(TARGETS)}
        return Curves(
            val_accuracy=column["val_accuracy"],
            val_balanced_accuracy=column["val_balanced_accuracy"],
            val_cross_entropy=column["val_cross_entropy"],
            time=np.maximum.accumulate(column["time"], axis=1),
        )

    def curve(self, instance: str, config: Config) -> Curves:
        """One config's curves (arrays of shape ``(1, 52)``)."""
        return self.curves(instance, [config])

    def code(self, instance: str) -> int:
        if instance not in self.instances:
            raise ValueError(f"unknown LCBench instance {instance!r}; valid: {', '.join(self.instances)}")
        return self._codes[instance]

    def encode(self, configs: Sequence[Config], epochs: Sequence[int]) -> np.ndarray:
        """``x_cont``: one row per (config, epoch), configs outer, float32. Integer parameters are
        rounded (yahpo-gym refuses non-integers; the peers' samplers may hand over floats)."""
        names = [param.name for param in self.space]
        missing = [sorted(set(names) - set(config)) for config in configs]
        if any(missing):
            raise ValueError(f"configuration without {next(m for m in missing if m)}: {configs}")
        values = np.array([[float(config[name]) for name in names] for config in configs], dtype=np.float64)
        for index, param in enumerate(self.space):
            if param.integer:
                values[:, index] = np.round(values[:, index])
        by_name = dict(zip(names, values.T, strict=True))
        fidelity = np.asarray(epochs, dtype=np.float64)
        rows = len(configs) * len(fidelity)
        columns = [
            np.tile(fidelity, len(configs))
            if name == FIDELITY_PARAM
            else np.repeat(by_name[name], len(fidelity))
            for name in CONTINUOUS_INPUTS
        ]
        return np.stack(columns, axis=1).astype(np.float32).reshape(rows, len(CONTINUOUS_INPUTS))
