"""torchrun's ``hotspare-etcd`` rendezvous: real torchrun processes, a real etcd 3.4 (v3 API
only), gloo on loopback; plus the endpoint/conf parsing errors and the backend's
compare-and-set contract."""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time
from datetime import timedelta
from importlib.metadata import entry_points
from pathlib import Path

import pytest
from torch.distributed.elastic.rendezvous import RendezvousConnectionError, RendezvousParameters
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

from hotspare.orchestrator import torchrun_rdzv as rdzv
from hotspare.orchestrator.etcd_server import EtcdServer, free_port
from hotspare.orchestrator.store import Store

RUN_ID = "tr1"
PREFIX = f"/hotspare-torchrun/{RUN_ID}/"
VICTIM = 1  # global rank that SIGKILLs itself in the first attempt

WORKER = textwrap.dedent(
    """
    import json, os, sys
    from datetime import timedelta
    import torch
    import torch.distributed as dist

    out, victim = sys.argv[1], int(sys.argv[2])
    env = os.environ
    me = {"rank": int(env["RANK"]), "world": int(env["WORLD_SIZE"]),
          "group_rank": int(env["GROUP_RANK"]), "master_port": int(env["MASTER_PORT"]),
          "restart": int(env["TORCHELASTIC_RESTART_COUNT"]), "pid": os.getpid()}
    with open(os.path.join(out, "started.jsonl"), "a") as f:
        f.write(json.dumps(me) + "\\n")
    dist.init_process_group("gloo", timeout=timedelta(seconds=20))
    first = torch.tensor([float(me["rank"] + 1)])
    dist.all_reduce(first)
    if me["restart"] == 0 and me["rank"] == victim:
        os.kill(os.getpid(), 9)
    second = torch.tensor([10.0 * (me["rank"] + 1)])
    dist.all_reduce(second)  # survivors of a killed peer fail or hang here
    me.update(first=first.item(), second=second.item())
    with open(os.path.join(out, f"rank{me['rank']}.json"), "w") as f:
        json.dump(me, f)
    dist.destroy_process_group()
    """
)


def _params(endpoint: str = "127.0.0.1:2379", run_id: str = RUN_ID, **conf: str):
    return RendezvousParameters("hotspare-etcd", endpoint, run_id, 2, 2, **conf)


# -- parsing, no server -----------------------------------------------------------------
def test_endpoint_forms_normalise_to_urls_with_the_etcd_default_port():
    assert rdzv.parse_endpoints("127.0.0.1:2380") == ("http://127.0.0.1:2380",)
    assert rdzv.parse_endpoints("etcd1") == ("http://etcd1:2379",)
    assert rdzv.parse_endpoints(" HTTPS://e1:1 , e2:2", tls=True) == ("https://e1:1", "https://e2:2")


@pytest.mark.parametrize(
    "endpoint, words",
    [
        ("", ["needs --rdzv-endpoint"]),
        ("e1:2379,,e2:2379", ["'e1:2379,,e2:2379'", "empty entry"]),
        ("e1:99999", ["'e1:99999'", "1-65535"]),
        ("e1:abc", ["'e1:abc'", "port"]),
        ("e1:0", ["'e1:0'", "port"]),
        ("ftp://e1:2379", ["'ftp://e1:2379'", "scheme 'ftp'"]),
        ("http://e1:2379/v2/keys", ["'http://e1:2379/v2/keys'", "nothing more"]),
        ("[::1]:2379", ["'[::1]:2379'", "IPv6"]),
        ("http://:2379", ["no host"]),
    ],
)
def test_bad_endpoint_is_a_value_error_naming_it(endpoint, words):
    with pytest.raises(ValueError) as e:
        rdzv.parse_endpoints(endpoint)
    for w in words:
        assert w in str(e.value), str(e.value)


@pytest.mark.parametrize(
    "conf, words",
    [
        ({"ket_prefix": "/x"}, ["unknown key(s) ket_prefix", "key_prefix"]),
        ({"join_timeout": "soon"}, ["join_timeout='soon'", "positive number of seconds"]),
        ({"last_call_timeout": "0"}, ["last_call_timeout='0'"]),
        ({"read_timeout": "-3"}, ["read_timeout='-3'"]),
        ({"timeout": "nan"}, ["timeout='nan'"]),
        ({"keep_alive_max_attempt": "0"}, ["keep_alive_max_attempt='0'", "positive integer"]),
        ({"key_prefix": "relative"}, ["key_prefix='relative'", "start with '/'"]),
        ({"key_prefix": "/"}, ["key_prefix='/'"]),
        ({"key_prefix": "/hotspare/jobs"}, ["key_prefix='/hotspare/jobs'", "belongs to hotspare"]),
        ({"key_prefix": "/hotspare"}, ["key_prefix='/hotspare'", "belongs to hotspare"]),
        ({"cacert": "/nonexistent/ca.pem"}, ["cacert='/nonexistent/ca.pem'", "no such file"]),
    ],
)
def test_bad_conf_is_a_value_error_naming_the_key_and_value(conf, words):
    with pytest.raises(ValueError) as e:
        rdzv.parse_config(_params(**conf))
    for w in words:
        assert w in str(e.value), str(e.value)


def test_tls_options_must_be_consistent(tmp_path):
    pem = tmp_path / "x.pem"
    pem.write_text("not checked here")
    with pytest.raises(ValueError, match="both cert=... and key="):
        rdzv.parse_config(_params(cacert=str(pem), cert=str(pem)))
    with pytest.raises(ValueError, match="need cacert"):
        rdzv.parse_config(_params(cert=str(pem), key=str(pem)))
    with pytest.raises(ValueError, match="'https://e1:2379' is https: give --rdzv-conf cacert"):
        rdzv.parse_config(_params("https://e1:2379"))
    with pytest.raises(ValueError, match="'http://e1:2379' is http:// but cacert"):
        rdzv.parse_config(_params("http://e1:2379", cacert=str(pem)))
    cfg = rdzv.parse_config(_params("e1,e2:5", cacert=str(pem), cert=str(pem), key=str(pem)))
    assert cfg.endpoints == ("https://e1:2379", "https://e2:5") and cfg.cacert == str(pem)


def test_conf_defaults_and_torchruns_timeout_as_join_timeout():
    cfg = rdzv.parse_config(_params(timeout="900", last_call_timeout="0.5"))
    assert cfg.key_prefix == "/hotspare-torchrun"
    assert cfg.timeout.join == timedelta(seconds=900)
    assert cfg.timeout.last_call == timedelta(seconds=0.5)
    assert cfg.read_timeout == timedelta(seconds=60) and cfg.keep_alive_max_attempt == 3
    cfg = rdzv.parse_config(_params(timeout="900", join_timeout="42", key_prefix="/tr/"))
    assert cfg.timeout.join == timedelta(seconds=42) and cfg.key_prefix == "/tr"
    keys = rdzv.RdzvKeys.of(cfg.key_prefix, "job")
    assert (keys.state, keys.store) == ("/tr/job/state", "/tr/job/store/")
    with pytest.raises(ValueError, match="--rdzv-id 'a/b'"):
        rdzv.RdzvKeys.of(cfg.key_prefix, "a/b")


def test_entry_point_is_registered_and_yields_the_creator():
    (ep,) = [e for e in entry_points(group="torchrun.handlers") if e.name == "hotspare-etcd"]
    assert ep.load()() is rdzv.create_handler


# -- the backend against etcd, in process -----------------------------------------------
def test_backend_compare_and_set_follows_the_rendezvous_backend_contract(etcd):
    b = rdzv.EtcdV3RendezvousBackend(Store([etcd.endpoint]), PREFIX + "state")
    assert b.name == "hotspare-etcd" and b.get_state() is None
    s1, t1, ok = b.set_state(b"one")  # no token: create if absent
    assert (s1, ok) == (b"one", True) and b.get_state() == (b"one", t1)
    assert b.set_state(b"other") == (b"one", t1, False)  # exists: current state back
    s2, t2, ok = b.set_state(b"two", t1)
    assert (s2, ok) == (b"two", True) and t2 != t1
    assert b.set_state(b"stale", t1) == (b"two", t2, False)  # fenced out
    assert b.set_state(b"junk", "not-a-revision") == (b"two", t2, False)


def test_connect_uses_the_first_endpoint_that_answers_and_names_the_dead_ones(etcd):
    dead = f"127.0.0.1:{free_port()}"
    cfg = rdzv.parse_config(_params(f"{dead},127.0.0.1:{etcd.client_port}"))
    rdzv.connect(cfg).ping()
    with pytest.raises(RendezvousConnectionError, match=f"http://{dead}"):
        rdzv.connect(rdzv.parse_config(_params(dead)))


def test_create_handler_builds_a_dynamic_handler_on_etcd(etcd, monkeypatch):
    monkeypatch.delenv(rdzv._NO_SHARED_STORE, raising=False)  # restored after the test
    h = rdzv.create_handler(_params(f"127.0.0.1:{etcd.client_port}", timeout="900"))
    assert isinstance(h, DynamicRendezvousHandler) and h.get_backend() == "hotspare-etcd"
    assert h.settings.timeout.join == timedelta(seconds=900)
    assert os.environ[rdzv._NO_SHARED_STORE] == "1" and h.use_agent_store is False


def _certs(d: Path) -> dict[str, str]:
    """A throwaway CA, a server certificate for 127.0.0.1 and a client certificate."""
    d.mkdir()

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    run("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "1", "-subj", "/CN=ca")
    (d / "san.cnf").write_text("subjectAltName = IP:127.0.0.1\n")
    for name, extra in (("server", ["-extfile", "san.cnf"]), ("client", [])):
        run("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}")
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", f"{name}.pem", "-days", "1", *extra)
    return {f.stem + "_" + f.suffix[1:]: str(f) for f in d.glob("*.*")}


def test_backend_talks_to_an_etcd_that_requires_client_certificates(tmp_path):
    c = _certs(tmp_path / "tls")
    srv = EtcdServer(tmp_path / "etcd", free_port(), free_port(), scheme="https")
    srv.start(log_path=tmp_path / "etcd.log", extra_args=[
        "--cert-file", c["server_pem"], "--key-file", c["server_key"],
        "--trusted-ca-file", c["ca_pem"], "--client-cert-auth",
    ])  # fmt: skip
    try:
        params = _params(f"127.0.0.1:{srv.client_port}", cacert=c["ca_pem"],
                         cert=c["client_pem"], key=c["client_key"])
        cfg = rdzv.parse_config(params)
        assert cfg.endpoints == (srv.endpoint,)
        deadline = time.monotonic() + 20
        while True:  # etcd's health URL needs the client certificate too: poll with ours
            try:
                store = rdzv.connect(cfg)
                break
            except RendezvousConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        b = rdzv.EtcdV3RendezvousBackend(store, PREFIX + "state")
        _, token, ok = b.set_state(b"over tls")
        assert ok and b.get_state() == (b"over tls", token)
    finally:
        srv.stop()


# -- torchrun end to end ----------------------------------------------------------------
class TwoNodes:
    """Two torchrun agents ("nodes") of 2 workers each on loopback; killed at teardown."""

    def __init__(self, etcd, tmp: Path) -> None:
        self.etcd, self.tmp = etcd, tmp
        self.out = tmp / "out"
        self.out.mkdir()
        self.script = tmp / "worker.py"
        self.script.write_text(WORKER)
        self.procs: list[subprocess.Popen] = []

    def run(self, victim: int = -1, timeout: float = 120) -> list[int]:
        env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1", LOGLEVEL="INFO")
        for node in range(2):
            cmd = [
                sys.executable, "-m", "torch.distributed.run",
                "--rdzv-backend", "hotspare-etcd",
                "--rdzv-endpoint", f"127.0.0.1:{self.etcd.client_port}",
                "--rdzv-id", RUN_ID,
                "--rdzv-conf", "join_timeout=40,close_timeout=10,read_timeout=40",
                "--nnodes", "2", "--nproc-per-node", "2",
                "--max-restarts", "2", "--monitor-interval", "0.1",
                "--local-addr", "127.0.0.1", "--log-dir", str(self.tmp / f"logs{node}"),
                str(self.script), str(self.out), str(victim),
            ]  # fmt: skip
            log = open(self.tmp / f"node{node}.log", "wb")
            self.procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                               cwd=self.tmp, start_new_session=True))
        return [p.wait(timeout=timeout) for p in self.procs]

    def logs(self) -> str:
        return "\n".join(
            f"--- node{n} ---\n" + (self.tmp / f"node{n}.log").read_text()[-6000:] for n in range(2)
        )

    def finals(self) -> dict[int, dict]:
        return {r: json.loads((self.out / f"rank{r}.json").read_text()) for r in range(4)
                if (self.out / f"rank{r}.json").exists()}

    def started(self) -> list[dict]:
        return [json.loads(ln) for ln in (self.out / "started.jsonl").read_text().splitlines()]

    def keys(self) -> dict[str, bytes]:
        st = Store([self.etcd.endpoint])
        try:
            kvs, _ = st.get_prefix("/")
        finally:
            st.close()
        return {kv.key: kv.value for kv in kvs}

    def close(self) -> None:
        """SIGTERM lets torchrun stop its workers (each in a session of its own); then
        SIGKILL whatever of ours is left, workers found by the pids they logged."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for p in self.procs:
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    pass
            for p in self.procs:
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
        log = self.out / "started.jsonl"
        for s in [json.loads(ln) for ln in log.read_text().splitlines()] if log.exists() else []:
            try:
                if str(self.script) in Path(f"/proc/{s['pid']}/cmdline").read_text():
                    os.kill(s["pid"], signal.SIGKILL)
            except (OSError, ProcessLookupError):
                pass


@pytest.fixture
def nodes(etcd, tmp_path):
    n = TwoNodes(etcd, tmp_path)
    yield n
    n.close()


def _assert_one_correct_world(finals: dict[int, dict], logs: str) -> None:
    assert sorted(finals) == [0, 1, 2, 3], logs
    for r, rec in finals.items():
        assert rec["world"] == 4 and rec["first"] == 10.0 and rec["second"] == 100.0, (r, rec)
    assert len({rec["master_port"] for rec in finals.values()}) == 1, finals  # one round
    assert sorted(rec["group_rank"] for rec in finals.values()) == [0, 0, 1, 1], finals


def test_two_torchrun_nodes_rendezvous_through_etcd_v3(nodes):
    rcs = nodes.run()
    assert rcs == [0, 0], nodes.logs()
    finals = nodes.finals()
    _assert_one_correct_world(finals, nodes.logs())
    assert all(rec["restart"] == 0 for rec in finals.values())

    keys = nodes.keys()
    assert keys and all(k.startswith(PREFIX) for k in keys), sorted(keys)
    state = pickle.loads(keys[PREFIX + "state"])  # torch's own state, in our key
    assert state.round == 0 and state.closed, vars(state)
    store_keys = [k for k in keys if k.startswith(PREFIX + "store/")]
    assert PREFIX + f"store/torch.rendezvous.{RUN_ID}.0/MASTER_PORT" in store_keys, store_keys


def test_killed_worker_restarts_both_nodes_through_a_new_rendezvous_round(nodes):
    rcs = nodes.run(victim=VICTIM)
    logs = nodes.logs()
    assert rcs == [0, 0], logs
    assert "exitcode: -9" in logs, logs  # the victim really died of SIGKILL
    finals = nodes.finals()
    _assert_one_correct_world(finals, logs)

    started = nodes.started()
    first_port = {s["master_port"] for s in started if s["restart"] == 0 and s["rank"] == VICTIM}
    assert [s["restart"] for s in started if s["rank"] == VICTIM] == [0, 1], started
    assert finals[VICTIM]["master_port"] not in first_port, (first_port, finals)
    # The killed node's agent counted the failure: its workers run restart 1. The other
    # agent restarts either because its own workers failed (counted, 1) or because it saw
    # the killed node waiting for the next round (a membership change, not counted, 0).
    victim_node = finals[VICTIM]["group_rank"]
    for rec in finals.values():
        if rec["group_rank"] == victim_node:
            assert rec["restart"] == 1, finals
        else:
            assert rec["restart"] in (0, 1), finals

    keys = nodes.keys()
    assert all(k.startswith(PREFIX) for k in keys), sorted(keys)
    state = pickle.loads(keys[PREFIX + "state"])
    assert state.round >= 1 and state.closed, vars(state)
    assert PREFIX + f"store/torch.rendezvous.{RUN_ID}.{state.round}/MASTER_PORT" in keys
