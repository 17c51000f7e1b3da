"""`framework_version`: the SageMaker PyTorch training image looked up by the SageMaker Python SDK (its
shipped image tables, the real `sagemaker.core.image_uris`; no AWS call), and each documented refusal."""

from __future__ import annotations

import builtins
from typing import Any

import pytest
from pydantic import ValidationError
from test_sagemaker_render import FSX, job, spec

from tunepod.errors import TunepodError
from tunepod.launch.sagemaker import images
from tunepod.launch.sagemaker.images import training_image
from tunepod.launch.sagemaker.render import render_training_job
from tunepod.spec.resources import Resources

ECR = "763104351884.dkr.ecr"


def by_version(**fields: Any) -> Any:
    return spec(image_uri=None, framework_version="2.5", **fields)


def test_a_framework_version_renders_the_gpu_or_cpu_image_of_the_jobs_instance_type() -> None:
    launcher = by_version(region="us-west-2", **FSX)
    gpu = render_training_job(job(), launcher)  # the spec's ml.g5.xlarge
    assert (
        gpu["AlgorithmSpecification"]["TrainingImage"]
        == f"{ECR}.us-west-2.amazonaws.com/pytorch-training:2.5-gpu-py311"
    )
    cpu = render_training_job(job(resources=Resources(instance_type="ml.m5.xlarge")), launcher)
    assert (
        cpu["AlgorithmSpecification"]["TrainingImage"]
        == f"{ECR}.us-west-2.amazonaws.com/pytorch-training:2.5-cpu-py311"
    )


def test_the_region_comes_from_the_launcher_when_the_spec_names_none() -> None:
    image = training_image(by_version(), "ml.m5.xlarge", "eu-west-1")
    assert image == f"{ECR}.eu-west-1.amazonaws.com/pytorch-training:2.5-cpu-py311"


def test_an_image_uri_is_used_as_given_without_the_sdk() -> None:
    assert training_image(spec(), "ml.g5.xlarge", None) == spec().image_uri


def test_an_unknown_framework_version_names_the_field_and_the_newest_versions() -> None:
    with pytest.raises(
        TunepodError, match=r"launcher.framework_version: no SageMaker PyTorch training image for 9.9"
    ) as raised:
        training_image(spec(image_uri=None, framework_version="9.9"), "ml.m5.xlarge", "us-east-1")
    assert "the newest: 2." in str(raised.value) and "or set launcher.image_uri" in str(raised.value)


def test_a_python_the_version_does_not_ship_names_the_ones_it_does() -> None:
    with pytest.raises(
        TunepodError,
        match=r"launcher.py_version: PyTorch 2.5's SageMaker training images ship py311, not py39",
    ):
        training_image(by_version(py_version="py39"), "ml.m5.xlarge", "us-east-1")


def test_no_region_anywhere_is_refused_with_the_fix() -> None:
    with pytest.raises(
        TunepodError, match=r"launcher.framework_version: .*none is set; fix: set launcher.region"
    ):
        training_image(by_version(), "ml.m5.xlarge", None)


def test_the_spec_takes_exactly_one_image_setting() -> None:
    with pytest.raises(ValidationError, match=r"the jobs need a training image; fix: set framework_version"):
        spec(image_uri=None)
    with pytest.raises(
        ValidationError, match=r"name the training image once; fix: set image_uri .* not both"
    ):
        spec(framework_version="2.5")
    with pytest.raises(ValidationError, match=r"py_version picks among framework_version's images"):
        spec(py_version="py311")


def test_without_the_sdk_the_error_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    # Stand-in: the SDK is installed here, so its absence is simulated by refusing its import in-process.
    real_import = builtins.__import__

    def refuse_sagemaker(name: str, *args: Any, **kwargs: Any) -> Any:
        if name.startswith("sagemaker"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", refuse_sagemaker)
    images._lookup.cache_clear()
    with pytest.raises(TunepodError, match=r"needs the SageMaker Python SDK .*pip install 'tunepod\[aws\]'"):
        training_image(spec(image_uri=None, framework_version="2.4"), "ml.m5.xlarge", "ap-south-1")
