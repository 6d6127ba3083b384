"""The Kubernetes objects of one job, rendered offline from its spec (no API access).

Every object is named ``hotspare-<job>-...`` and labelled ``app.kubernetes.io/name:
hotspare``, ``app.kubernetes.io/instance: <job>``, ``hotspare/role: <role>``. Why these
objects and not others (Indexed Jobs for the agents, an ``emptyDir`` etcd, no Role) is in
:mod:`hotspare.orchestrator.launchers.kubernetes`, which creates them; ``hotspare submit --dry-run``
prints them (:func:`dump`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from ..spec import JobSpec
from . import LaunchError

DEFAULT_IMAGE = "hotspare:cpu"
DEFAULT_ETCD_IMAGE = "quay.io/coreos/etcd:v3.5.17"
DEFAULT_SHM = "2Gi"
#: WORKDIR of docker/Dockerfile: the image's copy of this checkout.
IMAGE_ROOT = "/opt/hotspare"
DATA_ROOT = "/var/lib/hotspare"
SPEC_DIR = "/etc/hotspare"
SECRET_DIR = "/etc/hotspare-secret"
REPO_ROOT = Path(__file__).resolve().parents[2]
#: ``hotspare-<job>-etcd`` must fit a StatefulSet name (52: its pods' revision label adds 11).
MAX_JOB_NAME = 38
#: The Job controller kills every running pod once this many pod failures (or, with
#: restartPolicy OnFailure, container restarts) accumulate, which would end training: it only
#: stops an endless crash loop (etcd gone for good), so it is generous.
BACKOFF_LIMIT = 100
PULL_POLICIES = ("Always", "IfNotPresent", "Never")
_QUANTITY = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+|[numkMGTPE]|[KMGTPE]i)?\Z")
# an agent terminated by Kubernetes (drain, preemption, cancel) exits 143, not 0: a pod that
# ended 0 would count as a completed index and never be replaced
_AGENT_WRAPPER = ('"$@" & pid=$!; trap \'kill -TERM "$pid"; wait "$pid"; exit 143\' TERM INT; '
                  'wait "$pid"')
_WAIT_FOR_ETCD = """\
import sys, time, urllib.request
while True:
    for ep in sys.argv[1].split(","):
        try:
            urllib.request.urlopen(ep + "/health", timeout=2)
            sys.exit(0)
        except Exception as e:
            err = e
    print(f"waiting for etcd at {sys.argv[1]}: {err}", flush=True)
    time.sleep(2)
"""


# -- names, labels, paths -------------------------------------------------------------------
def prefix(job: str) -> str:
    return f"hotspare-{job}"


def selector(job: str) -> str:
    return f"app.kubernetes.io/name=hotspare,app.kubernetes.io/instance={job}"


def labels(job: str, role: str | None = None, **extra: str) -> dict[str, str]:
    out = {"app.kubernetes.io/name": "hotspare", "app.kubernetes.io/instance": job}
    if role:
        out["hotspare/role"] = role
    out.update({f"hotspare/{k}": v for k, v in extra.items()})
    return out


def namespace(spec: JobSpec) -> str:
    return spec.kubernetes.get("namespace") or "default"


def etcd_url(job: str, ns: str) -> str:
    """The in-cluster etcd's client URL (resolvable inside the cluster only)."""
    return f"http://{prefix(job)}-etcd.{ns}.svc:2379"


def image_entrypoint(entrypoint: str) -> str:
    """The entrypoint as seen inside the image: files under this checkout move to IMAGE_ROOT."""
    target, _, func = entrypoint.rpartition(":")
    if not target.endswith(".py"):
        return entrypoint  # package.module:function, installed in the image
    try:
        rel = Path(target).resolve().relative_to(REPO_ROOT)
    except ValueError:
        return entrypoint  # must exist at the same path in the image
    return f"{IMAGE_ROOT}/{rel.as_posix()}:{func}"


def pod_spec(spec: JobSpec, endpoints: list[str]) -> dict:
    """The resolved spec as the pods see it (the ConfigMap's spec.json): entrypoint and
    output_dir inside the image, etcd reduced to the endpoints (no credentials in a ConfigMap)."""
    d = spec.to_dict()
    d["entrypoint"] = image_entrypoint(spec.entrypoint)
    d["output_dir"] = f"{DATA_ROOT}/{spec.name}"
    d["etcd"] = {"endpoints": list(endpoints), "ca_cert": None, "cert": None, "key": None,
                 "user": None, "password": None}
    return d


# -- manifests ------------------------------------------------------------------------------
def _check(spec: JobSpec) -> None:
    name, k = spec.name, spec.kubernetes
    if len(name) > MAX_JOB_NAME:
        raise LaunchError(f"job name {name!r} has {len(name)} characters; the kubernetes backend "
                          f"allows {MAX_JOB_NAME} (hotspare-<name>-etcd must fit Kubernetes' "
                          "52-character StatefulSet names)")
    policy = k.get("image_pull_policy")
    if policy is not None and policy not in PULL_POLICIES:
        raise LaunchError(f"kubernetes.image_pull_policy: {policy!r} is not one of "
                          f"{', '.join(PULL_POLICIES)}")
    for key in ("cpu", "memory", "shm_size"):
        if k.get(key) is not None and not _QUANTITY.match(str(k[key])):
            raise LaunchError(f"kubernetes.{key}: {k[key]!r} is not a Kubernetes quantity "
                              "(e.g. '4', '500m', '16Gi')")


def _meta(spec: JobSpec, name: str, role: str | None = None) -> dict:
    job = spec.name
    return {"name": f"{prefix(job)}{name}", "namespace": namespace(spec), "labels": labels(job, role)}


#: the image's unprivileged user (docker/Dockerfile: `USER 10001`); every pod runs as it
RUN_AS = 10001


def _hardened(container: dict) -> dict:
    """No capabilities, no privilege escalation, a read-only root filesystem: nothing in
    hotspare needs them (it signals only its own child processes). What it writes goes to
    volumes: /tmp (HOME too: torch's caches), /dev/shm, the output and etcd's data."""
    container["securityContext"] = {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                    "capabilities": {"drop": ["ALL"]}}
    container.setdefault("volumeMounts", []).append({"name": "tmp", "mountPath": "/tmp"})
    container.setdefault("env", []).append({"name": "HOME", "value": "/tmp"})
    return container


def _pod(spec: JobSpec, containers: list[dict], init: list[dict] | None = None, **fields: object) -> dict:
    """Pod spec fields every role shares: the job's ServiceAccount, without an API token."""
    volumes = [{"name": "tmp", "emptyDir": {}}, *fields.pop("volumes", [])]  # type: ignore[misc]
    pod: dict = {"serviceAccountName": prefix(spec.name), "automountServiceAccountToken": False,
                 "enableServiceLinks": False,
                 "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}, "runAsNonRoot": True,
                                     "runAsUser": RUN_AS, "runAsGroup": RUN_AS, "fsGroup": RUN_AS},
                 **fields, "volumes": volumes}
    if init:
        pod["initContainers"] = [_hardened(c) for c in init]
    pod["containers"] = containers
    return pod


def _network_policy(spec: JobSpec) -> dict:
    """Only the job's own pods may connect to its pods: etcd (the job's keys, its secret and its
    spec), the agents' replica servers and the workers' collectives. Without it any pod of any
    namespace could reach the in-cluster etcd, which has no auth (security review F1).
    Egress stays open (an external etcd, object stores, the image's registry)."""
    job = spec.name
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": _meta(spec, "-ingress"),
            "spec": {"podSelector": {"matchLabels": labels(job)}, "policyTypes": ["Ingress"],
                     "ingress": [{"from": [{"podSelector": {"matchLabels": labels(job)}}]}]}}


def _image(spec: JobSpec) -> dict:
    k = spec.kubernetes
    return {"image": k.get("image") or DEFAULT_IMAGE,
            "imagePullPolicy": k.get("image_pull_policy") or "IfNotPresent"}


def _wait_for_etcd(spec: JobSpec, endpoints: list[str]) -> dict:
    """Init container: start the controller/agent only once the in-cluster etcd answers (their
    commands exit on an unreachable etcd, and crash-loop back-off would delay the start)."""
    return _hardened({"name": "wait-for-etcd", **_image(spec),
                      "command": ["python", "-c", _WAIT_FOR_ETCD, ",".join(endpoints)]})


def _service_account(spec: JobSpec) -> dict:
    return {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(spec, ""),
            "automountServiceAccountToken": False}


def _secret(spec: JobSpec, secret_hex: str) -> dict:
    return {"apiVersion": "v1", "kind": "Secret", "metadata": _meta(spec, "-secret"),
            "type": "Opaque", "stringData": {"secret": secret_hex}}


def _config_map(spec: JobSpec, endpoints: list[str]) -> dict:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(spec, "-spec"),
            "data": {"spec.json": json.dumps(pod_spec(spec, endpoints), indent=1, sort_keys=True) + "\n"}}


def _etcd(spec: JobSpec) -> list[dict]:
    job, ns = spec.name, namespace(spec)
    k = spec.kubernetes
    name = f"{prefix(job)}-etcd"
    peer = "http://127.0.0.1:2380"  # one member: peers never leave the pod
    container = _hardened({
        "name": "etcd", "image": k.get("etcd_image") or DEFAULT_ETCD_IMAGE,
        "command": ["/usr/local/bin/etcd", "--name", "hotspare", "--data-dir", "/var/lib/etcd",
                    "--listen-client-urls", "http://0.0.0.0:2379",
                    "--advertise-client-urls", etcd_url(job, ns),
                    "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                    "--initial-cluster", f"hotspare={peer}",
                    # the embedded etcd's settings (orchestrator/etcd_server.py): fast raft
                    # timings, a 2 GiB quota, revision compaction
                    "--heartbeat-interval", "50", "--election-timeout", "500",
                    "--quota-backend-bytes", str(2 * 1024**3),
                    "--auto-compaction-mode", "revision", "--auto-compaction-retention", "10000",
                    "--logger", "zap", "--log-level", "warn"],
        "ports": [{"name": "client", "containerPort": 2379}],
        "readinessProbe": {"httpGet": {"path": "/health", "port": 2379}, "periodSeconds": 2},
        "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}},
        "volumeMounts": [{"name": "data", "mountPath": "/var/lib/etcd"}],
    })
    service = {"apiVersion": "v1", "kind": "Service", "metadata": _meta(spec, "-etcd", "etcd"),
               "spec": {"selector": labels(job, "etcd"),
                        "ports": [{"name": "client", "port": 2379, "targetPort": 2379}]}}
    sts = {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": _meta(spec, "-etcd", "etcd"),
           "spec": {"replicas": 1, "serviceName": name, "selector": {"matchLabels": labels(job, "etcd")},
                    "template": {"metadata": {"labels": labels(job, "etcd")},
                                 "spec": _pod(spec, [container], terminationGracePeriodSeconds=10,
                                              volumes=[{"name": "data", "emptyDir": {}}])}}}
    return [service, sts]


def _controller(spec: JobSpec, endpoints: list[str], in_cluster_etcd: bool) -> dict:
    job = spec.name
    container = _hardened({
        "name": "controller", **_image(spec),
        "command": ["hotspare", "controller", "--job", job, "--etcd", ",".join(endpoints),
                    "--register", f"{SPEC_DIR}/spec.json"],
        # the secret as a file, never an environment variable (those show in `describe` and dumps)
        "env": [{"name": "HOTSPARE_JOB_SECRET_FILE", "value": f"{SECRET_DIR}/secret"}],
        "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}},
        "volumeMounts": [{"name": "spec", "mountPath": SPEC_DIR, "readOnly": True},
                         {"name": "secret", "mountPath": SECRET_DIR, "readOnly": True}],
    })
    # two controllers on one Kubernetes node would be lost together: spread them if possible
    spread = {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{
        "weight": 100, "podAffinityTerm": {"labelSelector": {"matchLabels": labels(job, "controller")},
                                           "topologyKey": "kubernetes.io/hostname"}}]}}
    init = [_wait_for_etcd(spec, endpoints)] if in_cluster_etcd else None
    pod = _pod(spec, [container], init, terminationGracePeriodSeconds=5, affinity=spread,
               volumes=[{"name": "spec", "configMap": {"name": f"{prefix(job)}-spec",
                                                       "items": [{"key": "spec.json", "path": "spec.json"}]}},
                        {"name": "secret", "secret": {"secretName": f"{prefix(job)}-secret", "defaultMode": 0o400}}])
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta(spec, "-controller", "controller"),
            "spec": {"replicas": 2, "selector": {"matchLabels": labels(job, "controller")},
                     "template": {"metadata": {"labels": labels(job, "controller")}, "spec": pod}}}


def _agent_resources(k: dict) -> dict:
    res: dict[str, str] = {}
    for key in ("cpu", "memory"):
        if k.get(key) is not None:
            res[key] = str(k[key])
    if k.get("gpus"):
        res["nvidia.com/gpu"] = str(int(k["gpus"]))
    # requests == limits: Guaranteed QoS, the last pods to be evicted under node pressure
    return {"requests": dict(res), "limits": dict(res)} if res else {}


def _agents_service(spec: JobSpec) -> dict:
    job = spec.name
    return {"apiVersion": "v1", "kind": "Service", "metadata": _meta(spec, "-agents", "agent"),
            "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                     "selector": labels(job, "agent")}}


def _agents(spec: JobSpec, endpoints: list[str], pool: str, count: int, in_cluster_etcd: bool) -> dict:
    job = spec.name
    k = spec.kubernetes
    args = ["hotspare", "agent", "--job", job, "--etcd", ",".join(endpoints),
            "--node", "$(POD_NAME)", "--host", "$(POD_IP)", "--wait", "600",
            # the spec the controller registers from the ConfigMap: agents refuse any other
            "--spec-sha256", JobSpec.from_dict(pod_spec(spec, endpoints)).digest()]
    if pool == "spare":
        args.append("--spare")
    container = _hardened({
        "name": "agent", **_image(spec),
        "command": ["sh", "-c", _AGENT_WRAPPER, "hotspare-agent", *args],
        "env": [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
        "volumeMounts": [{"name": "shm", "mountPath": "/dev/shm"}, {"name": "output", "mountPath": DATA_ROOT}],
    })
    res = _agent_resources(k)
    if res:
        container["resources"] = res
    output = ({"persistentVolumeClaim": {"claimName": k["output_pvc"]}} if k.get("output_pvc")
              else {"emptyDir": {}})
    volumes = [
        # snapshots live in /dev/shm; a Memory emptyDir counts against the pod's memory limit
        {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": str(k.get("shm_size") or DEFAULT_SHM)}},
        {"name": "output", **output},
    ]
    one_per_node = {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [{
        "labelSelector": {"matchLabels": labels(job, "agent")}, "topologyKey": "kubernetes.io/hostname"}]}}
    placement: dict = {"affinity": one_per_node}
    if k.get("node_selector"):
        placement["nodeSelector"] = dict(k["node_selector"])
    init = [_wait_for_etcd(spec, endpoints)] if in_cluster_etcd else None
    pod = _pod(spec, [container], init, restartPolicy="OnFailure", terminationGracePeriodSeconds=10,
               subdomain=f"{prefix(job)}-agents", **placement, volumes=volumes)
    pod_labels = labels(job, "agent", pool=pool)
    meta = {**_meta(spec, f"-{pool}"), "labels": pod_labels}
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": meta,
            "spec": {"completionMode": "Indexed", "completions": count, "parallelism": count,
                     "backoffLimit": BACKOFF_LIMIT,
                     "template": {"metadata": {"labels": pod_labels}, "spec": pod}}}


def manifests(spec: JobSpec, endpoints: list[str], secret_hex: str) -> list[dict]:
    """Every object of the job, in creation order. ``endpoints == []``: an in-cluster etcd.

    ``secret_hex`` goes into the Secret only (never the ConfigMap); an empty one makes the
    controller generate the secret when it registers the job (see ``register_job``)."""
    _check(spec)
    in_cluster = not endpoints
    eps = [etcd_url(spec.name, namespace(spec))] if in_cluster else list(endpoints)
    docs = [_service_account(spec), _network_policy(spec), _secret(spec, secret_hex), _config_map(spec, eps)]
    if in_cluster:
        docs += _etcd(spec)
    docs += [_agents_service(spec), _controller(spec, eps, in_cluster),
             _agents(spec, eps, "active", spec.nodes, in_cluster)]
    if spec.spares:
        docs.append(_agents(spec, eps, "spare", spec.spares, in_cluster))
    return docs


class _Dumper(yaml.SafeDumper):
    """SafeDumper that writes multi-line strings (the spec JSON, scripts) as literal blocks and
    repeats shared dicts (labels) instead of writing YAML anchors."""

    def ignore_aliases(self, data: object) -> bool:
        return True


_Dumper.add_representer(str, lambda d, s: d.represent_scalar(
    "tag:yaml.org,2002:str", s, style="|" if "\n" in s else None))


def dump(docs: list[dict]) -> str:
    return yaml.dump_all(docs, Dumper=_Dumper, sort_keys=False, explicit_start=True, width=100)
