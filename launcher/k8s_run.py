"""Kubernetes mode of ``elastic-run run``: the launcher runs in a pod and workers are pods.

``elastic-run run --kubernetes --worker-template FILE --etcd ... -- python train.py`` leads the
job as usual, but its provisioner is :class:`~launcher.provisioners.kubernetes.
KubernetesProvisioner` and its membership changes become Events on its own pod
(:class:`~launcher.k8s_events.EventRecorder`). The launcher reads its own pod from the
environment that the launcher's manifest sets through the downward API:

- ``ELASTIC_ALLREDUCE_POD_NAME`` / ``ELASTIC_ALLREDUCE_POD_UID``: owner of the worker pods
  (garbage-collected with it) and the object the Events are about;
- ``ELASTIC_ALLREDUCE_POD_IP``: where workers reach its rendezvous server (default 127.0.0.1);
- ``ELASTIC_ALLREDUCE_NAMESPACE``: the namespace of the worker pods (or ``--namespace``).

The API is reached through ``--kube-api URL`` / ``ELASTIC_ALLREDUCE_KUBE_API`` when given (a
``kubectl proxy``, tests), else the in-cluster service account or the kubeconfig.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kubernetes

from elastic_allreduce import env
from elastic_allreduce.errors import ConfigError
from launcher.k8s_events import EventRecorder
from launcher.launcher import JobResult, Launcher, LaunchSettings
from launcher.provisioners.kubernetes import KubernetesProvisioner, KubernetesSettings


@dataclass(frozen=True)
class KubernetesMode:
    """Where the launcher runs and what its worker pods are made from."""

    namespace: str
    worker_template: dict[str, Any]
    pod_name: str | None
    pod_uid: str | None
    pod_ip: str
    kube_api: str | None
    gpus_per_node: int | None = None

    @classmethod
    def from_environment(
        cls,
        template_file: str | None,
        namespace: str | None,
        kube_api: str | None,
        gpus_per_node: int | None = None,
    ) -> KubernetesMode:
        if not template_file:
            raise ConfigError(
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
    """A worker Pod manifest from a YAML or JSON file (ConfigError saying what is wrong)."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read the worker template {path!r}: {exc}") from exc
    try:
        if path.endswith(".json"):
            document = json.loads(text)
        else:
            yaml: Any = importlib.import_module("yaml")
            documents = [d for d in yaml.safe_load_all(text) if d is not None]
            if len(documents) != 1:
                raise ConfigError(
                    f"the worker template {path!r} must hold one Pod manifest, "
                    f"found {len(documents)} documents"
                )
            document = documents[0]
    except ConfigError:
        raise
    except Exception as exc:  # json.JSONDecodeError, yaml.YAMLError
        raise ConfigError(f"the worker template {path!r} is not valid YAML/JSON: {exc}") from exc
    if not isinstance(document, dict) or document.get("kind", "Pod") != "Pod":
        kind = document.get("kind") if isinstance(document, dict) else type(document).__name__
        raise ConfigError(
            f"the worker template {path!r} must be a Pod manifest (kind: Pod), got {kind!r}"
        )
    return document


def api_client(kube_api: str | None) -> kubernetes.client.ApiClient:
    """A client for ``kube_api`` when given, else in-cluster or kubeconfig configuration."""
    if kube_api:
        configuration = kubernetes.client.Configuration()
        configuration.host = kube_api.rstrip("/")
        return kubernetes.client.ApiClient(configuration)
    from launcher.k8s.client import connect  # noqa: PLC0415 - kubeconfig only when needed

    return connect()


def run_job(settings: LaunchSettings, mode: KubernetesMode) -> JobResult:
    """Lead the job with worker pods; Events on the launcher's pod when it is known."""
    with contextlib.ExitStack() as stack:
        client = stack.enter_context(api_client(mode.kube_api))
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
            client,
        )
        recorder = None
        if mode.pod_name:
            recorder = EventRecorder(
                client, mode.namespace, mode.pod_name, mode.pod_uid, settings.job_id
            )
            stack.callback(recorder.close)
        return Launcher(settings, provisioner, on_event=recorder).run()
