"""The training image of a SageMaker job: the spec's ``image_uri``, or the SageMaker PyTorch training image
of ``framework_version`` looked up by the SageMaker Python SDK (``sagemaker.core.image_uris``, from the
image table it ships: no AWS call) for the region and the job's instance type (CPU or GPU image).

A job with tensor parallelism or hybrid sharding runs under SMP v2 (its ``mp_parameters``), which only
the SMP image has (``smdistributed-modelparallel``): for such a job the lookup is the SDK's own for
an estimator whose ``distribution`` turns ``smdistributed.modelparallel`` on, which switches to
``pytorch-smp`` and picks its CUDA build. An explicit ``image_uri`` is taken as it is (the spec
refuses SageMaker's plain PyTorch image for a spec that needs SMP: ``tunepod.spec.models``).

The SDK's import takes seconds: it happens only for a spec that names ``framework_version``, once.
"""

from __future__ import annotations

import functools
import re
from typing import Any

from tunepod.errors import TunepodError
from tunepod.launch.refusals import refuse
from tunepod.spec.models import SageMakerLauncherSpec

FRAMEWORK = "pytorch"
_NOT_INSTALLED = (
    "launcher.framework_version needs the SageMaker Python SDK to find the image; "
    "fix: pip install 'tunepod[aws]', or set launcher.image_uri to the image's ECR URI"
)


SMP_DISTRIBUTION = {
    "torch_distributed": {"enabled": True},
    "smdistributed": {"modelparallel": {"enabled": True}},
}
"""An estimator's ``distribution`` with SMP v2 on, as the SDK's image lookup reads it."""


def training_image(
    spec: SageMakerLauncherSpec, instance_type: str, region: str | None, *, smp: bool = False
) -> str:
    """The image the jobs of ``spec`` on ``instance_type`` in ``region`` run; ``smp``: the job runs
    under SMP v2 (tensor parallelism). Raises ``TunepodError`` naming the field when the SDK knows no
    such image (its message lists what exists)."""
    if spec.image_uri is not None:
        return spec.image_uri
    assert spec.framework_version is not None, "the spec validates one of image_uri, framework_version"
    if region is None:
        refuse(
            "launcher.framework_version: the image's registry depends on the region, and none is set; "
            "fix: set launcher.region (or AWS_REGION), or set launcher.image_uri"
        )
        return f"<the {FRAMEWORK} {spec.framework_version} training image of launcher.region>"
    if smp:
        return _lookup_smp(spec.framework_version, spec.py_version, region, instance_type)
    return _lookup(spec.framework_version, spec.py_version, region, instance_type)


@functools.cache
def _lookup_smp(version: str, py_version: str | None, region: str, instance_type: str) -> str:
    image_uris = _image_uris()
    try:
        python = py_version or _newest_python(image_uris.list_py_versions("pytorch-smp", version, "training"))
        return str(
            image_uris.get_training_image_uri(
                region,
                FRAMEWORK,
                framework_version=version,
                py_version=python,
                instance_type=instance_type,
                distribution=SMP_DISTRIBUTION,
            )
        )
    except (ValueError, KeyError) as exc:
        if "processor" in str(exc).lower():
            raise TunepodError(
                f"tensor parallelism on SageMaker runs under SMP v2, whose images are GPU only, and "
                f"{instance_type} has no GPU; fix: set resources.instance_type to a GPU instance (ml.p4d, "
                "ml.p5, ml.g5 ...), or drop the tensor parallelism"
            ) from None
        known = sorted(set(image_uris.list_versions("pytorch-smp", "training")), key=_version_key)
        raise TunepodError(
            f"launcher.framework_version: tensor parallelism on SageMaker runs under SMP v2, and the SDK "
            f"knows no SMP v2 image for PyTorch {version} ({exc}); fix: set framework_version to one of "
            f"{', '.join(known)}, or set launcher.image_uri to an SMP v2 image"
        ) from None


def _image_uris() -> Any:
    try:
        from sagemaker.core import image_uris
    except ImportError:
        raise TunepodError(_NOT_INSTALLED) from None
    return image_uris


@functools.cache
def _lookup(version: str, py_version: str | None, region: str, instance_type: str) -> str:
    image_uris = _image_uris()
    try:
        python = py_version or _newest_python(image_uris.list_py_versions(FRAMEWORK, version, "training"))
        return str(
            image_uris.retrieve(
                framework=FRAMEWORK,
                region=region,
                version=version,
                py_version=python,
                instance_type=instance_type,
                image_scope="training",
            )
        )
    except (ValueError, KeyError) as exc:
        if py_version and "python version" in str(exc).lower():
            known = image_uris.list_py_versions(FRAMEWORK, version, "training")
            raise TunepodError(
                f"launcher.py_version: PyTorch {version}'s SageMaker training images ship "
                f"{', '.join(known)}, not {py_version}; fix: set one of those, or leave py_version out"
            ) from None
        newest = sorted(set(image_uris.list_versions(FRAMEWORK, "training")), key=_version_key)[-6:]
        raise TunepodError(
            f"launcher.framework_version: no SageMaker PyTorch training image for {version} on "
            f"{instance_type} in {region}; fix: pick a version the SDK lists (the newest: "
            f"{', '.join(newest)}), or set launcher.image_uri"
        ) from None


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version))


def _newest_python(versions: list[str]) -> str:
    if not versions:
        raise ValueError("no Python versions listed")
    return max(versions, key=lambda v: int(re.sub(r"\D", "", v) or 0))
