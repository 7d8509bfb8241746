"""Kubernetes mode of ``elastic-run run``: the launcher runs in a pod and workers are pods.

``elastic-run run --kubernetes --worker-template FILE --etcd ... -- python train.py`` leads the
job as usual, but its provisioner is :class:`~launcher.k8s.provisioner.KubernetesProvisioner`
and its membership changes become Events on its own pod
(:class:`~launcher.k8s.events.EventRecorder`). The launcher reads its own pod from the
environment that the launcher's manifest sets through the downward API:

- ``ELASTIC_ALLREDUCE_POD_NAME`` / ``ELASTIC_ALLREDUCE_POD_UID``: the object the Events are
  about, and where the launcher finds its Job (the pod's controller, read from the API: the
  owner of the worker pods, so that a pod that replaces this one adopts them and deleting the
  Job deletes them; a pod without a Job owns them itself);
- ``ELASTIC_ALLREDUCE_POD_IP``: where workers reach its rendezvous server (default 127.0.0.1);
- ``ELASTIC_ALLREDUCE_NAMESPACE``: the namespace of the worker pods (or ``--namespace``).

The API is reached through ``--kube-api URL`` / ``ELASTIC_ALLREDUCE_KUBE_API`` when given (a
``kubectl proxy``, tests), else the in-cluster service account or the kubeconfig
(:func:`launcher.k8s.client.connect`).

A launcher pod is one of a series (the launcher Job restarts it: docs/kubernetes.md): it stands
by while an earlier pod's launcher still holds the job's leader key (a SIGKILLed or OOM-killed
predecessor's lease has not lapsed yet), then leads or adopts the job; SIGTERM (a drain, an
eviction, ``kubectl delete pod``) hands the job over to the next pod, exit code 5, leaving the
worker pods running.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from elastic_allreduce import env
from launcher.k8s.client import KINDS, LAUNCHER_RBAC_ADVICE, Kube, connect
from launcher.k8s.errors import KubernetesApiError, KubernetesConfigError
from launcher.k8s.events import EventRecorder
from launcher.k8s.provisioner import KubernetesProvisioner, KubernetesSettings
from launcher.k8s.retry import retrying
from launcher.leader.job import JobResult, Launcher, LaunchSettings
from launcher.observe.observer import JobObserver

log = logging.getLogger(__name__)

#: Seconds an Event (a membership change on the launcher's pod) is retried at most.
EVENT_DEADLINE: Final = 60.0


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


def launcher_job(
    kube: Kube, namespace: str, pod_name: str, pod_uid: str | None, deadline: float
) -> tuple[str, str] | None:
    """The name and uid of the Job that runs the launcher's pod (its controller), read from
    the pod's ownerReferences; None for a pod that no Job runs (written by hand), or that the
    launcher may not read (said in a warning: the pod then owns the worker pods)."""
    try:
        pod = retrying(
            lambda: kube.get(KINDS["Pod"], pod_name, namespace),
            what=f"get its own pod {pod_name!r} in namespace {namespace!r}",
            deadline=deadline,
        )
    except KubernetesApiError as exc:
        if exc.status not in (401, 403):
            raise
        log.warning(
            "cannot read the launcher's own pod %s to find its Job (%s): the worker pods are "
            "owned by this pod, so a launcher pod that replaces it cannot adopt them; the "
            "launcher's Role needs get on pods",
            pod_name,
            exc,
        )
        return None
    metadata = (pod or {}).get("metadata") or {}
    if pod is None or (pod_uid and metadata.get("uid") != pod_uid):
        log.warning(
            "the launcher's pod %s (uid %s) is not in namespace %r: the worker pods are "
            "owned by the pod named in %s and %s",
            pod_name,
            pod_uid,
            namespace,
            env.POD_NAME,
            env.POD_UID,
        )
        return None
    for reference in metadata.get("ownerReferences") or []:
        if (
            reference.get("kind") == "Job"
            and reference.get("apiVersion") == "batch/v1"
            and reference.get("controller")
            and reference.get("name")
            and reference.get("uid")
        ):
            return str(reference["name"]), str(reference["uid"])
    log.warning(
        "the launcher's pod %s is not run by a Job: its worker pods are owned by the pod itself "
        "and garbage-collected with it, and no launcher pod that replaces it can adopt them "
        "(run the launcher as a Job, as `elastic-run k8s render` writes it, for that)",
        pod_name,
    )
    return None


def run_job(
    settings: LaunchSettings, mode: KubernetesMode, observer: JobObserver | None = None
) -> JobResult:
    """Lead the job with worker pods, owned by the launcher's Job (else its pod); Events on the
    launcher's pod when it is known. A launcher that finds the job led by another waits for
    it to go (a predecessor pod's lease), and SIGTERM hands the job over (see the module
    docstring)."""
    deadline = settings.job.outage_timeout
    with contextlib.ExitStack() as stack:
        kube = stack.enter_context(connect(url=mode.kube_api, rbac_advice=LAUNCHER_RBAC_ADVICE))
        job = None
        if mode.pod_name:
            job = launcher_job(kube, mode.namespace, mode.pod_name, mode.pod_uid, deadline)
        provisioner = KubernetesProvisioner(
            KubernetesSettings(
                namespace=mode.namespace,
                job_id=settings.job_id,
                etcd=settings.etcd,
                worker_template=mode.worker_template,
                launcher_pod_name=mode.pod_name,
                launcher_pod_uid=mode.pod_uid,
                launcher_job_name=job[0] if job else None,
                launcher_job_uid=job[1] if job else None,
                gpus_per_node=mode.gpus_per_node,
                api_deadline=deadline,
            ),
            kube,
        )
        recorder = None
        if mode.pod_name:
            recorder = EventRecorder(
                kube,
                mode.namespace,
                mode.pod_name,
                mode.pod_uid,
                settings.job_id,
                api_deadline=min(deadline, EVENT_DEADLINE),
            )
            stack.callback(recorder.close)
        launcher = Launcher(
            settings,
            provisioner,
            on_event=recorder,
            observer=observer,
            # The predecessor pod's lease may not have lapsed yet (SIGKILL, OOM kill).
            standby=True,
            # The launcher Job's next pod adopts the job after a drain's SIGTERM.
            hand_over_on_interrupt=True,
        )
        try:
            return launcher.run()
        except KeyboardInterrupt:
            # SIGTERM before this launcher led the job (standing by): nothing to hand over,
            # the next launcher pod takes its place.
            return JobResult(
                False, "SIGTERM before this launcher led the job: the next one takes it over", True
            )
