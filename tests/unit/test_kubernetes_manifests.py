"""Kubernetes backend: the rendered manifests, checked offline; the apply path's errors.

No API server can run where this is developed, so every rendered document is validated against
the Kubernetes 1.30 schema and the newest one kubernetes-validate ships (strict: an unknown or
misspelt field is an error) and round-tripped through the kubernetes client's models. The two
tests that talk to a real cluster skip, saying why, when none is reachable.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import kubernetes_validate as kv
import pytest
import yaml
from kubernetes.client import ApiClient
from packaging.version import Version

from hotspare.orchestrator.launchers import LaunchError
from hotspare.orchestrator.launchers import kubernetes as k8s
from hotspare.orchestrator.spec import JobSpec, load_spec

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "kubernetes.yaml"
SECRET = "5e" * 32
EXTERNAL = ["http://etcd-0.etcd.infra:2379", "http://etcd-1.etcd.infra:2379"]
GPU_OPTS = {"kubernetes.gpus": 2, "kubernetes.node_selector": {"cloud.example/pool": "a100"},
            "kubernetes.output_pvc": "hotspare-runs", "ranks_per_node": 2, "ranks": 6, "spares": 2}
#: name -> (spec overrides, etcd endpoints given to the launcher)
SCENARIOS = {
    "in-cluster-etcd": ({}, []),
    "external-etcd": ({}, EXTERNAL),
    "gpus-selector-pvc": (GPU_OPTS, []),
}
SCHEMA_VERSIONS = ("1.30", kv.latest_version())


def resolved(**overrides) -> JobSpec:
    spec = load_spec(CONFIG, overrides)
    return dataclasses.replace(spec, output_dir="/home/someone/.hotspare/jobs/" + spec.name)  # as the CLI does


def render(scenario: str) -> tuple[JobSpec, list[dict]]:
    overrides, endpoints = SCENARIOS[scenario]
    spec = resolved(**overrides)
    return spec, k8s.manifests(spec, endpoints, SECRET)


def of_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def agent_jobs(docs: list[dict]) -> dict[str, dict]:
    return {j["metadata"]["labels"]["hotspare/pool"]: j for j in of_kind(docs, "Job")}


def pod_specs(docs: list[dict]) -> list[dict]:
    return [d["spec"]["template"]["spec"] for d in docs if "template" in d.get("spec", {})]


def agent_command(job: dict) -> list[str]:
    return job["spec"]["template"]["spec"]["containers"][0]["command"]


# -- offline validation ---------------------------------------------------------------------
def test_newest_schema_is_found_not_hard_coded():
    assert Version(kv.latest_version()) >= Version("1.30")


@pytest.mark.parametrize("version", SCHEMA_VERSIONS)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_every_document_passes_strict_schema_validation(scenario, version):
    _, docs = render(scenario)
    for doc in docs:
        try:
            kv.validate(doc, version, strict=True)
        except kv.ValidationError as e:
            path = ".".join(str(p) for p in e.path)
            pytest.fail(f"{doc['kind']}/{doc['metadata']['name']} invalid for Kubernetes "
                        f"{version}: {path}: {e.message}")


def test_strict_validation_catches_a_misspelt_field():
    _, docs = render("in-cluster-etcd")
    job = agent_jobs(docs)["active"]
    job["spec"]["template"]["spec"]["containers"][0]["volumeMount"] = []
    with pytest.raises(kv.ValidationError, match="volumeMount"):
        kv.validate(job, "1.30", strict=True)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_every_document_round_trips_through_the_client_models(scenario):
    """The client drops fields its model does not know, so a typo shows up as a difference."""
    api = ApiClient()
    _, docs = render(scenario)
    for doc in docs:
        model = doc["apiVersion"].split("/")[-1].capitalize() + doc["kind"]  # V1Job, ...
        obj = api._ApiClient__deserialize(json.loads(json.dumps(doc)), model)
        assert api.sanitize_for_serialization(obj) == doc, f"{model} {doc['metadata']['name']}"


# -- what the manifests say -----------------------------------------------------------------
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_one_agent_pod_per_node_plus_spares_with_required_anti_affinity(scenario):
    spec, docs = render(scenario)
    jobs = agent_jobs(docs)
    nodes = -(-spec.ranks // spec.ranks_per_node)
    assert jobs["active"]["spec"]["parallelism"] == jobs["active"]["spec"]["completions"] == nodes
    assert jobs["spare"]["spec"]["parallelism"] == jobs["spare"]["spec"]["completions"] == spec.spares
    for job in jobs.values():
        pod = job["spec"]["template"]["spec"]
        assert job["spec"]["completionMode"] == "Indexed"
        assert pod["restartPolicy"] == "OnFailure"
        assert pod["terminationGracePeriodSeconds"] <= 15
        (term,) = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert term["topologyKey"] == "kubernetes.io/hostname"
        # one selector over both pools: a spare never shares a Kubernetes node with an active agent
        assert term["labelSelector"]["matchLabels"] == {
            "app.kubernetes.io/name": "hotspare", "app.kubernetes.io/instance": spec.name,
            "hotspare/role": "agent"}
        assert term["labelSelector"]["matchLabels"].items() <= job["spec"]["template"]["metadata"]["labels"].items()


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_spare_flag_is_exactly_on_the_spare_pool(scenario):
    spec, docs = render(scenario)
    endpoints = SCENARIOS[scenario][1] or [k8s.etcd_url(spec.name, "default")]
    for pool, job in agent_jobs(docs).items():
        cmd = agent_command(job)
        assert ("--spare" in cmd) == (pool == "spare")
        i = cmd.index("hotspare")
        assert cmd[i:i + 4] == ["hotspare", "agent", "--job", spec.name]
        assert cmd[cmd.index("--etcd") + 1] == ",".join(endpoints)
        assert cmd[cmd.index("--node") + 1] == "$(POD_NAME)"
        assert cmd[cmd.index("--host") + 1] == "$(POD_IP)"
        env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] if "valueFrom" in e else e["value"]
               for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}
        assert env == {"POD_NAME": "metadata.name", "POD_IP": "status.podIP", "HOME": "/tmp"}


def test_agent_wrapper_keeps_exit_codes_and_makes_termination_a_failure():
    """A drained agent exits 0 on SIGTERM; its pod must still count as failed (and be replaced)."""
    _, docs = render("in-cluster-etcd")
    sh = agent_command(agent_jobs(docs)["active"])[:4]  # sh -c WRAPPER $0
    assert subprocess.run([*sh, "sh", "-c", "exit 3"]).returncode == 3
    assert subprocess.run([*sh, "true"]).returncode == 0
    child = "trap 'exit 0' TERM; sleep 30 & wait"  # like the agent: stops cleanly on SIGTERM
    p = subprocess.Popen([*sh, "sh", "-c", child])
    time.sleep(0.3)
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=10) == 143


def test_controller_is_a_two_replica_deployment_that_registers_the_job():
    spec, docs = render("in-cluster-etcd")
    (dep,) = of_kind(docs, "Deployment")
    assert dep["spec"]["replicas"] == 2
    c = dep["spec"]["template"]["spec"]["containers"][0]
    assert c["command"] == ["hotspare", "controller", "--job", "kube-demo", "--etcd",
                            k8s.etcd_url("kube-demo", "default"), "--register", "/etc/hotspare/spec.json"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env == {"HOTSPARE_JOB_SECRET_FILE": "/etc/hotspare-secret/secret", "HOME": "/tmp"}  # a file, not a value
    vols = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
    assert vols["spec"]["configMap"]["name"] == "hotspare-kube-demo-spec"
    assert vols["secret"]["secret"] == {"secretName": "hotspare-kube-demo-secret", "defaultMode": 0o400}
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert mounts["secret"] == "/etc/hotspare-secret"


def test_the_secret_is_in_the_secret_and_nowhere_else():
    _, docs = render("in-cluster-etcd")
    (secret,) = of_kind(docs, "Secret")
    assert secret["stringData"] == {"secret": SECRET}
    assert bytes.fromhex(SECRET) and len(SECRET) == 64
    others = [d for d in docs if d["kind"] != "Secret"]
    assert SECRET not in json.dumps(others)
    assert SECRET not in of_kind(docs, "ConfigMap")[0]["data"]["spec.json"]


def test_dry_run_rendering_prints_no_secret_value():
    spec = resolved()
    out = k8s.KubernetesLauncher().render(spec, [])
    secret = next(d for d in yaml.safe_load_all(out) if d["kind"] == "Secret")
    assert secret["stringData"] == {"secret": ""}  # the controller then generates one


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_no_pod_gets_api_access(scenario):
    """hotspare coordinates through etcd: no Role, and no token mounted into any pod."""
    spec, docs = render(scenario)
    rbac = {"Role", "ClusterRole", "RoleBinding", "ClusterRoleBinding"}
    assert not [d for d in docs if d["kind"] in rbac]
    (sa,) = of_kind(docs, "ServiceAccount")
    assert sa["automountServiceAccountToken"] is False
    pods = pod_specs(docs)
    assert len(pods) == (4 if scenario != "external-etcd" else 3)
    for pod in pods:
        assert pod["serviceAccountName"] == sa["metadata"]["name"]
        assert pod["automountServiceAccountToken"] is False
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == 10001
        for c in pod["containers"] + pod.get("initContainers", []):
            assert c["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                            "capabilities": {"drop": ["ALL"]}}
            assert {"name": "tmp", "mountPath": "/tmp"} in c["volumeMounts"]  # the one writable place besides volumes


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_only_the_jobs_own_pods_may_connect_to_its_pods(scenario):
    """Security review F1 (Kubernetes): the in-cluster etcd has no auth, and nothing stopped
    any pod of any namespace from reading the job's secret and rewriting its keys. A
    NetworkPolicy admits only the job's own pods to all of the job's pods (etcd, agents'
    replica servers, workers' collectives)."""
    spec, docs = render(scenario)
    (np_,) = of_kind(docs, "NetworkPolicy")
    mine = {"app.kubernetes.io/name": "hotspare", "app.kubernetes.io/instance": spec.name}
    assert np_["spec"]["podSelector"] == {"matchLabels": mine}
    assert np_["spec"]["policyTypes"] == ["Ingress"]
    assert np_["spec"]["ingress"] == [{"from": [{"podSelector": {"matchLabels": mine}}]}]
    for pod in of_kind(docs, "StatefulSet") + of_kind(docs, "Deployment") + of_kind(docs, "Job"):
        assert mine.items() <= pod["spec"]["template"]["metadata"]["labels"].items()  # covered by the policy


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_dev_shm_is_a_memory_backed_volume(scenario):
    _, docs = render(scenario)
    for job in agent_jobs(docs).values():
        pod = job["spec"]["template"]["spec"]
        vols = {v["name"]: v for v in pod["volumes"]}
        mounts = {m["mountPath"]: m["name"] for m in pod["containers"][0]["volumeMounts"]}
        assert vols[mounts["/dev/shm"]]["emptyDir"] == {"medium": "Memory", "sizeLimit": "2Gi"}


def test_external_endpoints_render_no_etcd():
    _, docs = render("external-etcd")
    assert not of_kind(docs, "StatefulSet")
    assert not [d for d in docs if d["metadata"]["labels"].get("hotspare/role") == "etcd"]
    for pod in pod_specs(docs):
        assert "initContainers" not in pod  # the CLI registered the job there: etcd is up
    (dep,) = of_kind(docs, "Deployment")
    cmd = dep["spec"]["template"]["spec"]["containers"][0]["command"]
    assert cmd[cmd.index("--etcd") + 1] == ",".join(EXTERNAL)
    cm = json.loads(of_kind(docs, "ConfigMap")[0]["data"]["spec.json"])
    assert cm["etcd"]["endpoints"] == EXTERNAL


def test_in_cluster_etcd_is_one_fast_member_on_an_empty_dir():
    _, docs = render("in-cluster-etcd")
    (sts,) = of_kind(docs, "StatefulSet")
    assert sts["spec"]["replicas"] == 1
    pod = sts["spec"]["template"]["spec"]
    cmd = pod["containers"][0]["command"]
    assert pod["containers"][0]["image"] == k8s.DEFAULT_ETCD_IMAGE
    assert cmd[cmd.index("--heartbeat-interval") + 1] == "50"
    assert cmd[cmd.index("--election-timeout") + 1] == "500"
    assert cmd[cmd.index("--advertise-client-urls") + 1] == "http://hotspare-kube-demo-etcd.default.svc:2379"
    assert pod["volumes"] == [{"name": "tmp", "emptyDir": {}}, {"name": "data", "emptyDir": {}}]
    svc = next(d for d in of_kind(docs, "Service") if d["metadata"]["name"] == sts["spec"]["serviceName"])
    assert svc["spec"]["ports"][0]["port"] == 2379
    agents = next(d for d in of_kind(docs, "Service") if d["metadata"]["name"].endswith("-agents"))
    assert agents["spec"]["clusterIP"] == "None"
    for job in agent_jobs(docs).values():
        assert job["spec"]["template"]["spec"]["subdomain"] == agents["metadata"]["name"]


def test_gpus_node_selector_and_output_claim():
    spec, docs = render("gpus-selector-pvc")
    for job in agent_jobs(docs).values():
        pod = job["spec"]["template"]["spec"]
        res = pod["containers"][0]["resources"]
        assert res["limits"] == res["requests"] == {"cpu": "2", "memory": "6Gi", "nvidia.com/gpu": "2"}
        assert pod["nodeSelector"] == {"cloud.example/pool": "a100"}
        output = next(v for v in pod["volumes"] if v["name"] == "output")
        assert output == {"name": "output", "persistentVolumeClaim": {"claimName": "hotspare-runs"}}
    assert agent_jobs(docs)["active"]["spec"]["parallelism"] == 3  # 6 ranks, 2 per node


def test_output_dir_is_an_empty_dir_without_a_claim():
    _, docs = render("in-cluster-etcd")
    for job in agent_jobs(docs).values():
        pod = job["spec"]["template"]["spec"]
        assert {"name": "output", "emptyDir": {}} in pod["volumes"]
        assert {"name": "output", "mountPath": "/var/lib/hotspare"} in pod["containers"][0]["volumeMounts"]


def test_configmap_holds_the_spec_as_the_pods_see_it():
    spec = resolved()
    spec = dataclasses.replace(spec, etcd=dataclasses.replace(spec.etcd, user="root", password="hunter2"))
    # credentials never go to a ConfigMap
    docs = k8s.manifests(spec, EXTERNAL, SECRET)
    text = of_kind(docs, "ConfigMap")[0]["data"]["spec.json"]
    assert "hunter2" not in text
    d = json.loads(text)
    JobSpec.from_dict(d)  # what `hotspare controller --register` accepts
    assert d["entrypoint"] == "/opt/hotspare/examples/gpt.py:train"
    assert d["output_dir"] == "/var/lib/hotspare/kube-demo"
    assert d["etcd"]["endpoints"] == EXTERNAL
    assert {k: d[k] for k in ("ranks", "spares", "steps")} == {"ranks": 4, "spares": 1, "steps": 200}


def test_entrypoints_outside_the_checkout_keep_their_path():
    assert k8s.image_entrypoint(str(REPO / "examples" / "allreduce.py") + ":train") == \
        "/opt/hotspare/examples/allreduce.py:train"
    assert k8s.image_entrypoint("/srv/jobs/train.py:main") == "/srv/jobs/train.py:main"
    assert k8s.image_entrypoint("mypkg.train:main") == "mypkg.train:main"


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_names_labels_and_namespace(scenario):
    spec, docs = render(scenario)
    for d in docs:
        meta = d["metadata"]
        assert meta["name"].startswith("hotspare-kube-demo")
        assert meta["namespace"] == "default"
        assert meta["labels"]["app.kubernetes.io/name"] == "hotspare"
        assert meta["labels"]["app.kubernetes.io/instance"] == "kube-demo"
        if d["kind"] in ("StatefulSet", "Deployment", "Job"):
            assert d["spec"]["template"]["metadata"]["labels"]["hotspare/role"] in ("etcd", "controller", "agent")


def test_namespace_option_moves_every_object_and_the_etcd_url():
    spec = resolved(**{"kubernetes.namespace": "training"})
    docs = k8s.manifests(spec, [], SECRET)
    assert {d["metadata"]["namespace"] for d in docs} == {"training"}
    assert k8s.etcd_url("kube-demo", "training") in agent_command(agent_jobs(docs)["active"])


def test_no_spares_renders_no_spare_job():
    spec = resolved(spares=0)
    assert set(agent_jobs(k8s.manifests(spec, [], SECRET))) == {"active"}


@pytest.mark.parametrize("overrides, message", [
    ({"name": "a" * 39}, "39 characters"),
    ({"kubernetes.image_pull_policy": "Sometimes"}, "image_pull_policy"),
    ({"kubernetes.memory": "16 GB"}, "kubernetes.memory"),
])
def test_bad_kubernetes_options_fail_before_anything_is_created(overrides, message):
    with pytest.raises(LaunchError, match=message):
        k8s.manifests(resolved(**overrides), [], SECRET)


# -- the CLI --------------------------------------------------------------------------------
def cli(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items()
         if k not in ("HOTSPARE_ETCD", "KUBERNETES_SERVICE_HOST", "KUBECONFIG")}
    e.update(HOTSPARE_STATE_DIR=str(tmp_path / "state"), **env)
    return subprocess.run([sys.executable, "-m", "hotspare.orchestrator.cli", *args], cwd=REPO, env=e,
                          capture_output=True, text=True, timeout=60)


def test_submit_dry_run_prints_the_manifests(tmp_path):
    r = cli(tmp_path, "submit", "--dry-run", str(CONFIG))
    assert r.returncode == 0, r.stderr
    manifest_text = r.stdout.split("# what `hotspare submit` would do (kubernetes backend)\n", 1)[1]
    docs = list(yaml.safe_load_all(manifest_text))
    assert [d["kind"] for d in docs] == ["ServiceAccount", "NetworkPolicy", "Secret", "ConfigMap", "Service",
                                         "StatefulSet", "Service", "Deployment", "Job", "Job"]
    assert "kubectl port-forward -n default svc/hotspare-kube-demo-etcd 2379" in r.stdout
    assert "&id" not in manifest_text  # shared label dicts are written out, not as YAML anchors
    assert not (tmp_path / "state" / "launched").exists()  # nothing was submitted


def test_submit_without_a_cluster_fails_with_one_clear_error(tmp_path):
    r = cli(tmp_path, "submit", str(CONFIG), KUBECONFIG=str(tmp_path / "no-such-kubeconfig"))
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith("hotspare submit: error: kubernetes: no Kubernetes cluster configured")
    assert "kubeconfig" in line and "no-such-kubeconfig" in line
    assert not (tmp_path / "state" / "launched" / "kube-demo.json").exists()


def test_status_and_cancel_without_a_cluster_say_so(monkeypatch, tmp_path):
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "none"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    info = {"namespace": "default", "context": None, "job": "kube-demo", "selector": k8s.selector("kube-demo")}
    launcher = k8s.KubernetesLauncher()
    assert launcher.describe(info).startswith("cluster not reachable: no Kubernetes cluster configured")
    assert launcher.ended(info) is False  # unknown is not "ended"
    said = launcher.cancel(info)
    assert said.startswith("could not delete") and "kubectl delete -n default" in said


# -- the apply path against a stand-in API server -------------------------------------------
class FakeApiServer:
    """Just enough of an API server for launch/describe/ended/cancel over plain HTTP: objects
    kept per collection URL; POST creates (409 for names in ``conflict``), GET lists (label
    selectors ignored: everything stored belongs to the job), DELETE removes."""

    def __init__(self) -> None:
        self.objects: dict[str, dict[str, dict]] = {}
        self.calls: list[tuple[str, str]] = []
        self.conflict: set[str] = set()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _send(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _body(self) -> dict:
                n = int(self.headers.get("Content-Length") or 0)
                return json.loads(self.rfile.read(n)) if n else {}

            def do_GET(self) -> None:
                path = self.path.split("?")[0]
                outer.calls.append(("GET", path))
                if path.rstrip("/") == "/version":
                    return self._send(200, {
                        "major": "1", "minor": "30", "gitVersion": "v1.30.0", "gitCommit": "0" * 40,
                        "gitTreeState": "clean", "buildDate": "2024-04-17T00:00:00Z",
                        "goVersion": "go1.22.2", "compiler": "gc", "platform": "linux/amd64"})
                items = list(outer.objects.get(path, {}).values())
                self._send(200, {"apiVersion": "v1", "kind": "List", "metadata": {}, "items": items})

            def do_POST(self) -> None:
                path, body = self.path.split("?")[0], self._body()
                name = body["metadata"]["name"]
                outer.calls.append(("POST", f"{path}/{name}"))
                if name in outer.conflict:
                    return self._send(409, {"apiVersion": "v1", "kind": "Status", "status": "Failure",
                                            "reason": "AlreadyExists", "code": 409,
                                            "message": f"{name} already exists"})
                outer.objects.setdefault(path, {})[name] = body
                self._send(201, body)

            def do_DELETE(self) -> None:
                self._body()
                path = self.path.split("?")[0]
                outer.calls.append(("DELETE", path))
                coll, _, name = path.rpartition("/")
                outer.objects.get(coll, {}).pop(name, None)
                self._send(200, {"apiVersion": "v1", "kind": "Status", "status": "Success"})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True).start()


def write_kubeconfig(path: Path, server: str, context: str = "fake") -> Path:
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": context,
        "clusters": [{"name": "c", "cluster": {"server": server}}],
        "users": [{"name": "u", "user": {"token": "not-a-real-token"}}],
        "contexts": [{"name": context, "context": {"cluster": "c", "user": "u"}}]}))
    return path


@pytest.fixture
def fake_api(monkeypatch, tmp_path):
    server = FakeApiServer()
    monkeypatch.setenv("KUBECONFIG", str(write_kubeconfig(tmp_path / "kubeconfig", server.url)))
    yield server
    server.httpd.shutdown()
    server.httpd.server_close()


def pod(name: str, role: str, phase: str, waiting: str | None = None) -> dict:
    status: dict = {"phase": phase}
    if waiting:
        status["containerStatuses"] = [{"name": "c", "image": "i", "imageID": "", "ready": False,
                                        "restartCount": 0, "state": {"waiting": {"reason": waiting}}}]
    return {"metadata": {"name": name, "labels": {"hotspare/role": role}}, "status": status}


def test_launch_creates_the_objects_in_order_then_describe_ended_cancel(fake_api):
    launcher = k8s.KubernetesLauncher()
    info = launcher.launch(resolved(), [])
    posted = [path for method, path in fake_api.calls if method == "POST"]
    assert posted == [
        "/api/v1/namespaces/default/serviceaccounts/hotspare-kube-demo",
        "/apis/networking.k8s.io/v1/namespaces/default/networkpolicies/hotspare-kube-demo-ingress",
        "/api/v1/namespaces/default/secrets/hotspare-kube-demo-secret",
        "/api/v1/namespaces/default/configmaps/hotspare-kube-demo-spec",
        "/api/v1/namespaces/default/services/hotspare-kube-demo-etcd",
        "/apis/apps/v1/namespaces/default/statefulsets/hotspare-kube-demo-etcd",
        "/api/v1/namespaces/default/services/hotspare-kube-demo-agents",
        "/apis/apps/v1/namespaces/default/deployments/hotspare-kube-demo-controller",
        "/apis/batch/v1/namespaces/default/jobs/hotspare-kube-demo-active",
        "/apis/batch/v1/namespaces/default/jobs/hotspare-kube-demo-spare",
    ]
    secret = fake_api.objects["/api/v1/namespaces/default/secrets"]["hotspare-kube-demo-secret"]
    value = secret["stringData"]["secret"]
    assert len(bytes.fromhex(value)) == 32  # a real one, generated at launch
    assert value not in json.dumps(fake_api.objects["/api/v1/namespaces/default/configmaps"])
    assert info["context"] == "fake" and info["namespace"] == "default"
    assert info["endpoints_hint"] == "http://hotspare-kube-demo-etcd.default.svc:2379"
    assert "endpoints" not in info  # not reachable from here: see the note
    assert "kubectl port-forward -n default svc/hotspare-kube-demo-etcd 2379" in info["note"]
    json.dumps(info)  # the CLI keeps it as JSON

    fake_api.objects["/api/v1/namespaces/default/pods"] = {p["metadata"]["name"]: p for p in [
        pod("e-0", "etcd", "Running"), pod("c-1", "controller", "Running"),
        pod("c-2", "controller", "Running"), *(pod(f"a-{i}", "agent", "Running") for i in range(4)),
        pod("s-0", "agent", "Pending", waiting="ImagePullBackOff")]}
    assert launcher.describe(info) == ("agent 1 ImagePullBackOff, 4 Running; controller 2 Running; "
                                       "etcd 1 Running")
    assert launcher.ended(info) is False  # the agent Jobs have no Complete/Failed condition yet
    for job in fake_api.objects["/apis/batch/v1/namespaces/default/jobs"].values():
        job["status"] = {"conditions": [{"type": "Complete", "status": "True"}]}
    assert launcher.ended(info) is True

    said = launcher.cancel(info)
    deleted = [path for method, path in fake_api.calls if method == "DELETE"]
    assert sorted(deleted) == sorted(posted)
    assert said.startswith("deleted from namespace default: Job/hotspare-kube-demo-active, ")
    assert launcher.cancel(info) == "no Kubernetes objects of job kube-demo left in namespace default"
    del fake_api.objects["/api/v1/namespaces/default/pods"]
    assert launcher.ended(info) is True  # everything gone


def test_cli_submit_records_what_cancel_needs(fake_api, tmp_path):
    kubeconfig = os.environ["KUBECONFIG"]
    r = cli(tmp_path, "submit", str(CONFIG), KUBECONFIG=kubeconfig)
    assert r.returncode == 0, r.stderr
    assert "submitted kube-demo to kubernetes (etcd starts inside the job); 10 objects" in r.stdout
    rec = json.loads((tmp_path / "state" / "launched" / "kube-demo.json").read_text())
    assert rec["backend"] == "kubernetes" and rec["endpoints"] == [] and rec["info"]["context"] == "fake"
    # what `hotspare cancel kube-demo` does with the record when the job's etcd is out of reach
    said = k8s.KubernetesLauncher().cancel(rec["info"])
    assert said.startswith("deleted from namespace default: Job/hotspare-kube-demo-active")
    assert not any(fake_api.objects.values())


def test_launch_rolls_back_only_what_it_created(fake_api):
    fake_api.conflict.add("hotspare-kube-demo-controller")
    with pytest.raises(LaunchError) as e:
        k8s.KubernetesLauncher().launch(resolved(), [])
    msg = str(e.value)
    assert "creating Deployment hotspare-kube-demo-controller in namespace default" in msg
    assert "409" in msg and "`hotspare cancel kube-demo` first" in msg
    assert "removed the 7 object(s) it had created" in msg
    deleted = [path for method, path in fake_api.calls if method == "DELETE"]
    assert len(deleted) == 7 and not any("deployments" in p for p in deleted)
    assert not any(fake_api.objects.values())


def test_launch_against_an_unreachable_server_says_where(monkeypatch, tmp_path):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("KUBECONFIG", str(write_kubeconfig(tmp_path / "kc", f"http://127.0.0.1:{port}", "dead")))
    with pytest.raises(LaunchError, match=rf"not reachable at http://127.0.0.1:{port} "
                                          r"\(kubeconfig context 'dead'\)"):
        k8s.KubernetesLauncher().launch(resolved(), [])


# -- a real cluster (skipped here: none can run on this machine) -----------------------------
@pytest.fixture
def live_cluster():
    """(ApiClient, context) of the current kubeconfig context, or skip saying why."""
    try:
        api, context = k8s._api(timeout_retries=0)
        k8s._reachable(api, context)
    except LaunchError as e:
        pytest.skip(f"no Kubernetes cluster reachable: {e}")
    return api, context


def test_manifests_pass_server_side_dry_run(live_cluster):
    """The API server's own validation and admission, creating nothing (dryRun=All)."""
    from kubernetes import utils

    api, _ = live_cluster
    ns = os.environ.get("HOTSPARE_TEST_NAMESPACE", "default")
    spec = resolved(**{"kubernetes.namespace": ns})
    for doc in k8s.manifests(spec, [], SECRET):
        utils.create_from_dict(api, doc, namespace=ns, dry_run="All")


def test_launch_describe_cancel_on_a_live_cluster(live_cluster):
    if os.environ.get("HOTSPARE_TEST_KUBERNETES") != "1":
        pytest.skip(f"a cluster is reachable (context {live_cluster[1]!r}) but this test creates "
                    "objects in it: set HOTSPARE_TEST_KUBERNETES=1 to run it")
    ns = os.environ.get("HOTSPARE_TEST_NAMESPACE", "default")
    name = f"kt-{uuid.uuid4().hex[:8]}"
    spec = resolved(name=name, **{"kubernetes.namespace": ns})
    launcher = k8s.KubernetesLauncher()
    info = launcher.launch(spec, [])
    try:
        assert info["endpoints_hint"] == k8s.etcd_url(name, ns)
        assert len(info["objects"]) == 9
        assert launcher.describe(info)
        assert launcher.ended(info) is False
    finally:
        said = launcher.cancel(info)
    assert said.startswith(f"deleted from namespace {ns}:") and f"Job/hotspare-{name}-active" in said


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_agents_are_pinned_to_the_spec_the_controller_registers(scenario):
    """Every agent gets --spec-sha256 of the ConfigMap's spec.json (what the controller
    registers), so a spec rewritten in etcd is refused (docs/security.md)."""
    _spec, docs = render(scenario)
    registered = JobSpec.from_dict(json.loads(of_kind(docs, "ConfigMap")[0]["data"]["spec.json"]))
    for job in agent_jobs(docs).values():
        cmd = agent_command(job)
        assert cmd[cmd.index("--spec-sha256") + 1] == registered.digest()
