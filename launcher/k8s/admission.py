"""The cluster's admission policy for launchers: each job's launcher may create only its own
job's worker pods (pure: plain dicts, no cluster, no I/O).

A launcher's Role lets it create pods in its namespace, and RBAC cannot say which pods. The
``ValidatingAdmissionPolicy`` of :func:`objects` (admissionregistration.k8s.io/v1, GA in
Kubernetes 1.30) says it, in CEL, for every request a job's launcher makes on pods:

- create: only a pod of the job's worker shape: the job's labels (``elastic-allreduce/job``,
  ``elastic-allreduce/role: worker``, ``app.kubernetes.io/name``); only the job's images; the
  job's worker service account and no service account token; no host network, PID or IPC
  namespace; no privileged container and no added capability; non-root without privilege
  escalation (as the restricted Pod Security Standard, for namespaces without its label); no
  hostPath; only emptyDir volumes, the job's Secrets and the job's checkpoint claim; no
  variable from another Secret;
- update (the ring annotation on its own pod): only the job's pods, labels and images unchanged;
- delete: only the job's pods.

One policy and one binding serve every job of the cluster (a cluster administrator applies them
once: ``k8s/cluster/admission-policy.yaml``, or ``elastic-run k8s submit
--with-admission-policy``). The job's shape comes from its parameters: the binding takes, in the
namespace of each request, the ConfigMaps labelled ``elastic-allreduce/worker-shape`` (each
job's worker template ConfigMap carries its shape, see :func:`worker_shape`), and the policy is
evaluated once for each of them; each one applies only to requests of its own launcher (the
user ``system:serviceaccount:<namespace>:<job>-launcher``), so jobs sharing a namespace do not
restrict one another. A namespace without such ConfigMaps is not affected
(``parameterNotFoundAction: Allow``).

The expressions use plain CEL only (``has``, ``in``, ``all``, ``map``, ``contains``,
``startsWith``), so that they can be evaluated offline by a CEL interpreter (the tests do, with
cel-python); a real API server also type-checks them against the Pod schema, which was not done
here.
"""

from __future__ import annotations

from typing import Any, Final

from launcher.k8s.naming import (
    ADMISSION_POLICY,
    APP_NAME,
    JOB_LABEL,
    NAME_LABEL,
    PART_OF_LABEL,
    ROLE_LABEL,
    ROLE_WORKER,
    SHAPE_CLAIMS,
    SHAPE_IMAGES,
    SHAPE_JOB,
    SHAPE_LAUNCHER_ACCOUNT,
    SHAPE_SECRETS,
    SHAPE_WORKER_ACCOUNT,
    WORKER_SHAPE_LABEL,
)

Manifest = dict[str, Any]

API_VERSION: Final = "admissionregistration.k8s.io/v1"
#: The value of WORKER_SHAPE_LABEL on the ConfigMaps that carry a job's worker shape.
SHAPE_LABEL_VALUE: Final = "true"

#: The Pod fields holding containers that can be set when a pod is created (ephemeral
#: containers can only be added later, through a subresource the launcher may not use).
_CONTAINER_LISTS: Final = ("containers", "initContainers")


def worker_shape(
    *,
    job_id: str,
    images: tuple[str, ...],
    launcher_account: str,
    worker_account: str,
    secrets: tuple[str, ...] = (),
    claims: tuple[str, ...] = (),
) -> dict[str, str]:
    """A job's worker shape, as ConfigMap data: the policy's parameters for that job."""
    return {
        SHAPE_JOB: job_id,
        SHAPE_IMAGES: ",".join(images),
        SHAPE_LAUNCHER_ACCOUNT: launcher_account,
        SHAPE_WORKER_ACCOUNT: worker_account,
        SHAPE_SECRETS: ",".join(secrets),
        SHAPE_CLAIMS: ",".join(claims),
    }


def _quoted(text: str) -> str:
    """``text`` as a CEL string literal (for label keys and values and parameter keys)."""
    if "'" in text or "\\" in text:
        raise ValueError(f"not quoted for CEL: {text!r}")
    return f"'{text}'"


def _every_container(predicate: str) -> str:
    """CEL: ``predicate`` (about container ``c``) holds for every container of ``object``."""
    parts = []
    for field in _CONTAINER_LISTS:
        check = f"object.spec.{field}.all(c, {predicate})"
        parts.append(check if field == "containers" else f"(!has(object.spec.{field}) || {check})")
    return " && ".join(parts)


def _listed(variable: str, value: str) -> str:
    """CEL: ``value`` is one of the comma-separated names of ``variables.<variable>``."""
    return f"variables.{variable}.contains(',' + {value} + ',')"


def _label_is(obj: str, key: str, value: str) -> str:
    labels = f"{obj}.metadata.labels"
    return f"{_quoted(key)} in {labels} && {labels}[{_quoted(key)}] == {value}"


def _shape_list(key: str) -> str:
    """CEL: the comma-separated list ``key`` of the parameters, with a comma on each side."""
    return f"',' + ({_quoted(key)} in params.data ? params.data.{key} : '') + ','"


_VARIABLES: Final = (
    (
        # The request comes from this parameter's job's launcher (its service account's token).
        "fromLauncher",
        f"has(params.data) && {_quoted(SHAPE_LAUNCHER_ACCOUNT)} in params.data && "
        f"{_quoted(SHAPE_JOB)} in params.data && "
        "request.userInfo.username == 'system:serviceaccount:' + request.namespace + ':' + "
        f"params.data.{SHAPE_LAUNCHER_ACCOUNT}",
    ),
    ("creating", "variables.fromLauncher && request.operation == 'CREATE'"),
    ("changing", "variables.fromLauncher && request.operation in ['UPDATE', 'DELETE']"),
    ("images", _shape_list(SHAPE_IMAGES)),
    ("secrets", _shape_list(SHAPE_SECRETS)),
    ("claims", _shape_list(SHAPE_CLAIMS)),
)

_JOB = f"params.data.{SHAPE_JOB}"

#: (name, CEL expression that must hold, message when it does not).
VALIDATIONS: Final = (
    (
        "job-labels",
        "!variables.creating || (has(object.metadata.labels) && "
        f"{_label_is('object', JOB_LABEL, _JOB)} && "
        f"{_label_is('object', ROLE_LABEL, _quoted(ROLE_WORKER))} && "
        f"{_label_is('object', NAME_LABEL, _quoted(APP_NAME))})",
        f"a job's launcher may create only its job's worker pods: labels {JOB_LABEL}=<job>, "
        f"{ROLE_LABEL}={ROLE_WORKER} and {NAME_LABEL}={APP_NAME}",
    ),
    (
        "images",
        "!variables.creating || ("
        + _every_container(f"has(c.image) && {_listed('images', 'c.image')}")
        + ")",
        "a job's launcher may create pods of its job's images only (the worker template's)",
    ),
    (
        "service-account",
        "!variables.creating || (has(object.spec.serviceAccountName) && "
        f"object.spec.serviceAccountName == params.data.{SHAPE_WORKER_ACCOUNT} && "
        "has(object.spec.automountServiceAccountToken) && "
        "object.spec.automountServiceAccountToken == false)",
        "a job's launcher may create pods only with its job's worker service account, and "
        "without a service account token (automountServiceAccountToken: false)",
    ),
    (
        "host-namespaces",
        "!variables.creating || (!(has(object.spec.hostNetwork) && object.spec.hostNetwork) && "
        "!(has(object.spec.hostPID) && object.spec.hostPID) && "
        "!(has(object.spec.hostIPC) && object.spec.hostIPC))",
        "a job's launcher may not create pods in the node's network, PID or IPC namespace",
    ),
    (
        "privileged",
        "!variables.creating || ("
        + _every_container(
            "!has(c.securityContext) || "
            "(!(has(c.securityContext.privileged) && c.securityContext.privileged) && "
            "!(has(c.securityContext.capabilities) && has(c.securityContext.capabilities.add) "
            "&& size(c.securityContext.capabilities.add) > 0))"
        )
        + ")",
        "a job's launcher may not create privileged containers or add capabilities",
    ),
    (
        # As the restricted Pod Security Standard has it, for namespaces without its label.
        "non-root",
        "!variables.creating || (has(object.spec.securityContext) && "
        "has(object.spec.securityContext.runAsNonRoot) && object.spec.securityContext.runAsNonRoot "
        "&& !(has(object.spec.securityContext.runAsUser) && "
        "object.spec.securityContext.runAsUser == 0) && "
        + _every_container(
            "has(c.securityContext) && has(c.securityContext.allowPrivilegeEscalation) && "
            "!c.securityContext.allowPrivilegeEscalation && "
            "!(has(c.securityContext.runAsNonRoot) && !c.securityContext.runAsNonRoot) && "
            "!(has(c.securityContext.runAsUser) && c.securityContext.runAsUser == 0)"
        )
        + ")",
        "a job's launcher may create only pods that run as non-root without privilege "
        "escalation (runAsNonRoot: true, allowPrivilegeEscalation: false, no runAsUser 0)",
    ),
    (
        "no-host-path",
        "!variables.creating || !has(object.spec.volumes) || "
        "object.spec.volumes.all(v, !has(v.hostPath))",
        "a job's launcher may not create pods with hostPath volumes",
    ),
    (
        "volumes",
        "!variables.creating || !has(object.spec.volumes) || object.spec.volumes.all(v, "
        "has(v.emptyDir) || "
        "(has(v.secret) && has(v.secret.secretName) && "
        f"{_listed('secrets', 'v.secret.secretName')}) || "
        "(has(v.persistentVolumeClaim) && "
        f"{_listed('claims', 'v.persistentVolumeClaim.claimName')}))",
        "a job's launcher may mount only emptyDir volumes, its job's Secrets and its job's "
        "checkpoint claim in the pods it creates",
    ),
    (
        "secret-variables",
        "!variables.creating || ("
        + _every_container(
            "(!has(c.env) || c.env.all(e, !has(e.valueFrom) || !has(e.valueFrom.secretKeyRef) "
            f"|| {_listed('secrets', 'e.valueFrom.secretKeyRef.name')})) && "
            "(!has(c.envFrom) || c.envFrom.all(e, !has(e.secretRef) || "
            f"{_listed('secrets', 'e.secretRef.name')}))"
        )
        + ")",
        "a job's launcher may give its pods variables from its job's Secrets only",
    ),
    (
        "own-pods",
        "!variables.changing || (has(oldObject.metadata.labels) && "
        f"{_label_is('oldObject', JOB_LABEL, _JOB)})",
        "a job's launcher may change or delete only its job's pods",
    ),
    (
        "unchanged",
        "!variables.fromLauncher || request.operation != 'UPDATE' || "
        "(has(object.metadata.labels) && has(oldObject.metadata.labels) && "
        "object.metadata.labels == oldObject.metadata.labels && "
        + " && ".join(
            f"(has(object.spec.{field}) ? object.spec.{field}.map(c, c.image) : []) == "
            f"(has(oldObject.spec.{field}) ? oldObject.spec.{field}.map(c, c.image) : [])"
            for field in _CONTAINER_LISTS
        )
        + ")",
        "a job's launcher may not change a pod's labels or images",
    ),
)

#: (name, CEL expression): a request is checked only when every one holds.
MATCH_CONDITIONS: Final = (
    ("service-accounts", "request.userInfo.username.startsWith('system:serviceaccount:')"),
)


def policy() -> Manifest:
    """The ValidatingAdmissionPolicy (cluster-scoped)."""
    return {
        "apiVersion": API_VERSION,
        "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": ADMISSION_POLICY, "labels": {PART_OF_LABEL: APP_NAME}},
        "spec": {
            "failurePolicy": "Fail",
            "paramKind": {"apiVersion": "v1", "kind": "ConfigMap"},
            "matchConstraints": {
                "resourceRules": [
                    {
                        "apiGroups": [""],
                        "apiVersions": ["v1"],
                        "operations": ["CREATE", "UPDATE", "DELETE"],
                        "resources": ["pods"],
                    }
                ]
            },
            "matchConditions": [
                {"name": name, "expression": expression} for name, expression in MATCH_CONDITIONS
            ],
            "variables": [
                {"name": name, "expression": expression} for name, expression in _VARIABLES
            ],
            "validations": [
                {"expression": expression, "message": message, "reason": "Forbidden"}
                for _, expression, message in VALIDATIONS
            ],
        },
    }


def binding() -> Manifest:
    """The ValidatingAdmissionPolicyBinding (cluster-scoped): the policy, with the worker shapes
    of the request's namespace as parameters, denying what it rejects."""
    return {
        "apiVersion": API_VERSION,
        "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": ADMISSION_POLICY, "labels": {PART_OF_LABEL: APP_NAME}},
        "spec": {
            "policyName": ADMISSION_POLICY,
            "validationActions": ["Deny"],
            "paramRef": {
                # No namespace: the ConfigMaps of the namespace of the pod being admitted.
                "selector": {"matchLabels": {WORKER_SHAPE_LABEL: SHAPE_LABEL_VALUE}},
                "parameterNotFoundAction": "Allow",
            },
        },
    }


def objects() -> list[Manifest]:
    """The policy and its binding, in apply order."""
    return [policy(), binding()]
