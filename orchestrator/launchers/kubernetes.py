"""Kubernetes backend: the job as a handful of objects in one namespace.

``hotspare submit job.yaml`` (``backend: kubernetes``) creates, in the current kubeconfig
context, objects named ``hotspare-<job>-...`` and labelled ``app.kubernetes.io/name: hotspare``,
``app.kubernetes.io/instance: <job>``, ``hotspare/role: <role>``:

* **etcd** (only when the spec names none): a one-replica StatefulSet and its Service. The data
  is on an ``emptyDir``: it survives etcd's container restarts, needs no StorageClass and
  leaves no PersistentVolumeClaim behind; a job's etcd holds minutes-to-days of coordination
  state, and losing the pod loses the job's control plane anyway (one member is not
  replicated). Production jobs name an external, replicated etcd in the spec.
* **controller**: a Deployment of 2 (leader-elected; the standby takes over within one leader
  lease TTL, ``--leader-ttl``). It registers the job from the ConfigMap (``--register``), so the job record is created
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

The objects themselves are rendered in :mod:`hotspare.orchestrator.launchers.k8s_manifests`; this
module talks to the API server (create, roll back, describe, cancel).

Paths: the image (docker/) is a copy of this checkout at ``/opt/hotspare``. A ``.py`` entrypoint
under this checkout (``examples/gpt.py``) is mapped to the same path under ``/opt/hotspare``;
any other file path is used unchanged and must exist at that path in the image; a
``package.module:function`` entrypoint must be installed in the image. ``output_dir`` becomes
``/var/lib/hotspare/<job>`` in the pods (on ``kubernetes.output_pvc`` if given, else on an
``emptyDir`` that goes away with the pod, final state included).
"""

from __future__ import annotations

import json
import os
import secrets

from ..spec import JobSpec
from . import LaunchError
from .k8s_manifests import (  # noqa: F401 - re-exported: the backend's names, as before the split
    BACKOFF_LIMIT,
    DATA_ROOT,
    DEFAULT_ETCD_IMAGE,
    DEFAULT_IMAGE,
    DEFAULT_SHM,
    IMAGE_ROOT,
    MAX_JOB_NAME,
    PULL_POLICIES,
    REPO_ROOT,
    SPEC_DIR,
    dump,
    etcd_url,
    image_entrypoint,
    labels,
    manifests,
    namespace,
    pod_spec,
    prefix,
    selector,
)


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
    "NetworkPolicy": ("NetworkingV1Api", "network_policy"),  # last: the pods are gone by then
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

    def render(self, spec: JobSpec, endpoints: list[str]) -> str:
        """The manifests, with the Secret's value left empty: a preview should not print a
        credential. ``launch`` fills in 32 random bytes; applied as is (``kubectl apply -f``),
        the controller generates the secret itself when it registers the job."""
        job, ns = spec.name, namespace(spec)
        head = [f"# Kubernetes objects of job {job} in namespace {ns}; `hotspare submit` creates them "
                "in the current kubeconfig context.",
                "# The Secret's value is empty in this preview: `hotspare submit` generates 32 random "
                "bytes (hex); applied as is, the controller generates one when it registers the job.",
                f"# entrypoint in the pods: {image_entrypoint(spec.entrypoint)}; "
                f"output_dir in the pods: {DATA_ROOT}/{job}"]
        if not endpoints:
            head.append(f"# etcd runs in the cluster ({etcd_url(job, ns)}); from this machine: "
                        f"kubectl port-forward -n {ns} svc/{prefix(job)}-etcd 2379, then "
                        f"hotspare status {job} --etcd http://127.0.0.1:2379")
        return "\n".join(head) + "\n" + dump(manifests(spec, endpoints, ""))

    def launch(self, spec: JobSpec, endpoints: list[str]) -> dict:
        job, ns = spec.name, namespace(spec)
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
        by_hand = f"kubectl delete -n {ns} job,deploy,sts,svc,cm,secret,sa,netpol -l {sel}"
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
