"""Ray backend: the job's node agents as detached Ray actors, one per Ray node.

Ray brings no etcd, so the CLI registers the job in the given (or embedded) etcd and this
launcher only places processes. Each actor is a thin supervisor: it runs the real
``hotspare agent`` (or ``hotspare controller``) as a child process and lives exactly as long
as that child. The agent spawns worker processes and relies on signals; inside an actor's
threads that is fragile, and ``PR_SET_PDEATHSIG`` is tied to the *thread* that forked. So the
child is forked by a supervisor thread that does nothing but wait for it, and gets
``PDEATHSIG = SIGKILL``: when Ray kills the actor's worker process (a node removed, the actor
killed), the agent dies, and its training workers follow through their own PDEATHSIG, like
a lost machine. When the child exits (the job ended), the actor kills itself, so no Ray
resources stay reserved.

Placement: ``ceil(ranks / ranks_per_node)`` active agents plus ``spares`` spare agents, each
pinned to a different alive node (``NodeAffinitySchedulingStrategy``, hard) that has
``ray.num_cpus`` CPUs and the ``ray.resources``; the head node is used last (as a spare when
it is needed at all: losing it loses the whole Ray cluster anyway). ``GPU`` in
``ray.resources`` becomes the actor's ``num_gpus``; Ray then sets ``CUDA_VISIBLE_DEVICES``
and the agent's workers inherit it. A node's agent is called ``ray-<node id[:8]>``.

A controller for the job (``hotspare controller --job J``) runs as one more detached actor
(no CPU reserved) on the head node and stops once none of the job's agent actors is left
(they exit when the job ends). With the embedded etcd the embedded controller runs as well;
the two elect a leader per job and the other is a standby, which is harmless.

The etcd TLS/auth settings of the submitting process (``$HOTSPARE_ETCD_CA`` ...) are passed to
the actors' children (paths must exist on every node); a password only as a file.

Actors are detached and named ``hotspare-<job>-<node>`` / ``hotspare-<job>-controller`` in
the namespace ``ray.namespace`` (default ``hotspare-<job>``): ``hotspare submit`` returns,
``hotspare status``/``cancel`` find them again from the launch record.

The embedded etcd listens on 127.0.0.1 only: it serves a one-machine Ray cluster; a cluster
that spans machines needs an external etcd (``etcd.endpoints`` in the spec, or ``--etcd``).
"""

from __future__ import annotations

import ctypes
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlparse

from ..spec import JobSpec
from . import LaunchError

#: Seconds launch waits for every actor to be scheduled and its child started.
START_TIMEOUT = float(os.environ.get("HOTSPARE_RAY_START_TIMEOUT", "60"))
#: Seconds cancel lets the actors exit on their own (agents stop on the etcd cancel key).
CANCEL_GRACE = 10.0
HEAD_RESOURCE = "node:__internal_head__"
_LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")
_ETCD_ENV = ("HOTSPARE_ETCD_CA", "HOTSPARE_ETCD_CERT", "HOTSPARE_ETCD_KEY", "HOTSPARE_ETCD_USER",
             "HOTSPARE_ETCD_PASSWORD_FILE")


# -- the spec's view ---------------------------------------------------------------------------
def _namespace(spec: JobSpec) -> str:
    return spec.ray.get("namespace") or f"hotspare-{spec.name}"


def _roles(spec: JobSpec) -> list[str]:
    return ["active"] * spec.nodes + ["spare"] * spec.spares


def _demand(spec: JobSpec) -> tuple[float, float, dict[str, float]]:
    """(num_cpus, num_gpus, custom resources) each agent actor reserves."""
    opts = spec.ray
    resources = {k: float(v) for k, v in (opts.get("resources") or {}).items()}
    gpus = resources.pop("GPU", 0.0)  # Ray wants these two as num_gpus / num_cpus
    cpus = resources.pop("CPU", 1.0)
    if opts.get("num_cpus") is not None:
        cpus = float(opts["num_cpus"])
    return cpus, gpus, resources


def _actor_name(job: str, node: str) -> str:
    return f"hotspare-{job}-{node}"


def _node_name(node_id: str, taken: set[str]) -> str:
    n = 8
    while f"ray-{node_id[:n]}" in taken:
        n += 4
    return f"ray-{node_id[:n]}"


def agent_args(job: str, node: str, endpoints: list[str], host: str, spare: bool, spec_sha256: str = "") -> list[str]:
    """The agent's command line after the interpreter (each node runs its own Python)."""
    args = ["-m", "hotspare.orchestrator.cli", "agent", "--job", job, "--node", node,
            "--etcd", ",".join(endpoints), "--host", host]
    if spec_sha256:  # the agent refuses a spec in etcd that is not the submitted one
        args += ["--spec-sha256", spec_sha256]
    return args + (["--spare"] if spare else [])


def controller_args(job: str, endpoints: list[str]) -> list[str]:
    return ["-m", "hotspare.orchestrator.cli", "controller", "--job", job, "--etcd", ",".join(endpoints)]


def _etcd_env() -> dict[str, str]:
    """The etcd TLS/auth settings of this process (see hotspare.orchestrator.store's ENV_OPTIONS), for
    the actors' children: they do not inherit this environment. Paths must be valid on every
    node. A password is never shipped through Ray (actor arguments live in its GCS)."""
    if os.environ.get("HOTSPARE_ETCD_PASSWORD") and not os.environ.get("HOTSPARE_ETCD_PASSWORD_FILE"):
        raise LaunchError("the etcd password would have to travel through Ray to the agents: give it "
                          "as a file present on every node instead ($HOTSPARE_ETCD_PASSWORD_FILE or "
                          "--etcd-password-file)")
    return {v: os.environ[v] for v in _ETCD_ENV if os.environ.get(v)}


# -- the actor -------------------------------------------------------------------------------
class Supervisor:
    """A Ray actor's body: one hotspare process as a child, living and dying with the actor.

    ``env``: variables added to the child's environment (etcd TLS/auth settings).
    ``outlive=(namespace, actor names)`` (the controller): stop the child once none of those
    actors (the job's agents, which exit when the job ends) is alive any more."""

    def __init__(self, args: list[str], log_path: str, env: dict[str, str] | None = None,
                 outlive: tuple[str, list[str]] | None = None) -> None:
        self._cmd = [sys.executable, *args]  # the Python this Ray node runs (hotspare installed)
        self._env = dict(env or {})
        self._log_path = Path(log_path)
        self._proc: subprocess.Popen | None = None
        self._error: str | None = None
        self._started = threading.Event()
        threading.Thread(target=self._run, name="hotspare-child", daemon=True).start()
        self._started.wait(30)
        if outlive is not None and self._proc is not None:
            threading.Thread(target=self._stop_after, args=outlive, name="hotspare-outlive",
                             daemon=True).start()

    def _run(self) -> None:
        # This thread forks the child and then only waits for it: PDEATHSIG fires when the
        # forking *thread* ends, so it must outlive the child (or die with the process).
        parent = os.getpid()
        prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl  # resolved before fork

        def die_with_actor() -> None:
            prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
            if os.getppid() != parent:  # the actor died between fork and prctl
                os._exit(1)

        try:
            self._log_path.parent.mkdir(parents=True, exist_ok=True)
            env = dict(os.environ, **self._env, PYTHONUNBUFFERED="1")
            with open(self._log_path, "ab") as log:
                self._proc = subprocess.Popen(self._cmd, stdout=log, stderr=subprocess.STDOUT,
                                              stdin=subprocess.DEVNULL, env=env,
                                              preexec_fn=die_with_actor)
        except OSError as e:
            self._error = f"cannot start {shlex.join(self._cmd)}: {e}"
        self._started.set()
        if self._proc is not None:
            self._proc.wait()
        self._exit()

    def _stop_after(self, namespace: str, names: list[str]) -> None:
        import ray

        while self._proc is not None and self._proc.poll() is None:
            time.sleep(2.0)
            try:
                alive = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                         if a.get("namespace") == namespace}
            except Exception:  # noqa: BLE001 - GCS briefly unreachable: ask again
                continue
            if not alive & set(names):
                self._proc.terminate()  # SIGTERM: the controller revokes its lease and exits
                return

    def _exit(self) -> None:
        """The child is gone: release the actor (and the resources it holds)."""
        import ray

        time.sleep(0.5)  # let a just-started launch read info() first
        ray.kill(ray.get_runtime_context().current_actor, no_restart=True)

    def info(self) -> dict:
        import ray

        ctx = ray.get_runtime_context()
        return {"ray_node": ctx.get_node_id(), "ip": ray.util.get_node_ip_address(),
                "pid": self._proc.pid if self._proc else None,
                "returncode": self._proc.poll() if self._proc else None, "error": self._error}


# -- connecting ------------------------------------------------------------------------------
def _import_ray():
    try:
        import ray
    except ImportError as e:
        raise LaunchError(f"the ray backend needs Ray: pip install 'hotspare[ray]' ({e})") from e
    return ray


def _probe(address: str | None) -> None:
    """Fail fast on a GCS address nobody listens at (ray.init would retry for minutes)."""
    if not address or address == "auto" or "://" in address or ":" not in address:
        return
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=3).close()
    except (OSError, ValueError) as e:
        raise LaunchError(f"no Ray cluster answers at {address} ({e}); check ray.address in the spec "
                          "(the head's GCS address, host:6379 by default)") from e


@contextmanager
def _connected(address: str | None, namespace: str) -> Iterator:
    """``ray`` connected to the cluster; disconnects afterwards unless it was connected already
    (detached actors outlive the connection)."""
    ray = _import_ray()
    owned = not ray.is_initialized()
    if owned:
        _probe(address)
        try:
            ray.init(address=address or "auto", namespace=namespace, ignore_reinit_error=True,
                     logging_level=logging.WARNING, log_to_driver=False)
        except Exception as e:  # noqa: BLE001 - Ray raises ConnectionError, RuntimeError, ValueError...
            raise LaunchError(
                f"cannot connect to a Ray cluster at {address or 'auto'}: {str(e).rstrip('.')}. Start one "
                "(`ray start --head`) or set ray.address in the spec") from e
    try:
        yield ray
    finally:
        if owned:
            ray.shutdown()


def _job_actors(ray, job: str, namespace: str) -> list[str]:
    """Names of the job's actors that are alive (or starting) now."""
    prefix = _actor_name(job, "")
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a.get("namespace") == namespace and a["name"].startswith(prefix))


# -- placement -------------------------------------------------------------------------------
def _fits(node: dict, cpus: float, gpus: float, resources: dict[str, float]) -> bool:
    have = node.get("Resources") or {}
    return (have.get("CPU", 0.0) >= cpus and have.get("GPU", 0.0) >= gpus
            and all(have.get(k, 0.0) >= v for k, v in resources.items()))


def pick_nodes(nodes: list[dict], spec: JobSpec) -> list[dict]:
    """One alive node per agent that can hold its reservation, the head node last."""
    roles = _roles(spec)
    cpus, gpus, resources = _demand(spec)
    alive = [n for n in nodes if n.get("Alive")]
    fit = sorted((n for n in alive if _fits(n, cpus, gpus, resources)),
                 key=lambda n: (HEAD_RESOURCE in (n.get("Resources") or {}), n["NodeID"]))
    if len(fit) < len(roles):
        want = {"CPU": cpus, **({"GPU": gpus} if gpus else {}), **resources}
        n_active = roles.count("active")
        raise LaunchError(
            f"needs {len(roles)} nodes ({n_active} active + {len(roles) - n_active} spare), "
            f"cluster has {len(fit)} that offer {want} ({len(alive)} alive in all); "
            "add nodes, or lower ray.num_cpus / ray.resources")
    return fit[: len(roles)]


def _loopback(endpoints: list[str]) -> bool:
    hosts = {urlparse(e if "://" in e else f"http://{e}").hostname or "" for e in endpoints}
    return hosts <= set(_LOOPBACK)


def check_etcd_reachable(endpoints: list[str], chosen: list[dict], here: str) -> None:
    """A loopback etcd (the embedded one) is reachable only from this machine (``here``)."""
    if not _loopback(endpoints):
        return
    elsewhere = sorted({n["NodeManagerAddress"] for n in chosen} - {here})
    if elsewhere:
        raise LaunchError(
            f"the job's etcd ({', '.join(endpoints)}) listens on this machine's loopback only, "
            f"but agents would run on {', '.join(elsewhere)}: on a multi-machine Ray cluster name "
            "an external etcd (etcd.endpoints in the spec, --etcd or $HOTSPARE_ETCD)")


# -- the launcher ----------------------------------------------------------------------------
class RayLauncher:
    brings_etcd = False

    def render(self, spec: JobSpec, endpoints: list[str]) -> str:
        job, opts = spec.name, spec.ray
        eps = endpoints or ["<embedded etcd>"]
        cpus, gpus, resources = _demand(spec)
        want = {"num_cpus": cpus, **({"num_gpus": gpus} if gpus else {}), **resources}
        roles = _roles(spec)
        node = "ray-<node id[:8]>"
        lines = [
            f"# Ray cluster {opts.get('address') or 'auto'}, namespace {_namespace(spec)}: "
            f"{len(roles)} detached agent actors, one per alive Ray node that has {want}, the head "
            "node last;",
            "# each actor runs its agent as a child process that dies with it (PDEATHSIG); logs in "
            f"{spec.log_dir}/agent-<node>.log",
        ]
        for role in ("active", "spare"):
            if roles.count(role):
                args = agent_args(job, node, eps, "<node ip>", role == "spare", spec.digest())
                lines.append(f"{roles.count(role)} x {role}: actor {_actor_name(job, node)}\n"
                             f"  python {shlex.join(args)}")
        lines.append(f"controller: actor {_actor_name(job, 'controller')} (num_cpus=0, on the head "
                     f"node; stops when the job ends)\n  python {shlex.join(controller_args(job, eps))}")
        if not endpoints or _loopback(endpoints):
            lines.append("# this etcd listens on 127.0.0.1: fine for a one-machine Ray cluster; a "
                         "multi-machine one needs an external etcd (etcd.endpoints)")
        return "\n".join(lines)

    def launch(self, spec: JobSpec, endpoints: list[str]) -> dict:
        if not endpoints:
            raise LaunchError("the ray backend needs etcd endpoints (it starts no etcd of its own)")
        job, opts, namespace = spec.name, spec.ray, _namespace(spec)
        log_dir = spec.log_dir
        env = _etcd_env()
        with _connected(opts.get("address"), namespace) as ray:
            left = _job_actors(ray, job, namespace)
            if left:
                raise LaunchError(f"actors of an earlier job {job!r} are still alive in Ray namespace "
                                  f"{namespace} ({', '.join(left)}): `hotspare cancel {job}` first")
            chosen = pick_nodes(ray.nodes(), spec)
            check_etcd_reachable(endpoints, chosen, ray.util.get_node_ip_address())
            handles, agents = self._start_agents(ray, spec, endpoints, chosen, log_dir, env)
            handles["controller"] = self._start_controller(
                ray, job, endpoints, namespace, log_dir, env, [a["actor"] for a in agents.values()])
            started = self._wait_started(ray, handles, log_dir)
            address = ray.get_runtime_context().gcs_address
        for node, a in agents.items():
            a["pid"] = started[node]["pid"]
        n_active = sum(a["role"] == "active" for a in agents.values())
        return {"address": address, "namespace": namespace, "job": job, "agents": agents,
                "controller": _actor_name(job, "controller"), "log_dir": str(log_dir),
                "summary": f"{len(agents)} agent actors ({n_active} active + {len(agents) - n_active} "
                           f"spare) on Ray nodes {', '.join(sorted(agents))} and a controller actor, "
                           f"Ray namespace {namespace}"}

    def _start_agents(self, ray, spec: JobSpec, endpoints: list[str], chosen: list[dict],
                      log_dir: Path, env: dict[str, str]) -> tuple[dict, dict]:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        job, namespace = spec.name, _namespace(spec)
        cpus, gpus, resources = _demand(spec)
        actor = ray.remote(Supervisor)
        handles: dict = {}
        agents: dict[str, dict] = {}
        for role, n in zip(_roles(spec), chosen, strict=True):
            node = _node_name(n["NodeID"], set(agents))
            args = agent_args(job, node, endpoints, n["NodeManagerAddress"], role == "spare", spec.digest())
            handles[node] = actor.options(
                name=_actor_name(job, node), namespace=namespace, lifetime="detached",
                num_cpus=cpus, num_gpus=gpus, resources=resources, max_restarts=0,
                scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False),
            ).remote(args, str(log_dir / f"agent-{node}.log"), env)
            agents[node] = {"actor": _actor_name(job, node), "role": role, "ray_node": n["NodeID"],
                            "ip": n["NodeManagerAddress"]}
        return handles, agents

    def _start_controller(self, ray, job: str, endpoints: list[str], namespace: str, log_dir: Path,
                          env: dict[str, str], agents: list[str]):
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        head = [n["NodeID"] for n in ray.nodes() if n.get("Alive") and HEAD_RESOURCE in n.get("Resources", {})]
        # hard affinity: a soft one does not even prefer the head node for a 0-CPU actor
        where = ({"scheduling_strategy": NodeAffinitySchedulingStrategy(head[0], soft=False)} if head else {})
        return ray.remote(Supervisor).options(
            name=_actor_name(job, "controller"), namespace=namespace, lifetime="detached",
            num_cpus=0, max_restarts=0, **where,
        ).remote(controller_args(job, endpoints), str(log_dir / "controller.log"), env,
                 (namespace, agents))

    def _wait_started(self, ray, handles: dict, log_dir: Path) -> dict[str, dict]:
        refs = {name: h.info.remote() for name, h in handles.items()}
        ready, pending = ray.wait(list(refs.values()), num_returns=len(refs), timeout=START_TIMEOUT)
        try:
            if pending:
                late = sorted(n for n, r in refs.items() if r in pending)
                raise LaunchError(f"actors not running after {START_TIMEOUT:.0f}s: {', '.join(late)} "
                                  "(their nodes' CPUs or resources are taken by other work?)")
            started = {name: ray.get(ref) for name, ref in refs.items()}
        except LaunchError:
            self._kill(ray, handles.values())
            raise
        except Exception as e:  # noqa: BLE001 - an actor that died in __init__ raises a RayActorError
            self._kill(ray, handles.values())
            raise LaunchError(f"an actor failed to start ({e}); see {log_dir}") from e
        bad = {n: s["error"] or f"exited at once with code {s['returncode']} (see {log_dir})"
               for n, s in started.items() if s["error"] or s["returncode"] is not None}
        if bad:
            self._kill(ray, handles.values())
            raise LaunchError("; ".join(f"{n}: {e}" for n, e in sorted(bad.items())))
        return started

    @staticmethod
    def _kill(ray, handles) -> int:
        n = 0
        for h in handles:
            try:
                ray.kill(h, no_restart=True)
                n += 1
            except Exception:  # noqa: BLE001 - already gone
                pass
        return n

    def describe(self, info: dict) -> str | None:
        try:
            with _connected(info.get("address"), info["namespace"]) as ray:
                alive = set(_job_actors(ray, info["job"], info["namespace"]))
                nodes = {n["NodeID"]: n.get("Alive") for n in ray.nodes()}
        except LaunchError as e:
            return f"Ray cluster unreachable ({e})"
        agents = info.get("agents", {})
        up = [n for n, a in agents.items() if a["actor"] in alive]
        lost = [n for n, a in agents.items() if not nodes.get(a["ray_node"])]
        return (f"{len(up)}/{len(agents)} agent actors alive"
                + (f", Ray node(s) of {', '.join(sorted(lost))} gone" if lost else "")
                + f"; controller actor {'alive' if info.get('controller') in alive else 'gone'}")

    def ended(self, info: dict) -> bool:
        """True once none of the job's actors is alive (False while Ray cannot be reached)."""
        try:
            with _connected(info.get("address"), info["namespace"]) as ray:
                return not _job_actors(ray, info["job"], info["namespace"])
        except LaunchError:
            return False

    def cancel(self, info: dict) -> str | None:
        """Give the actors CANCEL_GRACE seconds to exit on their own (the agents stop on the
        etcd cancel key, then the controller), then kill what is left."""
        job, namespace = info["job"], info["namespace"]
        with _connected(info.get("address"), namespace) as ray:
            before = _job_actors(ray, job, namespace)
            deadline = time.monotonic() + CANCEL_GRACE
            left = before
            while left and time.monotonic() < deadline:
                time.sleep(0.5)
                left = _job_actors(ray, job, namespace)
            handles = []
            for name in left:
                try:
                    handles.append(ray.get_actor(name, namespace=namespace))
                except ValueError:  # exited just now
                    pass
            killed = self._kill(ray, handles)
        if not before:
            return f"Ray: no actors of {job} left in namespace {namespace}"
        return (f"Ray: {len(before) - len(left)} of {len(before)} actor(s) exited on their own, "
                f"killed {killed}")
