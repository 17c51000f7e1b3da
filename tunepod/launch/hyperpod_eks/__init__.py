"""The HyperPod EKS launcher: jobs as ``HyperPodPyTorchJob`` (or Kubeflow ``PyTorchJob``) objects.

``render.py`` builds the object (pure), ``states.py`` maps what the API says onto ``JobState``,
``api.py`` holds the Kubernetes calls, ``pods.py`` reads the pods' logs and exit codes, and
``launcher.py`` fills in the hooks of ``tunepod.launch.base.LauncherBase``.
"""

from tunepod.launch.hyperpod_eks.api import CRDS, Crd, KubeApi, ObjectRef, kube_api_client, parse_job_id
from tunepod.launch.hyperpod_eks.launcher import MANIFEST_NAME, HyperPodEksLauncher
from tunepod.launch.hyperpod_eks.render import (
    HYPERPOD_PLURAL,
    KUBEFLOW_PLURAL,
    MAX_NAME_LENGTH,
    SUBMISSION_ANNOTATION,
    container_env,
    format_cpu,
    format_memory,
    ignored_settings,
    literal,
    object_name,
    render_manifest,
)
from tunepod.launch.hyperpod_eks.states import ObjectStatus, state_from_conditions

__all__ = [
    "CRDS",
    "HYPERPOD_PLURAL",
    "KUBEFLOW_PLURAL",
    "MANIFEST_NAME",
    "MAX_NAME_LENGTH",
    "SUBMISSION_ANNOTATION",
    "Crd",
    "HyperPodEksLauncher",
    "KubeApi",
    "ObjectRef",
    "ObjectStatus",
    "container_env",
    "format_cpu",
    "format_memory",
    "ignored_settings",
    "kube_api_client",
    "literal",
    "object_name",
    "parse_job_id",
    "render_manifest",
    "state_from_conditions",
]
