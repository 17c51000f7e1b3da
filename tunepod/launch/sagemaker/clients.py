"""boto3 clients, and their failures as tunepod errors.

botocore stays an optional dependency (the ``aws`` extra): its exceptions are recognised by shape
(``response["Error"]["Code"]``) and by class name, never imported.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tunepod.errors import JobError, TransientError, TunepodError

INSTALL_HINT = "pip install 'tunepod[aws]'"

# Error codes a later call may not meet: throttling, and AWS's own faults (which, for a create, leave
# the outcome unknown: the job may exist).
_TRANSIENT_CODES = frozenset(
    {
        "ThrottlingException",
        "Throttling",
        "ServiceUnavailable",
        "InternalFailure",
        "InternalServerError",
        "RequestTimeout",
        "RequestTimeoutException",
    }
)
# botocore's network failures (its ConnectionError and HTTPClientError families), once its own
# retries are spent: the request may or may not have reached AWS.
_TRANSIENT_CLASSES = frozenset(
    {
        "HTTPClientError",
        "ConnectionError",
        "EndpointConnectionError",
        "ConnectTimeoutError",
        "ReadTimeoutError",
    }
)


def sagemaker_client(region: str | None) -> Any:
    """A boto3 SageMaker client; raises ``TunepodError`` naming the extra when boto3 is missing."""
    return aws_client("sagemaker", region)


def aws_client(service: str, region: str | None) -> Any:
    """A boto3 client for ``service``; raises ``TunepodError`` naming the extra when boto3 is missing.

    boto3 applies its usual configuration, ``AWS_ENDPOINT_URL_<SERVICE>`` variables included.
    """
    boto3 = _boto3()
    try:
        session = boto3.session.Session()
        chosen = region or session.region_name
        if chosen is not None:
            return session.client(service, region_name=chosen)
    except Exception as exc:  # botocore's configuration errors: a profile that does not exist, ...
        raise TunepodError(
            f"cannot make an AWS {service} client: {type(exc).__name__}: {exc}; fix: check AWS_PROFILE "
            "and ~/.aws/config (aws configure list shows what boto3 reads)"
        ) from None
    raise TunepodError(
        f"the sagemaker launcher calls AWS ({service}) in a region, and none is set; fix: set "
        "launcher.region (e.g. us-west-2), or AWS_REGION in the environment"
    )


def configured_region() -> str | None:
    """The region boto3's own configuration names (``AWS_REGION``, ``AWS_DEFAULT_REGION``, the profile
    in ``~/.aws/config``), read without making a client; None when there is none, when boto3 is
    missing, or when its configuration cannot be read (making a client then says why)."""
    try:
        return _boto3().session.Session().region_name  # type: ignore[no-any-return]
    except Exception:
        return None


def _boto3() -> Any:
    try:
        import boto3  # type: ignore[import-untyped]
    except ImportError as exc:
        raise TunepodError(f"the sagemaker launcher needs boto3; fix: {INSTALL_HINT}") from exc
    return boto3


def error_code(exc: BaseException) -> str | None:
    """The AWS error code of a botocore ``ClientError``, or None for any other exception."""
    error = _error(exc)
    return str(error.get("Code", "")) or None


def is_not_found(exc: BaseException) -> bool:
    """Whether a Describe call failed because the resource does not exist. SageMaker answers
    ``ValidationException: Requested resource not found.`` (moto: ``Could not find ...``)."""
    code = error_code(exc)
    if code in ("ResourceNotFound", "ResourceNotFoundException"):
        return True
    message = str(_error(exc).get("Message", "")).lower()
    return code == "ValidationException" and ("not found" in message or "could not find" in message)


def aws_error(exc: Exception, doing: str) -> TunepodError:
    """A boto3 failure as a tunepod error: ``TransientError`` when a retry may help, else ``JobError``."""
    names = {cls.__name__ for cls in type(exc).__mro__}
    if error_code(exc) in _TRANSIENT_CODES or names & _TRANSIENT_CLASSES:
        return TransientError(f"could not {doing}: {exc}")
    return JobError(f"could not {doing}: {exc}")


def _error(exc: BaseException) -> Mapping[str, Any]:
    response = getattr(exc, "response", None)
    error = response.get("Error") if isinstance(response, Mapping) else None
    return error if isinstance(error, Mapping) else {}
