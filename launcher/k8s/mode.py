"""Kubernetes mode of ``elastic-run run``: the launcher runs in a pod and workers are pods.

``elastic-run run --kubernetes --worker-template FILE --etcd ... -- python train.py`` leads the
job as usual, but its provisioner is :class:`~launcher.k8s.provisioner.KubernetesProvisioner`
and its membership changes become Events on its own pod
(:class:`~launcher.k8s.events.EventRecorder`). The launcher reads its own pod from the
environment that the launcher's manifest sets through the downward API:

- ``ELASTIC_ALLREDUCE_POD_NAME`` / ``ELASTIC_ALLREDUCE_POD_UID``: owner of the worker pods
  (garbage-collected with it) and the object the Events are about;
- ``ELASTIC_ALLREDUCE_POD_IP``: where workers reach its rendezvous server (default 127.0.0.1);
- ``ELASTIC_ALLREDUCE_NAMESPACE``: the namespace of the worker pods (or ``--namespace``).

The API is reached through ``--kube-api URL`` / ``ELASTIC_ALLREDUCE_KUBE_API`` when given (a
``kubectl proxy``, tests), else the in-cluster service account or the kubeconfig
(:func:`launcher.k8s.client.connect`).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elastic_allreduce import env
from launcher.k8s.client import LAUNCHER_RBAC_ADVICE, connect
from launcher.k8s.errors import KubernetesConfigError
from launcher.k8s.events import EventRecorder
from launcher.k8s.provisioner import KubernetesProvisioner, KubernetesSettings
from launcher.launcher import JobResult, Launcher, LaunchSettings
from launcher.observe.observer import JobObserver


@dataclass(frozen=True)
class KubernetesMode:
    """Where the launcher runs and what its worker pods are made from."""

    namespace: str
    worker_template: dict[str, Any]
    pod_name: str | None
    pod_uid: str | None
    pod_ip: str
    kube_api: str | None
    #: The job's --gpus-per-node: each worker pod's nvidia.com/gpu (None: the template's).
    gpus_per_node: int | None = None

    @classmethod
    def from_environment(
        cls,
        template_file: str | None,
        namespace: str | None,
        kube_api: str | None,
        gpus_per_node: int | None = None,
    ) -> KubernetesMode:
        """The mode from ``run``'s flags and the pod's environment (ConfigError if unusable)."""
        if not template_file:
            raise KubernetesConfigError(
                "--kubernetes needs --worker-template FILE: a Pod manifest (YAML or JSON) whose "
                "first container runs `elastic-run join` (k8s/ has one)"
            )
        return cls(
            namespace=namespace or os.environ.get(env.NAMESPACE) or "default",
            worker_template=load_template(template_file),
            pod_name=os.environ.get(env.POD_NAME) or None,
            pod_uid=os.environ.get(env.POD_UID) or None,
            pod_ip=os.environ.get(env.POD_IP) or "127.0.0.1",
            kube_api=kube_api or os.environ.get(env.KUBE_API) or None,
            gpus_per_node=gpus_per_node,
        )


def load_template(path: str) -> dict[str, Any]:
    """A worker Pod manifest from a YAML or JSON file (KubernetesConfigError saying what is
    wrong)."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise KubernetesConfigError(f"cannot read the worker template {path!r}: {exc}") from exc
    try:
        if path.endswith(".json"):
            document = json.loads(text)
        else:
            yaml: Any = importlib.import_module("yaml")
            documents = [d for d in yaml.safe_load_all(text) if d is not None]
            if len(documents) != 1:
                raise KubernetesConfigError(
                    f"the worker template {path!r} must hold one Pod manifest, "
                    f"found {len(documents)} documents"
                )
            document = documents[0]
    except KubernetesConfigError:
        raise
    except Exception as exc:  # json.JSONDecodeError, yaml.YAMLError
        raise KubernetesConfigError(
            f"the worker template {path!r} is not valid YAML/JSON: {exc}"
        ) from exc
    if not isinstance(document, dict) or document.get("kind", "Pod") != "Pod":
        kind = document.get("kind") if isinstance(document, dict) else type(document).__name__
        raise KubernetesConfigError(
            f"the worker template {path!r} must be a Pod manifest (kind: Pod), got {kind!r}"
        )
    return document


def run_job(
    settings: LaunchSettings, mode: KubernetesMode, observer: JobObserver | None = None
) -> JobResult:
    """Lead the job with worker pods; Events on the launcher's pod when it is known."""
    with contextlib.ExitStack() as stack:
        kube = stack.enter_context(connect(url=mode.kube_api, rbac_advice=LAUNCHER_RBAC_ADVICE))
        provisioner = KubernetesProvisioner(
            KubernetesSettings(
                namespace=mode.namespace,
                job_id=settings.job_id,
                etcd=settings.etcd,
                worker_template=mode.worker_template,
                launcher_pod_name=mode.pod_name,
                launcher_pod_uid=mode.pod_uid,
                gpus_per_node=mode.gpus_per_node,
            ),
            kube,
        )
        recorder = None
        if mode.pod_name:
            recorder = EventRecorder(
                kube, mode.namespace, mode.pod_name, mode.pod_uid, settings.job_id
            )
            stack.callback(recorder.close)
        return Launcher(settings, provisioner, on_event=recorder, observer=observer).run()
