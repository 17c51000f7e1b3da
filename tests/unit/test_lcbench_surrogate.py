"""The LCBench surrogate (benchmarks/lcbench/surrogate.py) encodes its inputs as yahpo-gym 1.0.2 does.

The expected values below were computed once with yahpo-gym 1.0.2 itself (ConfigSpace 0.6.1,
onnxruntime 1.32.0, in a throwaway venv: ``BenchmarkSet("lcbench").objective_function`` on one
configuration at a time), for configurations drawn at random; this module has no yahpo-gym.
yahpo-gym and this encoder agreed exactly on 600 such queries (50 configurations x 4 epochs x 3
instances); batched calls differ from one-row calls by float32 rounding (<= 4e-6 relative on the
accuracies), in yahpo-gym as here.
"""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.lcbench.surrogate import NUM_EPOCHS, Lcbench

PARAMS = ("batch_size", "learning_rate", "max_dropout", "max_units", "momentum", "num_layers", "weight_decay")
# (instance, epoch, the configuration in PARAMS order, val_accuracy, time, val_cross_entropy), from yahpo-gym.
# fmt: off
YAHPO_REFERENCE = [
    ("3945", 1, (169, 0.00024158555805789143, 0.5592496771336655, 66, 0.7918628157988544, 3, 0.027634582417187508), 38.48176956176758, 12.118091583251953, 0.6278791427612305),  # noqa: E501
    ("3945", 52, (19, 0.0005924988540678515, 0.4288062533520195, 168, 0.30427814782844964, 4, 0.055368923039197736), 98.6085433959961, 196.93702697753906, 0.3581307530403137),  # noqa: E501
    ("3945", 26, (277, 0.004991915887437519, 0.24374510457040732, 143, 0.42524044744999556, 2, 0.03850532133947384), 77.9448013305664, 91.31565856933594, 0.46321922540664673),  # noqa: E501
    ("3945", 7, (16, 0.0029184448686193553, 0.1450244515513366, 228, 0.9478579560503043, 5, 0.051029824878755674), 99.13658142089844, 58.28901290893555, 0.2416236698627472),  # noqa: E501
    ("146212", 52, (39, 0.0012302338002890807, 0.5882068026622195, 734, 0.5779570116111175, 1, 0.055275421460680714), 90.12347412109375, 43.497859954833984, 0.6553835868835449),  # noqa: E501
    ("146212", 26, (20, 0.0001239141247343346, 0.37304607653640265, 876, 0.639046715902925, 3, 0.07047101631282199), 95.43477630615234, 188.20486450195312, 0.3214447796344757),  # noqa: E501
    ("146212", 26, (138, 0.011831211418530703, 0.6318117418696196, 207, 0.5267814107490498, 1, 0.03096222677135824), 86.79463958740234, 28.60073471069336, 0.753819465637207),  # noqa: E501
    ("189862", 52, (142, 0.0019375284866766753, 0.751641513908164, 198, 0.3871654335623139, 1, 0.09390529767555394), 76.0904312133789, 45.95631408691406, 0.4862629175186157),  # noqa: E501
    ("189862", 52, (16, 0.001152389792429935, 0.4775278098845357, 185, 0.3316402523324573, 5, 0.07125535096543192), 75.88056945800781, 98.49439239501953, 0.6094739437103271),  # noqa: E501
    ("189862", 52, (90, 0.0005615521144668646, 0.8899712799867525, 243, 0.27715739182060595, 4, 0.08640309592332363), 53.15860366821289, 113.92559814453125, 0.6264055371284485),  # noqa: E501
]
# fmt: on


@pytest.fixture(scope="module")
def lcbench() -> Lcbench:
    return Lcbench()


def config_of(values: tuple[float, ...]) -> dict[str, float]:
    return dict(zip(PARAMS, values, strict=True))


@pytest.mark.parametrize(
    ("instance", "epoch", "values", "accuracy", "time_s", "cross_entropy"), YAHPO_REFERENCE
)
def test_one_query_matches_yahpo_gym(
    lcbench: Lcbench,
    instance: str,
    epoch: int,
    values: tuple[float, ...],
    accuracy: float,
    time_s: float,
    cross_entropy: float,
) -> None:
    (row,) = lcbench.query(instance, [config_of(values)], [epoch])[0]
    assert row[1] == pytest.approx(accuracy, rel=1e-5)
    assert row[0] == pytest.approx(time_s, rel=1e-5)
    assert row[2] == pytest.approx(cross_entropy, rel=1e-5)


def test_batched_curves_match_one_row_queries(lcbench: Lcbench) -> None:
    configs = [config_of(row[2]) for row in YAHPO_REFERENCE[:3]]
    curves = lcbench.curves("3945", configs)
    assert curves.val_accuracy.shape == curves.time.shape == (3, NUM_EPOCHS)
    for index, config in enumerate(configs):
        for epoch in (1, 26, 52):
            single = lcbench.query("3945", [config], [epoch])[0, 0, 1]
            assert curves.val_accuracy[index, epoch - 1] == pytest.approx(single, rel=1e-5)
    assert np.all(np.diff(curves.time, axis=1) >= 0)


def test_samples_lie_in_the_space(lcbench: Lcbench) -> None:
    configs = lcbench.sample(np.random.default_rng(0), 500)
    for param in lcbench.space:
        values = np.array([config[param.name] for config in configs])
        assert values.min() >= param.low and values.max() <= param.high
        if param.integer:
            assert np.all(values == np.round(values))
    assert len(lcbench.space) == 7 and len(lcbench.instances) == 34


def test_an_unknown_instance_lists_the_valid_ones(lcbench: Lcbench) -> None:
    with pytest.raises(ValueError, match="valid: 3945, 7593"):
        lcbench.curves("1", [config_of(YAHPO_REFERENCE[0][2])])
