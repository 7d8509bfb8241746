"""``elastic-run k8s render|submit|status|delete``: a job's manifests, applied to a cluster.

``render`` prints YAML and needs no cluster. ``submit`` applies the same objects: shared ones
(the etcd of ``--with-etcd``, the checkpoint claim of ``--with-checkpoint-claim``, the
PriorityClass of ``--with-priority-class``, the admission policy of ``--with-admission-policy``)
are created when absent and otherwise left as they are; the job's own objects are created, or
replaced when a deleted job left them behind; a job whose launcher Job exists is refused.
``status`` shows the launcher Job and the pods of a job; ``delete`` removes every object labelled
with the job id (the shared objects stay).

``render`` and ``submit`` take the job flags of ``elastic-run run`` (:mod:`launcher.job_options`)
and the flags of where and how the job runs on the cluster. Errors print one line and exit with
2 for bad input (flags, kubeconfig, a missing namespace, etcd, checkpoint claim or PriorityClass,
an unknown job: ``ConfigError``) and 3 for operational failures (the API unreachable, RBAC
refusals, conflicts).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from elastic_allreduce.errors import ConfigError, ElasticAllreduceError
from launcher import job_options
from launcher import zoo as zoo_cli
from launcher.exit_codes import exit_code
from launcher.k8s import manifests
from launcher.k8s.client import KINDS, Kind, Kube, connect, kind_of
from launcher.k8s.errors import (
    KubernetesConfigError,
    KubernetesConflictError,
    KubernetesForbiddenError,
    KubernetesNotFoundError,
)
from launcher.k8s.manifests import DEFAULT_METRICS_PORT
from launcher.k8s.naming import (
    ADMISSION_POLICY,
    CHECKPOINT_CLAIM,
    DEFAULT_NAMESPACE,
    ETCD_NAME,
    LAUNCHER_PRIORITY_CLASS,
    PRIORITY_CLASS,
    ROLE_LABEL,
    ROLE_WORKER,
    default_etcd_endpoints,
    job_selector,
    launcher_name,
)

Manifest = dict[str, Any]

#: Exit codes, as for every elastic-run command: bad input, and an operational failure.

_DESCRIPTION = """\
Run elastic jobs on Kubernetes. `render` prints a job's manifests (ServiceAccount, Role and
RoleBinding for the launcher, the workers' ServiceAccount, the worker pod template,
NetworkPolicies, the launcher Job; with --launcher-pdb the launcher's PodDisruptionBudget, with
--with-etcd the namespace's etcd, with --with-checkpoint-claim its checkpoint claim, with
--with-priority-class the cluster's PriorityClasses for workers and launchers, with
--with-admission-policy the cluster's admission policy for launchers);
`submit` applies them; `status` and `delete` act on a job by its id. The cluster comes from
--kubeconfig, $KUBECONFIG or ~/.kube/config, or the service account inside a pod.
"""

#: The job's own objects, deleted by `delete` (in this order: the launcher first).
_JOB_KINDS = (
    "Job",
    "Pod",
    "PodDisruptionBudget",
    "NetworkPolicy",
    "ConfigMap",
    "RoleBinding",
    "Role",
    "ServiceAccount",
)
#: Of those, kinds only some jobs have (`render --launcher-pdb`): a submitter who may not list
#: them gets a warning from `delete`, not an error.
_OPTIONAL_KINDS = ("PodDisruptionBudget",)
#: Objects shared by every job of a namespace (or the cluster): created if absent, never replaced.
_SHARED_KINDS = (
    "PriorityClass",
    "ValidatingAdmissionPolicy",
    "ValidatingAdmissionPolicyBinding",
    "StatefulSet",
    "Service",
    "PersistentVolumeClaim",
)


def add_parser(
    commands: argparse._SubParsersAction[argparse.ArgumentParser],
    parents: Sequence[argparse.ArgumentParser] = (),
) -> None:
    """Register ``k8s`` and its sub-commands on ``elastic-run``'s sub-command parsers."""
    group = commands.add_parser(
        "k8s",
        help="render, submit, inspect or delete a job on Kubernetes",
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    actions = group.add_subparsers(dest="k8s_command", metavar="ACTION", required=True)
    render = actions.add_parser(
        "render",
        parents=list(parents),
        help="print a job's manifests as YAML (no cluster needed)",
        description="Print the Kubernetes objects of one job as a YAML stream on stdout.",
    )
    _add_job_flags(render)
    submit = actions.add_parser(
        "submit",
        parents=list(parents),
        help="apply a job's manifests to the cluster",
        description=(
            "Create the objects `render` prints. Shared objects (etcd, PriorityClass) are "
            "created if absent and otherwise kept; a job whose launcher Job exists is refused."
        ),
    )
    _add_job_flags(submit)
    _add_cluster_flags(submit)
    status = actions.add_parser(
        "status",
        parents=list(parents),
        help="show a job's launcher Job and pods",
        description="Show the launcher Job's state and every pod of a job.",
    )
    delete = actions.add_parser(
        "delete",
        parents=list(parents),
        help="delete every object of a job",
        description=(
            "Delete the launcher Job, the worker pods and the job's RBAC, template and "
            "NetworkPolicies (everything labelled elastic-allreduce/job=JOB). The namespace's "
            "etcd and checkpoint claim (with the job's checkpoints), the PriorityClass and the "
            "admission policy stay."
        ),
    )
    for parser in (status, delete):
        parser.add_argument("--job-id", required=True, metavar="NAME", help="the job's id")
        parser.add_argument(
            "--namespace",
            default=DEFAULT_NAMESPACE,
            metavar="NS",
            help=f"the job's namespace (default {DEFAULT_NAMESPACE})",
        )
        _add_cluster_flags(parser)


def _add_cluster_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--kubeconfig", metavar="FILE", help="kubeconfig file (default $KUBECONFIG, ~/.kube/config)"
    )
    parser.add_argument("--context", metavar="NAME", help="kubeconfig context (default: current)")


def _add_job_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of where and how the job runs on the cluster, then the job flags shared with
    ``elastic-run run`` and the training command."""
    parser.add_argument("--image", required=True, metavar="IMG", help="the elastic-allreduce image")
    parser.add_argument(
        "--launcher-image",
        metavar="IMG",
        help="the launcher pod's image (default --image); for a GPU --image give the CPU image: "
        "the launcher needs no GPU, and the GPU image is a pull of several GB",
    )
    parser.add_argument(
        "--namespace",
        default=DEFAULT_NAMESPACE,
        metavar="NS",
        help=f"namespace of the job (default {DEFAULT_NAMESPACE}; it must exist)",
    )
    parser.add_argument("--cpu", default="1", help="CPU request per worker (default 1)")
    parser.add_argument("--memory", default="2Gi", help="memory per worker (default 2Gi)")
    parser.add_argument(
        "--shm-size",
        metavar="SIZE",
        help="the size limit of each worker pod's memory-backed /dev/shm (default: 1Gi per "
        "GPU, at least 1Gi); the in-memory snapshots need two copies of the state per training "
        "process there, and its pages count against the pod's memory limit",
    )
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "--etcd",
        metavar="HOST:PORT[,...]",
        help=f"etcd endpoints, https:// for TLS (default: the namespace's "
        f"{default_etcd_endpoints()})",
    )
    where.add_argument(
        "--with-etcd", action="store_true", help="also deploy the namespace's etcd StatefulSet"
    )
    parser.add_argument(
        "--etcd-replicas", type=int, default=3, metavar="N", help="etcd members (default 3)"
    )
    parser.add_argument(
        "--etcd-plaintext",
        action="store_true",
        help="the namespace's etcd without TLS or auth, for a trusted network only (by default it "
        "requires client certificates, and the job mounts its Secret "
        "<job-id>-etcd-client: docs/kubernetes.md)",
    )
    priority = parser.add_mutually_exclusive_group()
    priority.add_argument(
        "--priority-class",
        default=PRIORITY_CLASS,
        metavar="NAME",
        help=f"workers' PriorityClass (default {PRIORITY_CLASS})",
    )
    priority.add_argument(
        "--no-priority-class",
        action="store_true",
        help="neither the workers nor the launcher get a PriorityClass",
    )
    parser.add_argument(
        "--launcher-priority-class",
        default=LAUNCHER_PRIORITY_CLASS,
        metavar="NAME",
        help=f"the launcher's PriorityClass (default {LAUNCHER_PRIORITY_CLASS}, above the "
        "workers': a launcher pod that replaces another is placed first)",
    )
    parser.add_argument(
        "--with-priority-class",
        action="store_true",
        help=f"also create the cluster-scoped PriorityClasses {PRIORITY_CLASS} and "
        f"{LAUNCHER_PRIORITY_CLASS}",
    )
    parser.add_argument(
        "--launcher-pdb",
        action="store_true",
        help="also create a PodDisruptionBudget that keeps drains from evicting the running "
        "launcher until the job ends (by default a drain hands the job over to the launcher "
        "Job's next pod: docs/kubernetes.md)",
    )
    parser.add_argument(
        "--no-network-policy",
        action="store_true",
        help="leave out the NetworkPolicies (e.g. for an etcd outside the namespace)",
    )
    parser.add_argument(
        "--api-server-cidr",
        action="append",
        default=[],
        metavar="CIDR",
        help="the Kubernetes API server's address, which alone the launcher may then reach on "
        "ports 443 and 6443 (repeatable; default: any address on those ports; `kubectl get "
        "endpoints kubernetes` shows it)",
    )
    parser.add_argument(
        "--with-admission-policy",
        action="store_true",
        help=f"also create the cluster's ValidatingAdmissionPolicy {ADMISSION_POLICY} and its "
        "binding, which let each job's launcher create only its job's worker pods (once per "
        "cluster; needs cluster rights)",
    )
    volumes = parser.add_argument_group(
        "checkpoint volume",
        "with --checkpoint-dir DIR every worker pod mounts a PersistentVolumeClaim at DIR; the "
        "job's checkpoints go to DIR/<job-id>/",
    )
    volumes.add_argument(
        "--checkpoint-claim",
        default=CHECKPOINT_CLAIM,
        metavar="NAME",
        help=f"the claim mounted at --checkpoint-dir (default {CHECKPOINT_CLAIM}, shared by the "
        "namespace's jobs)",
    )
    volumes.add_argument(
        "--with-checkpoint-claim",
        action="store_true",
        help="also create that claim: ReadWriteMany, since the worker pods run on several "
        "nodes (a storage class of a network file system offers it)",
    )
    volumes.add_argument(
        "--checkpoint-size",
        default=manifests.DEFAULT_CHECKPOINT_SIZE,
        metavar="SIZE",
        help=f"the claim's size (default {manifests.DEFAULT_CHECKPOINT_SIZE})",
    )
    volumes.add_argument(
        "--checkpoint-storage-class",
        metavar="NAME",
        help="the claim's storage class (default: the cluster's default class)",
    )
    volumes.add_argument(
        "--tensorboard-dir",
        metavar="DIR",
        help="TensorBoard summaries (as `elastic-run run --tensorboard-dir`): rank 0 writes "
        "DIR/train, the launcher DIR/launcher; a folder inside --checkpoint-dir, on the claim "
        "that the launcher then mounts too (for example /checkpoints/tensorboard/<job-id>)",
    )
    metrics = parser.add_mutually_exclusive_group()
    metrics.add_argument(
        "--metrics-port",
        type=int,
        default=DEFAULT_METRICS_PORT,
        metavar="PORT",
        help="the launcher pod serves its dashboard, Prometheus /metrics and JSON API on this "
        "port, with prometheus.io/scrape|port|path annotations and a NetworkPolicy that opens "
        f"only this port to scrapers (default {DEFAULT_METRICS_PORT})",
    )
    metrics.add_argument(
        "--no-metrics", action="store_true", help="no metrics port, annotations or policy"
    )
    parser.add_argument(
        "--node-selector",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="schedule workers only on nodes with this label (repeatable)",
    )
    parser.add_argument(
        "--toleration",
        action="append",
        default=[],
        metavar="KEY[=VALUE][:EFFECT]",
        help="let workers run on nodes with this taint (repeatable)",
    )
    job_options.add_job_flags(parser)
    job_options.add_command(parser)


def job_spec(args: argparse.Namespace) -> manifests.JobSpec:
    """The JobSpec the flags describe (validated; ConfigError names the bad flag)."""
    job = zoo_cli.in_cluster(job_options.from_args(args))  # `train --model-def ...` too
    selector: dict[str, str] = {}
    for item in args.node_selector:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"invalid --node-selector {item!r}: use KEY=VALUE")
        selector[key] = value
    return manifests.JobSpec(
        image=args.image,
        launcher_image=args.launcher_image,
        job=job,
        namespace=args.namespace,
        cpu=args.cpu,
        memory=args.memory,
        etcd=args.etcd,
        with_etcd=args.with_etcd,
        etcd_replicas=args.etcd_replicas,
        etcd_tls=not args.etcd_plaintext,
        priority_class=None if args.no_priority_class else args.priority_class,
        launcher_priority_class=None if args.no_priority_class else args.launcher_priority_class,
        with_priority_class=args.with_priority_class,
        launcher_disruption_budget=args.launcher_pdb,
        network_policy=not args.no_network_policy,
        node_selector=selector,
        tolerations=tuple(manifests.Toleration.parse(t) for t in args.toleration),
        metrics_port=None if args.no_metrics else args.metrics_port,
        checkpoint_claim=args.checkpoint_claim,
        with_checkpoint_claim=args.with_checkpoint_claim,
        checkpoint_size=args.checkpoint_size,
        checkpoint_storage_class=args.checkpoint_storage_class,
        shm_limit=args.shm_size,
        tensorboard_dir=args.tensorboard_dir,
        with_admission_policy=args.with_admission_policy,
        api_server_cidrs=tuple(args.api_server_cidr),
    ).validate()


def _describe(manifest: Manifest) -> str:
    return f"{manifest['kind']}/{manifest['metadata']['name']}"


def _run_render(args: argparse.Namespace) -> int:
    spec = job_spec(args)
    sys.stdout.write(manifests.to_yaml(manifests.render(spec)))
    if not args.job_id:
        print(f"# job id {spec.job_id} (pass --job-id to choose it)", file=sys.stderr)
    return 0


def _check_prerequisites(kube: Kube, spec: manifests.JobSpec) -> None:
    """Refuse, before creating anything, a job that exists or would have no etcd or class."""
    job = kube.get(KINDS["Job"], launcher_name(spec.job_id), spec.namespace)
    if job is not None:
        raise KubernetesConflictError(
            f"job {spec.job_id!r} already exists in namespace {spec.namespace!r} "
            f"({_job_phase(job)}): delete it first with `elastic-run k8s delete --namespace "
            f"{spec.namespace} --job-id {spec.job_id}`, or choose another --job-id",
            409,
        )
    checks: list[tuple[Kind, str, str | None, str]] = []
    if not spec.with_etcd and spec.etcd is None:
        checks.append(
            (
                KINDS["Service"],
                ETCD_NAME,
                spec.namespace,
                f"namespace {spec.namespace!r} has no etcd (Service {ETCD_NAME} not found): "
                "add --with-etcd to deploy one, `kubectl apply -k k8s/base` (or an overlay), or "
                "pass --etcd HOST:PORT",
            )
        )
    classes = ((spec.priority_class, "worker"), (spec.launcher_priority_class, "launcher"))
    for name, whose in classes:
        if name is not None and not spec.with_priority_class:
            checks.append(
                (
                    KINDS["PriorityClass"],
                    name,
                    None,
                    f"PriorityClass {name!r} does not exist, so no {whose} pod could be "
                    "created: create it once per cluster (--with-priority-class, or `kubectl "
                    "apply -f k8s/base/priorityclass.yaml`) or pass --no-priority-class",
                )
            )
    if spec.job.checkpoint_dir is not None and not spec.with_checkpoint_claim:
        checks.append(
            (
                KINDS["PersistentVolumeClaim"],
                spec.checkpoint_claim,
                spec.namespace,
                f"PersistentVolumeClaim {spec.checkpoint_claim!r} does not exist in namespace "
                f"{spec.namespace!r}, so no worker pod could mount --checkpoint-dir: add "
                "--with-checkpoint-claim to create it (ReadWriteMany), create one, or name "
                "yours with --checkpoint-claim",
            )
        )
    for kind, name, namespace, missing in checks:
        try:
            found = kube.get(kind, name, namespace)
        except KubernetesForbiddenError as exc:
            print(f"elastic-run k8s submit: warning: not checked: {exc}", file=sys.stderr)
            continue
        if found is None:
            raise KubernetesConfigError(missing)
    if not spec.with_admission_policy:
        _check_admission_policy(kube)


def _check_admission_policy(kube: Kube) -> None:
    """Warn (only) when the cluster has no admission policy for launchers: the job runs, but
    its launcher may create any pod its Role and the namespace's Pod Security level allow."""
    try:
        found = kube.get(KINDS["ValidatingAdmissionPolicy"], ADMISSION_POLICY, None)
    except KubernetesForbiddenError as exc:
        print(f"elastic-run k8s submit: warning: not checked: {exc}", file=sys.stderr)
        return
    except KubernetesNotFoundError:
        found = None  # a server without admissionregistration.k8s.io/v1 (before 1.30)
    if found is None:
        print(
            f"elastic-run k8s submit: warning: the cluster has no ValidatingAdmissionPolicy "
            f"{ADMISSION_POLICY!r}: the launcher may create any pod its Role allows, not only "
            "its job's worker pods; a cluster administrator applies it once "
            "(k8s/cluster/admission-policy.yaml, or --with-admission-policy)",
            file=sys.stderr,
        )


def _run_submit(args: argparse.Namespace) -> int:
    spec = job_spec(args)
    objects = manifests.render(spec)
    with connect(args.kubeconfig, args.context) as kube:
        _check_prerequisites(kube, spec)
        for manifest in objects:
            kind_of(manifest)  # refuse an unknown kind before sending anything
        for manifest in objects:
            try:
                kube.create(manifest)
                outcome = "created"
            except KubernetesNotFoundError as exc:
                if not kind_of(manifest).namespaced:
                    raise
                raise KubernetesConfigError(
                    f"namespace {spec.namespace!r} does not exist: create it (`kubectl create "
                    f"namespace {spec.namespace}`) or pass --namespace ({exc})"
                ) from exc
            except KubernetesConflictError:
                if manifest["kind"] in _SHARED_KINDS:
                    outcome = "exists, kept"
                elif manifest["kind"] == "Job":
                    raise
                else:
                    kube.replace(manifest)
                    outcome = "replaced"
            print(f"{_describe(manifest)}: {outcome}")
    print(
        f"job {spec.job_id} submitted to namespace {spec.namespace}; follow it with "
        f"`elastic-run k8s status --namespace {spec.namespace} --job-id {spec.job_id}`"
    )
    return 0


def _job_phase(job: Manifest) -> str:
    status = job.get("status") or {}
    for condition in status.get("conditions") or []:
        if condition.get("status") == "True" and condition.get("type") in ("Complete", "Failed"):
            detail = condition.get("message") or condition.get("reason") or ""
            name = "succeeded" if condition["type"] == "Complete" else "failed"
            return f"{name}{': ' + detail if detail else ''}"
    if status.get("active"):
        return "running"
    if status.get("succeeded"):
        return "succeeded"
    if status.get("failed"):
        return "failed"
    return "starting"


def _pod_line(pod: Manifest) -> str:
    metadata, spec = pod["metadata"], pod.get("spec") or {}
    status = pod.get("status") or {}
    phase = str(status.get("phase") or "Unknown")
    if metadata.get("deletionTimestamp"):
        phase = "Terminating"
    detail = ""
    for condition in status.get("conditions") or []:
        if condition.get("type") == "PodScheduled" and condition.get("status") == "False":
            detail = condition.get("message") or condition.get("reason") or ""
    for container in status.get("containerStatuses") or []:
        state = container.get("state") or {}
        waiting, ended = state.get("waiting") or {}, state.get("terminated") or {}
        if waiting.get("reason"):
            detail = waiting["reason"]
        elif ended:
            detail = f"{ended.get('reason', 'exited')} (exit code {ended.get('exitCode')})"
    if status.get("reason"):  # Evicted, Preempting, ...
        detail = f"{status['reason']}: {status.get('message', '')}".rstrip(": ")
    role = (metadata.get("labels") or {}).get(ROLE_LABEL, "?")
    node = spec.get("nodeName") or "-"
    ip = status.get("podIP") or "-"
    line = f"  {role:<8} {metadata['name']:<40} {phase:<11} node {node:<20} ip {ip}"
    return f"{line}  {detail}" if detail else line


def _run_status(args: argparse.Namespace) -> int:
    with connect(args.kubeconfig, args.context) as kube:
        job = kube.get(KINDS["Job"], launcher_name(args.job_id), args.namespace)
        pods = kube.list(KINDS["Pod"], args.namespace, job_selector(args.job_id))
    if job is None and not pods:
        raise KubernetesConfigError(
            f"no job {args.job_id!r} in namespace {args.namespace!r}: no Job "
            f"{launcher_name(args.job_id)} and no pods labelled {job_selector(args.job_id)} "
            "(check --job-id and --namespace)"
        )
    phase = _job_phase(job) if job is not None else "launcher Job gone"
    print(f"job {args.job_id} in namespace {args.namespace}: {phase}")
    launchers = [p for p in pods if p["metadata"].get("labels", {}).get(ROLE_LABEL) != ROLE_WORKER]
    workers = [p for p in pods if p not in launchers]
    for pod in sorted(launchers, key=lambda p: p["metadata"]["name"]):
        print(_pod_line(pod))
    for pod in sorted(workers, key=lambda p: p["metadata"]["name"]):
        print(_pod_line(pod))
    counts: dict[str, int] = {}
    for pod in workers:
        phase = str((pod.get("status") or {}).get("phase") or "Unknown").lower()
        counts[phase] = counts.get(phase, 0) + 1
    summary = ", ".join(f"{n} {phase}" for phase, n in sorted(counts.items())) or "none"
    print(f"workers: {summary}")
    return 0


def _run_delete(args: argparse.Namespace) -> int:
    selector = job_selector(args.job_id)
    deleted = 0
    with connect(args.kubeconfig, args.context) as kube:
        for name in _JOB_KINDS:
            kind = KINDS[name]
            try:
                objects = kube.list(kind, args.namespace, selector)
            except KubernetesForbiddenError as exc:
                if name not in _OPTIONAL_KINDS:
                    raise
                print(f"elastic-run k8s delete: warning: not checked: {exc}", file=sys.stderr)
                continue
            for obj in objects:
                try:
                    kube.delete(kind, obj["metadata"]["name"], args.namespace)
                except KubernetesNotFoundError:
                    continue  # gone meanwhile (a Job's pods go with it)
                print(f"{name}/{obj['metadata']['name']}: deleted")
                deleted += 1
    if not deleted:
        raise KubernetesConfigError(
            f"nothing to delete: no objects labelled {selector} in namespace {args.namespace!r} "
            "(check --job-id and --namespace)"
        )
    print(
        f"job {args.job_id} deleted ({deleted} objects); the namespace's etcd and checkpoint "
        "claim stay"
    )
    return 0


def run(args: argparse.Namespace) -> int:
    """Run the ``k8s`` sub-command in ``args``: 0 on success; otherwise one error line that
    names the command, and :func:`exit_code`."""
    handlers = {
        "render": _run_render,
        "submit": _run_submit,
        "status": _run_status,
        "delete": _run_delete,
    }
    try:
        return handlers[args.k8s_command](args)
    except ElasticAllreduceError as exc:
        print(f"elastic-run k8s {args.k8s_command}: error: {exc}", file=sys.stderr)
        return exit_code(exc)
