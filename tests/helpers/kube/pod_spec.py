"""What the process kubelet (:mod:`tests.helpers.kube.kubelet`) makes of a pod's spec: pure
functions, no API calls and no side effects, so that each rule is unit-tested on its own.

- :func:`container_env` — a container's environment as a real kubelet computes it: ``envFrom``
  (Secrets and ConfigMaps, ``prefix``, ``optional``), then ``env`` in order (``value`` with
  ``$(VAR)`` expansion from the variables defined so far, ``valueFrom`` with ``fieldRef``,
  ``resourceFieldRef``, ``secretKeyRef`` and ``configMapKeyRef``), on top of the runtime's
  variables (``PATH``, ``HOME``, ``HOSTNAME``) and the API server's service variables
  (``KUBERNETES_SERVICE_HOST`` / ``_PORT``, which here point at the API server itself).
- :func:`container_argv` — ``command`` overrides the image's entrypoint, ``args`` its cmd, both
  expanded with :func:`expand`. No image is pulled: an image of this project
  (``elastic-allreduce``) has the entrypoint of the project's Dockerfile (``elastic-run``,
  found on the PATH of this checkout's .venv); any other image needs an explicit ``command``.
- :func:`volume_files` — the files of a Secret, ConfigMap, downward API or projected volume
  (``items``, ``defaultMode``, ``mode``, ``optional``).
- :func:`hosts_file` / :func:`resolv_conf` / :func:`service_names` — the pod's ``/etc/hosts``,
  which stands in for cluster DNS and kube-proxy: every Service name maps to one ready endpoint.

A spec the process kubelet cannot run raises :class:`PodSpecError`: ``retry`` tells a
condition that may pass (a Secret not yet created, a claim not yet bound: the pod waits, as
on a real node) from one that never will (the pod fails, with ``reason`` and ``message`` in
its status).
"""

from __future__ import annotations

import json
import math
import posixpath
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, Final, Protocol

from kubernetes.utils import quantity as _quantity

Obj = dict[str, Any]

#: The cluster domain the hosts file spells fully qualified names with.
CLUSTER_DOMAIN: Final = "cluster.local"
#: Where the service-account admission plugin (and a real kubelet) mount the token.
SERVICE_ACCOUNT_MOUNT: Final = "/var/run/secrets/kubernetes.io/serviceaccount"
#: The image names of this project (any registry, any tag), with their Dockerfiles'
#: ENTRYPOINT and CMD.
PROJECT_IMAGES: Final = {
    "elastic-allreduce": (["elastic-run"], ["--help"]),
    "elastic-allreduce-gpu": (["elastic-run"], ["--help"]),
}
#: The ConfigMap of the cluster's CA certificate in every namespace.
ROOT_CA_CONFIG_MAP: Final = "kube-root-ca.crt"
#: The mode of volume files when the volume names none (Kubernetes' default, 0644).
DEFAULT_FILE_MODE: Final = 0o644
#: The search path of a runtime's default ``PATH``, after the checkout's .venv/bin.
SYSTEM_PATH: Final = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class PodSpecError(Exception):
    """The pod cannot run (yet): ``reason`` (CamelCase, as in a pod's status) and a message
    that names the pod's field and what to change. ``retry``: the cause may go away."""

    def __init__(self, reason: str, message: str, *, retry: bool = False) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.retry = retry


class Sources(Protocol):
    """Where the kubelet reads what a pod refers to (the API server, for the kubelet)."""

    def secret(self, namespace: str, name: str) -> Mapping[str, bytes] | None:
        """The Secret's decoded data, or None when it does not exist."""

    def config_map(self, namespace: str, name: str) -> Mapping[str, bytes] | None:
        """The ConfigMap's data and binaryData, or None when it does not exist."""

    def token(self, pod: Obj, audience: str | None, expiration: int) -> str:
        """A service-account token for the pod's service account, bound to the pod."""


@dataclass(frozen=True)
class PodContext:
    """One pod as its kubelet sees it: the object, where its references are read, its and its
    node's addresses, the node's allocatable resources and the cluster's CA certificate."""

    pod: Obj
    sources: Sources
    pod_ip: str
    host_ip: str
    allocatable: Mapping[str, str]
    ca_cert: bytes = b""

    @property
    def namespace(self) -> str:
        return str(self.pod["metadata"].get("namespace", "default"))

    @property
    def described(self) -> str:
        return f"pod {self.namespace}/{self.pod['metadata'].get('name')}"

    def lookup(self, kind: str, name: str) -> Mapping[str, bytes] | None:
        """The data of Secret or ConfigMap ``name`` in the pod's namespace (None: missing)."""
        if kind == "Secret":
            return self.sources.secret(self.namespace, name)
        return self.sources.config_map(self.namespace, name)


# -- expansion ---------------------------------------------------------------------------------


def expand(text: str, variables: Mapping[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion: ``$(NAME)`` becomes the variable's value when it is
    defined and stays as written when not; ``$$`` is an escaped ``$``; a ``$`` before anything
    else, and an unclosed ``$(``, stay as written."""
    out: list[str] = []
    i = 0
    while i < len(text):
        char = text[i]
        if char != "$" or i + 1 == len(text):
            out.append(char)
            i += 1
            continue
        following = text[i + 1]
        if following == "$":
            out.append("$")
            i += 2
        elif following == "(":
            close = text.find(")", i + 2)
            if close < 0:
                out.append("$(")
                i += 2
            else:
                name = text[i + 2 : close]
                out.append(variables.get(name, f"$({name})"))
                i = close + 1
        else:
            out.append("$" + following)
            i += 2
    return "".join(out)


# -- names -------------------------------------------------------------------------------------


def pod_hostname(pod: Obj) -> str:
    """The pod's host name: ``spec.hostname``, else its name cut to 63 characters (without a
    trailing ``-`` or ``.``), as a real kubelet gives it."""
    spec = pod.get("spec") or {}
    name = str(spec.get("hostname") or pod["metadata"]["name"])
    return name[:63].rstrip("-.") if len(name) > 63 else name


def pod_fqdn(pod: Obj) -> str | None:
    """``<hostname>.<subdomain>.<namespace>.svc.<domain>`` when the pod has a subdomain."""
    subdomain = (pod.get("spec") or {}).get("subdomain")
    if not subdomain:
        return None
    namespace = pod["metadata"].get("namespace", "default")
    return f"{pod_hostname(pod)}.{subdomain}.{namespace}.svc.{CLUSTER_DOMAIN}"


# -- the downward API --------------------------------------------------------------------------


def _key_in_brackets(path: str, prefix: str) -> str | None:
    """``metadata.labels['k']`` -> ``k`` (for ``prefix`` ``metadata.labels``)."""
    if path.startswith(prefix + "[") and path.endswith("]"):
        inner = path[len(prefix) + 1 : -1]
        if len(inner) >= 2 and inner[0] == inner[-1] and inner[0] in "'\"":
            return inner[1:-1]
    return None


def format_map(values: Mapping[str, str]) -> str:
    """A label or annotation map as the downward API writes it: ``key="value"`` lines, sorted,
    the values quoted with escapes."""
    return "".join(f"{key}={json.dumps(values[key])}\n" for key in sorted(values))


def field_value(ctx: PodContext, path: str, *, whole_maps: bool = False) -> str:
    """The value of a downward-API ``fieldRef.fieldPath``. ``whole_maps`` allows
    ``metadata.labels`` and ``metadata.annotations`` (volumes may, env may not)."""
    meta = ctx.pod.get("metadata") or {}
    spec = ctx.pod.get("spec") or {}
    simple: dict[str, str] = {
        "metadata.name": str(meta.get("name", "")),
        "metadata.namespace": ctx.namespace,
        "metadata.uid": str(meta.get("uid", "")),
        "spec.nodeName": str(spec.get("nodeName", "")),
        "spec.serviceAccountName": str(spec.get("serviceAccountName") or "default"),
        "status.podIP": ctx.pod_ip,
        "status.podIPs": ctx.pod_ip,
        "status.hostIP": ctx.host_ip,
        "status.hostIPs": ctx.host_ip,
    }
    if path in simple:
        return simple[path]
    for prefix in ("metadata.labels", "metadata.annotations"):
        values = meta.get(prefix.split(".")[1]) or {}
        if path == prefix and whole_maps:
            return format_map(values)
        key = _key_in_brackets(path, prefix)
        if key is not None:
            return str(values.get(key, ""))
    raise PodSpecError(
        "UnsupportedFieldPath",
        f"{ctx.described}: the downward API field {path!r} is not supported (use "
        f"{', '.join(sorted(simple))}, metadata.labels['KEY'] or metadata.annotations['KEY'])",
    )


def resource_value(ctx: PodContext, ref: Obj, default_container: str | None) -> str:
    """The value of a ``resourceFieldRef``: the container's request or limit (a limit not set
    is the node's allocatable amount), divided by ``divisor`` and rounded up."""
    container_name = ref.get("containerName") or default_container
    resource = str(ref.get("resource", ""))
    containers = (ctx.pod.get("spec") or {}).get("containers") or []
    container = next((c for c in containers if c.get("name") == container_name), None)
    if container is None or resource.split(".", 1)[0] not in {"limits", "requests"}:
        raise PodSpecError(
            "UnsupportedResourceField",
            f"{ctx.described}: resourceFieldRef {resource!r} of container "
            f"{container_name!r}: no such container, or not limits.* / requests.*",
        )
    kind, name = resource.split(".", 1)
    resources = container.get("resources") or {}
    amount = (resources.get(kind) or {}).get(name)
    if amount is None and kind == "requests":
        amount = (resources.get("limits") or {}).get(name)
    if amount is None:
        amount = ctx.allocatable.get(name, "0") if kind == "limits" else "0"
    value = quantity(amount) / quantity(ref.get("divisor") or "1")
    return str(math.ceil(value))


# -- env ---------------------------------------------------------------------------------------


def default_env(venv_bin: str, hostname: str) -> dict[str, str]:
    """What the container runtime puts in every container's environment before the pod's own
    variables: the image's ``PATH`` (this checkout's .venv first), ``HOME`` and ``HOSTNAME``."""
    return {"PATH": f"{venv_bin}:{SYSTEM_PATH}", "HOME": "/root", "HOSTNAME": hostname}


def service_env(host: str, port: int) -> dict[str, str]:
    """The ``kubernetes`` Service's variables, which a real kubelet gives every container,
    pointing at the API server itself (there is no kube-proxy to reach a ClusterIP)."""
    return {
        "KUBERNETES_SERVICE_HOST": host,
        "KUBERNETES_SERVICE_PORT": str(port),
        "KUBERNETES_SERVICE_PORT_HTTPS": str(port),
        "KUBERNETES_PORT": f"tcp://{host}:{port}",
        f"KUBERNETES_PORT_{port}_TCP": f"tcp://{host}:{port}",
        f"KUBERNETES_PORT_{port}_TCP_PROTO": "tcp",
        f"KUBERNETES_PORT_{port}_TCP_PORT": str(port),
        f"KUBERNETES_PORT_{port}_TCP_ADDR": host,
    }


def _valid_env_name(name: str) -> bool:
    return bool(name) and "=" not in name and not name[0].isdigit()


def _key_ref(ctx: PodContext, kind: str, ref: Obj, what: str) -> str | None:
    """The value of a ``secretKeyRef`` / ``configMapKeyRef``; None when it is missing but
    optional."""
    name, key = str(ref.get("name", "")), str(ref.get("key", ""))
    data = ctx.lookup(kind, name)
    optional = bool(ref.get("optional"))
    if data is None or key not in data:
        if optional:
            return None
        missing = (
            f"{kind.lower()} {name!r} not found"
            if data is None
            else f"couldn't find key {key} in {kind} {ctx.namespace}/{name}"
        )
        raise PodSpecError(
            "CreateContainerConfigError", f"{ctx.described}: {what}: {missing}", retry=True
        )
    return data[key].decode(errors="replace")


def _env_from(ctx: PodContext, container: Obj) -> dict[str, str]:
    """The variables of the container's ``envFrom`` (later sources win)."""
    found: dict[str, str] = {}
    for source in container.get("envFrom") or []:
        prefix = str(source.get("prefix") or "")
        for kind, field in (("ConfigMap", "configMapRef"), ("Secret", "secretRef")):
            ref = source.get(field)
            if ref is None:
                continue
            name = str(ref.get("name", ""))
            data = ctx.lookup(kind, name)
            if data is None:
                if ref.get("optional"):
                    continue
                raise PodSpecError(
                    "CreateContainerConfigError",
                    f"{ctx.described}: envFrom: {kind.lower()} {name!r} not found",
                    retry=True,
                )
            for key, value in data.items():
                if _valid_env_name(prefix + key):  # a real kubelet skips invalid names too
                    found[prefix + key] = value.decode(errors="replace")
    return found


def _value_from(ctx: PodContext, container: Obj, name: str, source: Obj) -> str | None:
    """The value of one ``env[].valueFrom`` (None: an optional key that is missing)."""
    what = f"container {container.get('name')!r}, env {name}"
    if "fieldRef" in source:
        return field_value(ctx, str(source["fieldRef"].get("fieldPath", "")))
    if "resourceFieldRef" in source:
        return resource_value(ctx, source["resourceFieldRef"], container.get("name"))
    if "secretKeyRef" in source:
        return _key_ref(ctx, "Secret", source["secretKeyRef"], what)
    if "configMapKeyRef" in source:
        return _key_ref(ctx, "ConfigMap", source["configMapKeyRef"], what)
    raise PodSpecError(
        "CreateContainerConfigError",
        f"{ctx.described}: {what}: valueFrom {sorted(source)} is not supported (fieldRef, "
        "resourceFieldRef, secretKeyRef and configMapKeyRef are)",
    )


def container_env(
    ctx: PodContext,
    container: Obj,
    *,
    base: Mapping[str, str],
    services: Mapping[str, str],
) -> dict[str, str]:
    """The container's complete environment: ``base`` (the runtime's), ``services``, then
    ``envFrom`` and ``env`` as a real kubelet resolves them (later entries win; a ``value``
    expands ``$(VAR)`` from the service variables, ``envFrom`` and the entries before it)."""
    own: dict[str, str] = {**services, **_env_from(ctx, container)}
    for entry in container.get("env") or []:
        name = str(entry.get("name", ""))
        source = entry.get("valueFrom")
        if source is None:
            own[name] = expand(str(entry.get("value") or ""), own)
            continue
        value = _value_from(ctx, container, name, source)
        if value is not None:
            own[name] = value
    return {**base, **own}


# -- the command -------------------------------------------------------------------------------


def image_name(image: str) -> str:
    """``registry:5000/team/elastic-allreduce:0.1.0@sha256:...`` -> ``elastic-allreduce``."""
    without_digest = image.split("@", 1)[0]
    last = without_digest.rsplit("/", 1)[-1]
    return last.split(":", 1)[0]


def container_argv(ctx: PodContext, container: Obj, env: Mapping[str, str]) -> list[str]:
    """What the container runs: ``command`` (else the image's entrypoint) and ``args`` (else,
    without ``command``, the image's cmd), with ``$(VAR)`` expanded from ``env``."""
    command = [expand(str(part), env) for part in container.get("command") or []]
    args = [expand(str(part), env) for part in container.get("args") or []]
    if command:
        return command + args
    image = str(container.get("image") or "")
    known = PROJECT_IMAGES.get(image_name(image))
    if known is None:
        raise PodSpecError(
            "CreateContainerError",
            f"{ctx.described}: container {container.get('name')!r} has no command, and the "
            f"process kubelet pulls no image to take an entrypoint from ({image!r}; it knows "
            f"{', '.join(sorted(PROJECT_IMAGES))}): give the container a command",
        )
    entrypoint, cmd = known
    return entrypoint + (args if container.get("args") else cmd)


# -- volume files ------------------------------------------------------------------------------


@dataclass(frozen=True)
class VolumeFile:
    """One file of a Secret, ConfigMap, downward API or projected volume."""

    path: str  #: relative to the volume's root
    data: bytes
    mode: int


def safe_relative(described: str, path: str, what: str) -> str:
    """``path`` normalised; PodSpecError when it is absolute or leaves its folder."""
    normal = posixpath.normpath(path)
    if not path or path.startswith("/") or normal == ".." or normal.startswith("../"):
        raise PodSpecError(
            "InvalidVolumePath",
            f"{described}: {what}: path {path!r} must be relative and stay inside the volume",
        )
    return normal


def _keyed_files(
    ctx: PodContext, data: Mapping[str, bytes], source: Obj, mode: int, what: str
) -> list[VolumeFile]:
    """The files of a Secret's or ConfigMap's keys (all of them, or ``items``)."""
    items = source.get("items")
    if not items:
        return [VolumeFile(safe_relative(ctx.described, k, what), v, mode) for k, v in data.items()]
    files: list[VolumeFile] = []
    for item in items:
        key = str(item.get("key", ""))
        if key not in data:
            if source.get("optional"):
                continue
            raise PodSpecError(
                "FailedMount",
                f"{ctx.described}: {what}: couldn't find key {key!r} (its items name it)",
                retry=True,
            )
        path = safe_relative(ctx.described, str(item.get("path") or key), what)
        files.append(VolumeFile(path, data[key], int(item.get("mode", mode))))
    return files


def _object_files(
    ctx: PodContext, kind: str, source: Obj, mode: int, what: str
) -> list[VolumeFile]:
    """The files of a Secret or ConfigMap source (nothing when it is missing but optional)."""
    name = str(source.get("secretName") or source.get("name") or "")
    data = ctx.lookup(kind, name)
    if data is None:
        if source.get("optional"):
            return []
        raise PodSpecError(
            "FailedMount", f"{ctx.described}: {what}: {kind.lower()} {name!r} not found", retry=True
        )
    return _keyed_files(ctx, data, source, mode, what)


def _downward_files(
    ctx: PodContext, items: Sequence[Obj], mode: int, what: str
) -> list[VolumeFile]:
    files: list[VolumeFile] = []
    for item in items:
        path = safe_relative(ctx.described, str(item.get("path", "")), what)
        if "fieldRef" in item:
            text = field_value(ctx, str(item["fieldRef"].get("fieldPath", "")), whole_maps=True)
        elif "resourceFieldRef" in item:
            text = resource_value(ctx, item["resourceFieldRef"], None)
        else:
            raise PodSpecError(
                "UnsupportedVolume", f"{ctx.described}: {what}: item {path!r} names no field"
            )
        files.append(VolumeFile(path, text.encode(), int(item.get("mode", mode))))
    return files


def _projected_files(ctx: PodContext, projected: Obj, what: str) -> list[VolumeFile]:
    mode = int(projected.get("defaultMode", DEFAULT_FILE_MODE))
    files: list[VolumeFile] = []
    for source in projected.get("sources") or []:
        if "serviceAccountToken" in source:
            token = source["serviceAccountToken"]
            text = ctx.sources.token(
                ctx.pod, token.get("audience"), int(token.get("expirationSeconds") or 3607)
            )
            path = safe_relative(ctx.described, str(token.get("path") or "token"), what)
            files.append(VolumeFile(path, text.encode(), mode))
        elif "configMap" in source and source["configMap"].get("name") == ROOT_CA_CONFIG_MAP:
            # Published by the controller manager in every namespace; until it is, the
            # cluster's CA certificate is what it will hold.
            data = ctx.lookup("ConfigMap", ROOT_CA_CONFIG_MAP) or {"ca.crt": ctx.ca_cert}
            files += _keyed_files(ctx, data, source["configMap"], mode, what)
        elif "configMap" in source:
            files += _object_files(ctx, "ConfigMap", source["configMap"], mode, what)
        elif "secret" in source:
            files += _object_files(ctx, "Secret", source["secret"], mode, what)
        elif "downwardAPI" in source:
            files += _downward_files(ctx, source["downwardAPI"].get("items") or [], mode, what)
        else:
            raise PodSpecError(
                "UnsupportedVolume",
                f"{ctx.described}: {what}: projected source {sorted(source)} is not supported "
                "by the process kubelet (serviceAccountToken, configMap, secret and downwardAPI "
                "are)",
            )
    return files


def volume_files(ctx: PodContext, volume: Obj) -> list[VolumeFile]:
    """The files of a Secret, ConfigMap, downwardAPI or projected ``volume``. A projected
    service-account token comes from the TokenRequest API (``ctx.sources.token``)."""
    what = f"volume {volume.get('name')!r}"
    for kind, field in (("Secret", "secret"), ("ConfigMap", "configMap")):
        if field in volume:
            source = volume[field]
            mode = int(source.get("defaultMode", DEFAULT_FILE_MODE))
            return _object_files(ctx, kind, source, mode, what)
    if "downwardAPI" in volume:
        source = volume["downwardAPI"]
        mode = int(source.get("defaultMode", DEFAULT_FILE_MODE))
        return _downward_files(ctx, source.get("items") or [], mode, what)
    if "projected" in volume:
        return _projected_files(ctx, volume["projected"], what)
    raise PodSpecError("UnsupportedVolume", f"{ctx.described}: {what} has no files to project")


def service_account_volume(pod: Obj) -> Obj:
    """The projected volume a real API server's ServiceAccount admission adds to a pod whose
    token is automounted (the kubelet adds it when the pod came without one)."""
    return {
        "name": "kube-api-access-kubelet",
        "projected": {
            "defaultMode": DEFAULT_FILE_MODE,
            "sources": [
                {"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}},
                {
                    "configMap": {
                        "name": ROOT_CA_CONFIG_MAP,
                        "items": [{"key": "ca.crt", "path": "ca.crt"}],
                    }
                },
                {
                    "downwardAPI": {
                        "items": [
                            {
                                "path": "namespace",
                                "fieldRef": {
                                    "apiVersion": "v1",
                                    "fieldPath": "metadata.namespace",
                                },
                            }
                        ]
                    }
                },
            ],
        },
    }


# -- names in /etc/hosts -----------------------------------------------------------------------


def _ready_addresses(slices: Iterable[Obj], publish_not_ready: bool) -> list[tuple[str, Obj]]:
    """(address, endpoint) of the slices' IPv4 endpoints, ready ones first, then by address."""
    found: list[tuple[bool, str, Obj]] = []
    for item in slices:
        if item.get("addressType", "IPv4") != "IPv4":
            continue
        for endpoint in item.get("endpoints") or []:
            ready = (endpoint.get("conditions") or {}).get("ready")
            usable = ready is None or ready or publish_not_ready
            for address in endpoint.get("addresses") or []:
                if usable:
                    found.append((not (ready is None or ready), str(address), endpoint))
    found.sort(key=lambda entry: (entry[0], tuple(int(p) for p in entry[1].split("."))))
    return [(address, endpoint) for _, address, endpoint in found]


def service_names(namespace: str, services: Iterable[Obj], slices: Iterable[Obj]) -> dict[str, str]:
    """Name -> address for the hosts file of a pod in ``namespace``: each Service of the
    cluster under ``svc.ns``, ``svc.ns.svc`` and ``svc.ns.svc.<domain>`` (and plain ``svc`` for
    the pod's own namespace) at its first ready endpoint; each endpoint with a hostname (a
    StatefulSet's pods behind their headless Service) under ``host.svc.ns.svc.<domain>`` and
    its shorter forms. A Service without a ready endpoint gets no name (as in DNS)."""
    by_service: dict[tuple[str, str], list[Obj]] = {}
    for item in slices:
        meta = item.get("metadata") or {}
        owner = (meta.get("labels") or {}).get("kubernetes.io/service-name")
        if owner:
            by_service.setdefault((str(meta.get("namespace")), owner), []).append(item)
    names: dict[str, str] = {}
    local_first = sorted(
        services,
        key=lambda s: (s["metadata"].get("namespace") != namespace, s["metadata"]["name"]),
    )
    for service in local_first:
        meta = service["metadata"]
        svc_ns, svc = str(meta.get("namespace", "default")), str(meta["name"])
        spec = service.get("spec") or {}
        if spec.get("type") == "ExternalName":
            continue
        endpoints = _ready_addresses(
            by_service.get((svc_ns, svc), []), bool(spec.get("publishNotReadyAddresses"))
        )
        qualified = [
            f"{svc}.{svc_ns}",
            f"{svc}.{svc_ns}.svc",
            f"{svc}.{svc_ns}.svc.{CLUSTER_DOMAIN}",
        ]
        short = [svc] if svc_ns == namespace else []
        if endpoints:
            for name in short + qualified:
                names.setdefault(name, endpoints[0][0])
        for address, endpoint in endpoints:
            host = endpoint.get("hostname")
            if host:
                forms = [f"{host}.{q}" for q in qualified]
                if svc_ns == namespace:
                    forms.insert(0, f"{host}.{svc}")
                for name in forms:
                    names.setdefault(name, address)
    return names


def hosts_file(pod: Obj, pod_ip: str, names: Mapping[str, str]) -> str:
    """The pod's ``/etc/hosts``: localhost, the pod's own names at its address (as a real
    kubelet writes them), ``spec.hostAliases``, then the Service names."""
    hostname = pod_hostname(pod)
    fqdn = pod_fqdn(pod)
    lines = [
        "# Kubernetes-managed hosts file (the process kubelet: Services are listed here, at",
        "# one ready endpoint each, since the test cluster has no DNS and no kube-proxy).",
        "127.0.0.1\tlocalhost",
        "::1\tlocalhost ip6-localhost ip6-loopback",
        f"{pod_ip}\t{fqdn}\t{hostname}" if fqdn else f"{pod_ip}\t{hostname}",
    ]
    for alias in (pod.get("spec") or {}).get("hostAliases") or []:
        lines.append(f"{alias.get('ip')}\t" + "\t".join(alias.get("hostnames") or []))
    own = {hostname, fqdn}
    by_address: dict[str, list[str]] = {}
    for name, address in names.items():
        if name not in own:
            by_address.setdefault(address, []).append(name)
    if by_address:
        lines.append("# Services")
    for address in sorted(by_address, key=lambda a: tuple(int(p) for p in a.split("."))):
        lines.append(f"{address}\t" + " ".join(by_address[address]))
    return "\n".join(lines) + "\n"


def resolv_conf(namespace: str) -> str:
    """The pod's ``/etc/resolv.conf``: the cluster's search path, and a name server on the
    pod's own loopback, where nothing listens, so that a name not in ``/etc/hosts`` fails at
    once (connection refused) instead of timing out."""
    search = f"{namespace}.svc.{CLUSTER_DOMAIN} svc.{CLUSTER_DOMAIN} {CLUSTER_DOMAIN}"
    return f"search {search}\nnameserver 127.0.0.1\noptions ndots:5 timeout:1 attempts:1\n"


# -- small helpers for the kubelet -------------------------------------------------------------


def quantity(text: str | int) -> Decimal:
    """A resource quantity (``"1Gi"``, ``"250m"``) as a number."""
    parse: Any = _quantity.parse_quantity  # untyped in the client library
    return Decimal(parse(str(text)))


def first_container(pod: Obj) -> Obj:
    """The container the process kubelet runs (the first one)."""
    containers = (pod.get("spec") or {}).get("containers") or []
    if not containers:
        meta = pod.get("metadata") or {}
        raise PodSpecError(
            "CreateContainerError",
            f"pod {meta.get('namespace')}/{meta.get('name')} has no containers",
        )
    return dict(containers[0])
