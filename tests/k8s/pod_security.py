"""The "restricted" Pod Security Standard, checked offline on a pod spec.

Implemented from the controls the Kubernetes documentation lists, by their names there
(https://kubernetes.io/docs/concepts/security/pod-security-standards/, "Baseline" and
"Restricted"; the restricted profile is every baseline control plus its own), as Pod Security
Admission's ``restricted`` level enforces them in current Kubernetes releases (the
``pod-security.kubernetes.io/enforce: restricted`` label of a namespace). Not Pod Security
Admission itself: no API server runs here. Each violation names its control.

Two documented relaxations of Pod Security Admission are not modelled (none of our pods uses
them): pods with ``hostUsers: false`` (user namespaces) skip the non-root checks, and Windows
pods (``spec.os.name: windows``) skip the Linux-only ones. A pod that uses either is reported
as if it did not, which is stricter.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

Obj = dict[str, Any]

#: Baseline "Capabilities": what ``capabilities.add`` may hold.
BASELINE_CAPABILITIES = frozenset(
    {
        "AUDIT_WRITE",
        "CHOWN",
        "DAC_OVERRIDE",
        "FOWNER",
        "FSETID",
        "KILL",
        "MKNOD",
        "NET_BIND_SERVICE",
        "SETFCAP",
        "SETGID",
        "SETPCAP",
        "SETUID",
        "SYS_CHROOT",
    }
)
#: Baseline "Sysctls": the safe set.
SAFE_SYSCTLS = frozenset(
    {
        "kernel.shm_rmid_forced",
        "net.ipv4.ip_local_port_range",
        "net.ipv4.ip_unprivileged_port_start",
        "net.ipv4.tcp_syncookies",
        "net.ipv4.ping_group_range",
        "net.ipv4.ip_local_reserved_ports",
        "net.ipv4.tcp_keepalive_time",
        "net.ipv4.tcp_fin_timeout",
        "net.ipv4.tcp_keepalive_intvl",
        "net.ipv4.tcp_keepalive_probes",
    }
)
#: Baseline "SELinux": the allowed ``seLinuxOptions.type`` values.
SELINUX_TYPES = frozenset(
    {"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}
)
#: Restricted "Volume Types": the only volume sources allowed.
RESTRICTED_VOLUMES = frozenset(
    {
        "configMap",
        "csi",
        "downwardAPI",
        "emptyDir",
        "ephemeral",
        "persistentVolumeClaim",
        "projected",
        "secret",
    }
)
_APPARMOR_TYPES = frozenset({"RuntimeDefault", "Localhost"})
_SECCOMP_TYPES = frozenset({"RuntimeDefault", "Localhost"})
_APPARMOR_ANNOTATION = "container.apparmor.security.beta.kubernetes.io/"


def pod_spec_of(obj: Obj) -> tuple[Obj, Obj]:
    """(metadata, spec) of the pod in a Pod, or in the pod template of a Job or StatefulSet."""
    if obj["kind"] == "Pod":
        return obj.get("metadata") or {}, obj["spec"]
    template = obj["spec"]["template"]
    return template.get("metadata") or {}, template["spec"]


def _containers(spec: Obj) -> Iterator[Obj]:
    for field in ("containers", "initContainers", "ephemeralContainers"):
        yield from spec.get(field) or []


def _context(item: Obj) -> Obj:
    return item.get("securityContext") or {}


def baseline_violations(metadata: Obj, spec: Obj) -> list[str]:  # noqa: PLR0912
    """The baseline controls the pod breaks, each as "Control: what"."""
    found: list[str] = []
    pod = _context(spec)
    containers = list(_containers(spec))
    if (pod.get("windowsOptions") or {}).get("hostProcess") or any(
        (_context(c).get("windowsOptions") or {}).get("hostProcess") for c in containers
    ):
        found.append("HostProcess: windowsOptions.hostProcess")
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(field):
            found.append(f"Host Namespaces: spec.{field}")
    for c in containers:
        name, context = c.get("name"), _context(c)
        if context.get("privileged"):
            found.append(f"Privileged Containers: {name}")
        added = set((context.get("capabilities") or {}).get("add") or [])
        if added - BASELINE_CAPABILITIES:
            found.append(f"Capabilities: {name} adds {sorted(added - BASELINE_CAPABILITIES)}")
        for port in c.get("ports") or []:
            if port.get("hostPort"):
                found.append(f"Host Ports: {name} hostPort {port['hostPort']}")
        if context.get("procMount", "Default") != "Default":
            found.append(f"/proc Mount Type: {name}")
        for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
            for handler in ("httpGet", "tcpSocket"):
                if ((c.get(probe) or {}).get(handler) or {}).get("host"):
                    found.append(f"Host Probes / Lifecycle Hooks: {name} {probe}")
        for hook in ((c.get("lifecycle") or {}).get(h) or {} for h in ("postStart", "preStop")):
            if any((hook.get(handler) or {}).get("host") for handler in ("httpGet", "tcpSocket")):
                found.append(f"Host Probes / Lifecycle Hooks: {name} lifecycle")
    for volume in spec.get("volumes") or []:
        if "hostPath" in volume:
            found.append(f"HostPath Volumes: {volume.get('name')}")
    contexts = [("pod", pod)] + [(str(c.get("name")), _context(c)) for c in containers]
    for who, context in contexts:
        apparmor = (context.get("appArmorProfile") or {}).get("type")
        if apparmor is not None and apparmor not in _APPARMOR_TYPES:
            found.append(f"AppArmor: {who} {apparmor}")
        selinux = context.get("seLinuxOptions") or {}
        if (
            selinux.get("type", "") not in SELINUX_TYPES
            or selinux.get("user")
            or selinux.get("role")
        ):
            found.append(f"SELinux: {who}")
        seccomp = (context.get("seccompProfile") or {}).get("type")
        if seccomp is not None and seccomp not in _SECCOMP_TYPES:
            found.append(f"Seccomp: {who} {seccomp}")
    for key, value in (metadata.get("annotations") or {}).items():
        if key.startswith(_APPARMOR_ANNOTATION) and not (
            value == "runtime/default" or value.startswith("localhost/")
        ):
            found.append(f"AppArmor: annotation {key}")
    for sysctl in pod.get("sysctls") or []:
        if sysctl.get("name") not in SAFE_SYSCTLS:
            found.append(f"Sysctls: {sysctl.get('name')}")
    return found


def restricted_violations(metadata: Obj, spec: Obj) -> list[str]:
    """The controls of the restricted profile (baseline included) the pod breaks."""
    found = baseline_violations(metadata, spec)
    pod = _context(spec)
    for volume in spec.get("volumes") or []:
        sources = set(volume) - {"name"}
        if not sources <= RESTRICTED_VOLUMES:
            found.append(f"Volume Types: {volume.get('name')} {sorted(sources)}")
    pod_non_root = pod.get("runAsNonRoot") is True
    if pod.get("runAsNonRoot") is False:
        found.append("Running as Non-root: pod runAsNonRoot false")
    if pod.get("runAsUser") == 0:
        found.append("Running as Non-root user: pod runAsUser 0")
    pod_seccomp = (pod.get("seccompProfile") or {}).get("type")
    for c in _containers(spec):
        name, context = c.get("name"), _context(c)
        if context.get("allowPrivilegeEscalation") is not False:
            found.append(f"Privilege Escalation: {name} allowPrivilegeEscalation is not false")
        non_root = context.get("runAsNonRoot")
        if non_root is False or (non_root is None and not pod_non_root):
            found.append(f"Running as Non-root: {name}")
        if context.get("runAsUser") == 0:
            found.append(f"Running as Non-root user: {name} runAsUser 0")
        seccomp = (context.get("seccompProfile") or {}).get("type")
        if seccomp is None and pod_seccomp not in _SECCOMP_TYPES:
            found.append(f"Seccomp: {name} has no RuntimeDefault or Localhost profile")
        capabilities = context.get("capabilities") or {}
        if "ALL" not in (capabilities.get("drop") or []):
            found.append(f"Capabilities: {name} does not drop ALL")
        if set(capabilities.get("add") or []) - {"NET_BIND_SERVICE"}:
            found.append(f"Capabilities: {name} adds more than NET_BIND_SERVICE")
    return found
