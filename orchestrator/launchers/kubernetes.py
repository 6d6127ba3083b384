"""Kubernetes backend: the job as a handful of objects in one namespace.

``hotspare submit job.yaml`` (``backend: kubernetes``) creates, in the current kubeconfig
context, objects named ``hotspare-<job>-...`` and labelled ``app.kubernetes.io/name: hotspare``,
``app.kubernetes.io/instance: <job>``, ``hotspare/role: <role>``:

* **etcd** (only when the spec names none): a one-replica StatefulSet and its Service. The data
  is on an ``emptyDir``: it survives etcd's container restarts, needs no StorageClass and
  leaves no PersistentVolumeClaim behind; a job's etcd holds minutes-to-days of coordination
  state, and losing the pod loses the job's control plane anyway (one member is not
  replicated). Production jobs name an external, replicated etcd in the spec.
* **controller**: a Deployment of 2 (leader-elected; the standby takes over within one lease
  TTL). It registers the job from the ConfigMap (``--register``), so the job record is created
  where the etcd is -- the in-cluster etcd is not reachable from the submitting machine.
* **agents**: two Indexed Jobs, ``-active`` (``ceil(ranks / ranks_per_node)`` pods) and
  ``-spare`` (``spares`` pods, ``--spare``), one agent per Kubernetes node (required pod
  anti-affinity). Jobs rather than StatefulSets because: (1) a StatefulSet does not replace a
  pod on an unreachable node until someone force-deletes it (at-most-one identity), while a
  Job replaces a failed or terminating pod -- the new pod is a new node incarnation, which
  hotspare treats as fresh capacity; (2) StatefulSet pods cannot complete (restartPolicy
  Always): after training they would restart forever and keep their GPUs, whereas Job pods end
  ``Succeeded`` and release them, which is also what ``ended`` looks at. An agent that is
  terminated (drain, preemption) exits 143 through a small shell wrapper, so its pod counts
  as failed and is replaced, not as a completed index.
* a headless Service for the agents (stable DNS names ``<pod hostname>.hotspare-<job>-agents``),
  a ConfigMap with the spec as the pods see it, a Secret with the job's HMAC secret, and a
  ServiceAccount with no API token: hotspare coordinates through etcd and reads its pod name and
  IP from the downward API, so no pod needs Kubernetes API access -- no Role is rendered.

Paths: the image (docker/) is a copy of this checkout at ``/opt/hotspare``. A ``.py`` entrypoint
under this checkout (``examples/gpt.py``) is mapped to the same path under ``/opt/hotspare``;
any other file path is used unchanged and must exist at that path in the image; a
``package.module:function`` entrypoint must be installed in the image. ``output_dir`` becomes
``/var/lib/hotspare/<job>`` in the pods (on ``kubernetes.output_pvc`` if given, else on an
``emptyDir`` that goes away with the pod, final state included).
"""

from __future__ import annotations

import json
import math
import os
import re
import secrets
from pathlib import Path

import yaml

from . import LaunchError

DEFAULT_IMAGE = "hotspare:cpu"
DEFAULT_ETCD_IMAGE = "quay.io/coreos/etcd:v3.5.17"
DEFAULT_SHM = "2Gi"
#: WORKDIR of docker/Dockerfile: the image's copy of this checkout.
IMAGE_ROOT = "/opt/hotspare"
DATA_ROOT = "/var/lib/hotspare"
SPEC_DIR = "/etc/hotspare"
REPO_ROOT = Path(__file__).resolve().parents[2]
#: ``hotspare-<job>-etcd`` must fit a StatefulSet name (52: its pods' revision label adds 11).
MAX_JOB_NAME = 38
#: The Job controller kills every running pod once this many pod failures (or, with
#: restartPolicy OnFailure, container restarts) accumulate, which would end training: it only
#: stops an endless crash loop (etcd gone for good), so it is generous.
BACKOFF_LIMIT = 100
PULL_POLICIES = ("Always", "IfNotPresent", "Never")
_QUANTITY = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+|[numkMGTPE]|[KMGTPE]i)?$")
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


def namespace(spec: dict) -> str:
    return (spec.get("kubernetes") or {}).get("namespace") or "default"


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


def pod_spec(spec: dict, endpoints: list[str]) -> dict:
    """The resolved spec as the pods see it (the ConfigMap's spec.json): entrypoint and
    output_dir inside the image, etcd reduced to the endpoints (no credentials in a ConfigMap)."""
    d = json.loads(json.dumps(spec))
    d["entrypoint"] = image_entrypoint(spec["entrypoint"])
    d["output_dir"] = f"{DATA_ROOT}/{spec['name']}"
    d["etcd"] = {"endpoints": list(endpoints), "ca_cert": None, "cert": None, "key": None,
                 "user": None, "password": None}
    return d


# -- manifests ------------------------------------------------------------------------------
def _check(spec: dict) -> None:
    name, k = spec["name"], spec.get("kubernetes") or {}
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


def _meta(spec: dict, name: str, role: str | None = None) -> dict:
    job = spec["name"]
    return {"name": f"{prefix(job)}{name}", "namespace": namespace(spec), "labels": labels(job, role)}


def _hardened(container: dict) -> dict:
    """No capabilities, no privilege escalation: nothing in hotspare needs them (it signals
    only its own child processes)."""
    container["securityContext"] = {"allowPrivilegeEscalation": False,
                                    "capabilities": {"drop": ["ALL"]}}
    return container


def _pod(spec: dict, containers: list[dict], init: list[dict] | None = None, **fields) -> dict:
    """Pod spec fields every role shares: the job's ServiceAccount, without an API token."""
    pod = {"serviceAccountName": prefix(spec["name"]), "automountServiceAccountToken": False,
           "enableServiceLinks": False, "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
           **fields}
    if init:
        pod["initContainers"] = init
    pod["containers"] = containers
    return pod


def _image(spec: dict) -> dict:
    k = spec.get("kubernetes") or {}
    return {"image": k.get("image") or DEFAULT_IMAGE,
            "imagePullPolicy": k.get("image_pull_policy") or "IfNotPresent"}


def _wait_for_etcd(spec: dict, endpoints: list[str]) -> dict:
    """Init container: start the controller/agent only once the in-cluster etcd answers (their
    commands exit on an unreachable etcd, and crash-loop back-off would delay the start)."""
    return _hardened({"name": "wait-for-etcd", **_image(spec),
                      "command": ["python", "-c", _WAIT_FOR_ETCD, ",".join(endpoints)]})


def _service_account(spec: dict) -> dict:
    return {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(spec, ""),
            "automountServiceAccountToken": False}


def _secret(spec: dict, secret_hex: str) -> dict:
    return {"apiVersion": "v1", "kind": "Secret", "metadata": _meta(spec, "-secret"),
            "type": "Opaque", "stringData": {"secret": secret_hex}}


def _config_map(spec: dict, endpoints: list[str]) -> dict:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(spec, "-spec"),
            "data": {"spec.json": json.dumps(pod_spec(spec, endpoints), indent=1, sort_keys=True) + "\n"}}


def _etcd(spec: dict) -> list[dict]:
    job, ns = spec["name"], namespace(spec)
    k = spec.get("kubernetes") or {}
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


def _controller(spec: dict, endpoints: list[str], in_cluster_etcd: bool) -> dict:
    job = spec["name"]
    container = _hardened({
        "name": "controller", **_image(spec),
        "command": ["hotspare", "controller", "--job", job, "--etcd", ",".join(endpoints),
                    "--register", f"{SPEC_DIR}/spec.json"],
        "env": [{"name": "HOTSPARE_JOB_SECRET", "valueFrom": {"secretKeyRef": {
            "name": f"{prefix(job)}-secret", "key": "secret"}}}],
        "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}},
        "volumeMounts": [{"name": "spec", "mountPath": SPEC_DIR, "readOnly": True}],
    })
    # two controllers on one Kubernetes node would be lost together: spread them if possible
    spread = {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{
        "weight": 100, "podAffinityTerm": {"labelSelector": {"matchLabels": labels(job, "controller")},
                                           "topologyKey": "kubernetes.io/hostname"}}]}}
    init = [_wait_for_etcd(spec, endpoints)] if in_cluster_etcd else None
    pod = _pod(spec, [container], init, terminationGracePeriodSeconds=5, affinity=spread,
               volumes=[{"name": "spec", "configMap": {"name": f"{prefix(job)}-spec",
                                                       "items": [{"key": "spec.json", "path": "spec.json"}]}}])
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


def _agents_service(spec: dict) -> dict:
    job = spec["name"]
    return {"apiVersion": "v1", "kind": "Service", "metadata": _meta(spec, "-agents", "agent"),
            "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                     "selector": labels(job, "agent")}}


def _agents(spec: dict, endpoints: list[str], pool: str, count: int, in_cluster_etcd: bool) -> dict:
    job = spec["name"]
    k = spec.get("kubernetes") or {}
    args = ["hotspare", "agent", "--job", job, "--etcd", ",".join(endpoints),
            "--node", "$(POD_NAME)", "--host", "$(POD_IP)", "--wait", "600"]
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


def manifests(spec: dict, endpoints: list[str], secret_hex: str) -> list[dict]:
    """Every object of the job, in creation order. ``endpoints == []``: an in-cluster etcd.

    ``secret_hex`` goes into the Secret only (never the ConfigMap); an empty one makes the
    controller generate the secret when it registers the job (see ``register_job``)."""
    _check(spec)
    in_cluster = not endpoints
    eps = [etcd_url(spec["name"], namespace(spec))] if in_cluster else list(endpoints)
    n_active = math.ceil(spec["ranks"] / spec["ranks_per_node"])
    docs = [_service_account(spec), _secret(spec, secret_hex), _config_map(spec, eps)]
    if in_cluster:
        docs += _etcd(spec)
    docs += [_agents_service(spec), _controller(spec, eps, in_cluster),
             _agents(spec, eps, "active", n_active, in_cluster)]
    if spec["spares"]:
        docs.append(_agents(spec, eps, "spare", spec["spares"], in_cluster))
    return docs


class _Dumper(yaml.SafeDumper):
    """SafeDumper that writes multi-line strings (the spec JSON, scripts) as literal blocks and
    repeats shared dicts (labels) instead of writing YAML anchors."""

    def ignore_aliases(self, data) -> bool:
        return True


_Dumper.add_representer(str, lambda d, s: d.represent_scalar(
    "tag:yaml.org,2002:str", s, style="|" if "\n" in s else None))


def dump(docs: list[dict]) -> str:
    return yaml.dump_all(docs, Dumper=_Dumper, sort_keys=False, explicit_start=True, width=100)


# -- the API --------------------------------------------------------------------------------
def _api(context: str | None = None, timeout_retries: int = 1):
    """(ApiClient, context name) for the kubeconfig context (default: the current one)."""
    try:
        from kubernetes import client, config
    except ImportError as e:
        raise LaunchError("the kubernetes backend needs the kubernetes Python package: "
                          "pip install 'hotspare[kubernetes]'") from e
    cfg = client.Configuration()
    where = os.environ.get("KUBECONFIG") or "~/.kube/config"
    try:
        if not any(os.path.exists(os.path.expanduser(f)) for f in where.split(os.pathsep) if f):
            raise FileNotFoundError("no such file")
        config.load_kube_config(config_file=where, context=context, client_configuration=cfg,
                                persist_config=False)
        name = context or config.list_kube_config_contexts(config_file=where)[1]["name"]
    except Exception as e:  # ConfigException, a missing file, a malformed one
        if not os.environ.get("KUBERNETES_SERVICE_HOST"):
            raise LaunchError(f"no Kubernetes cluster configured: cannot load kubeconfig {where} "
                              f"({e}); set KUBECONFIG or pick a context with "
                              "`kubectl config use-context`") from e
        try:
            config.load_incluster_config(client_configuration=cfg)
        except Exception as e2:
            raise LaunchError(f"no Kubernetes cluster configured: no kubeconfig at {where} "
                              f"and the in-cluster config failed ({e2})") from e2
        name = "in-cluster"
    cfg.retries = timeout_retries
    return client.ApiClient(cfg), name


def _reachable(api, context: str) -> None:
    from kubernetes import client

    try:
        client.VersionApi(api).get_code(_request_timeout=5)
    except Exception as e:
        raise LaunchError(f"Kubernetes cluster not reachable at {api.configuration.host} "
                          f"(kubeconfig context {context!r}): {_short(e)}") from e


def _short(e: Exception) -> str:
    from kubernetes.client.rest import ApiException

    if isinstance(e, ApiException):
        try:
            return f"{e.status} {json.loads(e.body).get('message')}"
        except (TypeError, ValueError, AttributeError):
            return f"{e.status} {e.reason}"
    return str(e).splitlines()[0][:300] if str(e) else type(e).__name__


#: kind -> (API class, method suffix), in deletion order (pods go with their owners).
_KINDS = {
    "Job": ("BatchV1Api", "job"), "Deployment": ("AppsV1Api", "deployment"),
    "StatefulSet": ("AppsV1Api", "stateful_set"), "Service": ("CoreV1Api", "service"),
    "ConfigMap": ("CoreV1Api", "config_map"), "Secret": ("CoreV1Api", "secret"),
    "ServiceAccount": ("CoreV1Api", "service_account"),
}


def _delete(api, kind: str, name: str, ns: str) -> bool:
    """Delete one object (its pods in the background); False if it was already gone."""
    from kubernetes import client
    from kubernetes.client.rest import ApiException

    cls, suffix = _KINDS[kind]
    try:
        getattr(getattr(client, cls)(api), f"delete_namespaced_{suffix}")(
            name, ns, propagation_policy="Background", _request_timeout=10,
            _preload_content=False)  # the answer (the object or a Status, by kind) is not needed
    except ApiException as e:
        if e.status == 404:
            return False
        raise
    return True


class KubernetesLauncher:
    brings_etcd = True

    def render(self, spec: dict, endpoints: list[str]) -> str:
        """The manifests, with the Secret's value left empty: a preview should not print a
        credential. ``launch`` fills in 32 random bytes; applied as is (``kubectl apply -f``),
        the controller generates the secret itself when it registers the job."""
        job, ns = spec["name"], namespace(spec)
        head = [f"# Kubernetes objects of job {job} in namespace {ns}; `hotspare submit` creates them "
                "in the current kubeconfig context.",
                "# The Secret's value is empty in this preview: `hotspare submit` generates 32 random "
                "bytes (hex); applied as is, the controller generates one when it registers the job.",
                f"# entrypoint in the pods: {image_entrypoint(spec['entrypoint'])}; "
                f"output_dir in the pods: {DATA_ROOT}/{job}"]
        if not endpoints:
            head.append(f"# etcd runs in the cluster ({etcd_url(job, ns)}); from this machine: "
                        f"kubectl port-forward -n {ns} svc/{prefix(job)}-etcd 2379, then "
                        f"hotspare status {job} --etcd http://127.0.0.1:2379")
        return "\n".join(head) + "\n" + dump(manifests(spec, endpoints, ""))

    def launch(self, spec: dict, endpoints: list[str]) -> dict:
        job, ns = spec["name"], namespace(spec)
        docs = manifests(spec, endpoints, secrets.token_hex(32))
        api, context = _api()
        from kubernetes import utils

        _reachable(api, context)
        created: list[tuple[str, str]] = []
        for doc in docs:
            kind, name = doc["kind"], doc["metadata"]["name"]
            try:
                utils.create_from_dict(api, doc, namespace=ns, _request_timeout=30)
            except Exception as e:
                errs = getattr(e, "api_exceptions", None)
                why = _short(errs[0]) if errs else _short(e)
                rolled = self._roll_back(api, created, ns)
                hint = (f"; job {job} already has objects there: `hotspare cancel {job}` first"
                        if errs and getattr(errs[0], "status", None) == 409 else "")
                raise LaunchError(f"creating {kind} {name} in namespace {ns} (context {context!r}) "
                                  f"failed: {why}{hint}{rolled}") from e
            created.append((kind, name))
        info = {"namespace": ns, "context": context, "job": job, "selector": selector(job),
                "objects": [f"{k}/{n}" for k, n in created],
                "log_dir": f"`kubectl logs -n {ns} -l app.kubernetes.io/instance={job} --prefix`; "
                           f"worker logs under {DATA_ROOT}/{job}/logs in the agent pods",
                "summary": f"{len(created)} objects in namespace {ns} (context {context})"}
        if not endpoints:
            forward = f"kubectl port-forward -n {ns} svc/{prefix(job)}-etcd 2379"
            info["endpoints_hint"] = etcd_url(job, ns)
            info["note"] = (f"etcd runs in the cluster and is not reachable from here: run `{forward}`, "
                            f"then `hotspare status {job} --etcd http://127.0.0.1:2379`")
            info["summary"] += f"; etcd is in-cluster: {forward}, then --etcd http://127.0.0.1:2379"
        return info

    @staticmethod
    def _roll_back(api, created: list[tuple[str, str]], ns: str) -> str:
        """Delete what this launch created (never objects that were there before it)."""
        left = []
        for kind, name in reversed(created):
            try:
                _delete(api, kind, name, ns)
            except Exception:
                left.append(f"{kind}/{name}")
        if not created:
            return ""
        return (f"; left behind (delete by hand): {', '.join(left)}" if left
                else f"; removed the {len(created)} object(s) it had created")

    def describe(self, info: dict) -> str | None:
        """Pod phases by role, e.g. ``etcd 1 Running; controller 2 Running; agent 4 Running,
        1 ImagePullBackOff`` (a waiting container's reason is shown instead of Pending)."""
        try:
            api, _ = _api(info.get("context"), timeout_retries=0)
            from kubernetes import client

            pods = client.CoreV1Api(api).list_namespaced_pod(
                info["namespace"], label_selector=info["selector"], _request_timeout=10).items
        except LaunchError as e:
            return f"cluster not reachable: {e}"
        except Exception as e:
            return f"cluster not reachable: {_short(e)}"
        if not pods:
            return f"no pods of job {info['job']} in namespace {info['namespace']}"
        counts: dict[str, dict[str, int]] = {}
        for p in pods:
            role = (p.metadata.labels or {}).get("hotspare/role", "?")
            status = p.status
            state = (status and status.phase) or "Unknown"
            for cs in (status and status.container_statuses) or []:
                if cs.state and cs.state.waiting and cs.state.waiting.reason not in (None, "ContainerCreating"):
                    state = cs.state.waiting.reason
            c = counts.setdefault(role, {})
            c[state] = c.get(state, 0) + 1
        return "; ".join(f"{role} " + ", ".join(f"{n} {s}" for s, n in sorted(c.items()))
                         for role, c in sorted(counts.items()))

    def ended(self, info: dict) -> bool:
        """True once both agent Jobs finished (Complete/Failed) or the job's objects are gone;
        False while anything runs or when the cluster cannot be asked."""
        try:
            api, _ = _api(info.get("context"), timeout_retries=0)
            from kubernetes import client

            sel = info["selector"]
            jobs = client.BatchV1Api(api).list_namespaced_job(
                info["namespace"], label_selector=sel + ",hotspare/role=agent", _request_timeout=10).items
            if not jobs:
                return not client.CoreV1Api(api).list_namespaced_pod(
                    info["namespace"], label_selector=sel, _request_timeout=10).items
        except Exception:
            return False
        return all(any(c.type in ("Complete", "Failed") and c.status == "True"
                       for c in ((j.status and j.status.conditions) or [])) for j in jobs)

    def cancel(self, info: dict) -> str | None:
        """Delete every object labelled with the job (pods go with their Jobs/ReplicaSets)."""
        ns, sel = info["namespace"], info["selector"]
        by_hand = f"kubectl delete -n {ns} job,deploy,sts,svc,cm,secret,sa -l {sel}"
        try:
            api, _ = _api(info.get("context"), timeout_retries=0)
            from kubernetes import client

            deleted = []
            for kind, (cls, suffix) in _KINDS.items():
                items = getattr(getattr(client, cls)(api), f"list_namespaced_{suffix}")(
                    ns, label_selector=sel, _request_timeout=10).items
                deleted += [f"{kind}/{obj.metadata.name}" for obj in items
                            if _delete(api, kind, obj.metadata.name, ns)]
        except LaunchError as e:
            return f"could not delete the job's Kubernetes objects ({e}); by hand: {by_hand}"
        except Exception as e:
            return f"could not delete the job's Kubernetes objects ({_short(e)}); by hand: {by_hand}"
        if not deleted:
            return f"no Kubernetes objects of job {info['job']} left in namespace {ns}"
        return f"deleted from namespace {ns}: {', '.join(deleted)}"
