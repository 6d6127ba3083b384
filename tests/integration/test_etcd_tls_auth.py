"""etcd over TLS with client certificates, and etcd with user/password auth, end to end.

A throw-away CA (openssl CLI) signs the server's and the client's certificates; etcd serves
https with --client-cert-auth. The auth etcd is a plain one with auth enabled and a user whose
role may only touch hotspare's keys (the range /hotspare .. /hotspare0).
"""

from __future__ import annotations

import secrets
import subprocess
import time
from pathlib import Path

import pytest
from etcd3 import etcdrpc
from etcd3.etcdrpc import auth_pb2

from hotspare.orchestrator.etcd_server import EtcdServer, free_port, start_etcd
from hotspare.orchestrator.store import JobStore, Store, StoreError, wait_until

from ..conftest import Cluster, write_spec

# one worker runs this module (pytest-xdist --dist loadgroup): its module-scoped fixture is made once
pytestmark = [pytest.mark.xdist_group("etcd_tls_auth"), pytest.mark.timeout(240)]


# -- a throw-away PKI -----------------------------------------------------------------------
def _openssl(d: Path, *args: str) -> None:
    subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)


def _new_key_args(name: str) -> list[str]:
    return ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", f"{name}.key"]


def _ca(d: Path, name: str) -> None:
    _openssl(d, "req", "-x509", *_new_key_args(name), "-out", f"{name}.crt", "-days", "2",
             "-subj", f"/CN={name}")


def _leaf(d: Path, ca: str, name: str, ext: str) -> None:
    (d / f"{name}.ext").write_text(ext)
    _openssl(d, "req", "-new", *_new_key_args(name), "-out", f"{name}.csr", "-subj", f"/CN={name}")
    _openssl(d, "x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.crt", "-CAkey", f"{ca}.key",
             "-CAcreateserial", "-out", f"{name}.crt", "-days", "2", "-extfile", f"{name}.ext")


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("pki")
    _ca(d, "ca")
    _ca(d, "other-ca")  # a CA that signed nothing we talk to
    _leaf(d, "ca", "server", "subjectAltName=IP:127.0.0.1,DNS:localhost\n"
          "extendedKeyUsage=serverAuth,clientAuth\n")
    _leaf(d, "ca", "client", "extendedKeyUsage=clientAuth\n")
    return d


def _client_tls(pki: Path) -> dict[str, str]:
    return {"ca_cert": str(pki / "ca.crt"), "cert": str(pki / "client.crt"), "key": str(pki / "client.key")}


@pytest.fixture
def tls_etcd(tmp_path, pki):
    srv = EtcdServer(tmp_path / "etcd", free_port(), free_port(),
                     tls=(str(pki / "ca.crt"), str(pki / "server.crt"), str(pki / "server.key")))
    srv.start(log_path=tmp_path / "etcd.log")
    srv.wait_ready()
    yield srv
    srv.stop()


def _one_clear_error(r: subprocess.CompletedProcess, *words: str) -> str:
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    for w in words:
        assert w in lines[0], f"{w!r} not in: {lines[0]}"
    return lines[0]


# -- TLS ------------------------------------------------------------------------------------
def test_store_round_trips_over_tls_with_a_client_certificate(tls_etcd, pki):
    st = Store([tls_etcd.endpoint], **_client_tls(pki))
    try:
        st.ping()
        lease = st.lease(2)
        st.put("/hotspare/t/nodes/n", "up", lease=lease)
        st.put("/hotspare/t/spec", "{}")
        kvs, _ = st.get_prefix("/hotspare/t/")
        assert [kv.key for kv in kvs] == ["/hotspare/t/nodes/n", "/hotspare/t/spec"]
        assert st.get("/hotspare/t/nodes/n").value == b"up"
        lease.revoke()
        assert st.get("/hotspare/t/nodes/n") is None
    finally:
        st.close()


def test_tls_etcd_refuses_a_client_without_the_right_certificates_with_one_clear_error(tls_etcd, pki, tmp_path):
    c = Cluster(tls_etcd, tmp_path, **_client_tls(pki))
    try:
        ep = tls_etcd.endpoint
        plain = ep.replace("https://", "http://")
        ca, other = str(pki / "ca.crt"), str(pki / "other-ca.crt")
        cert = ["--etcd-cert", str(pki / "client.crt"), "--etcd-key", str(pki / "client.key")]
        _one_clear_error(c.hotspare("status", "--etcd", ep), ep, "https needs the CA certificate")
        _one_clear_error(c.hotspare("status", "--etcd", ep, "--etcd-ca", ca), ep,
                         "requires a client certificate")
        _one_clear_error(c.hotspare("status", "--etcd", ep, "--etcd-ca", other, *cert), ep,
                         "not signed by the CA")
        _one_clear_error(c.hotspare("status", "--etcd", plain), plain, "use an https:// endpoint")
        r = c.hotspare("status", "--etcd", ep, "--etcd-ca", ca, *cert)
        assert r.returncode == 0 and "no jobs" in r.stdout, r.stdout + r.stderr
    finally:
        c.close()


def test_job_over_tls_recovers_from_a_killed_rank(tls_etcd, pki, tmp_path):
    c = Cluster(tls_etcd, tmp_path, **_client_tls(pki))
    try:
        tls = _client_tls(pki)
        c.spawn("controller", "--leader-ttl", "2", "--etcd", tls_etcd.endpoint, "--etcd-ca", tls["ca_cert"],
                "--etcd-cert", tls["cert"], "--etcd-key", tls["key"], log="controller.log")
        del c.env["HOTSPARE_ETCD"]  # the spec alone says where etcd is and how to reach it
        spec = c.spec_file(name="tls", steps=40, etcd={"endpoints": [tls_etcd.endpoint], **tls},
                           chaos=[{"at_step": 15, "action": "kill-rank", "rank": 1}])
        summary, r = c.run_json(str(spec))
        assert summary["state"] == "succeeded", r.stdout + r.stderr[-4000:]
        [rec] = summary["recoveries"]
        assert rec["failed_rank"] == 1 and rec["spare_node"] == "spare0"
        assert c.job("tls").epoch() == 2
    finally:
        c.close()


# -- user / password ------------------------------------------------------------------------
@pytest.fixture
def auth_etcd(tmp_path):
    """(etcd with auth enabled, root password, user 'trainer', its password)."""
    srv = start_etcd(tmp_path / "etcd", log_path=tmp_path / "etcd.log")
    root_pw, pw = secrets.token_urlsafe(12), secrets.token_urlsafe(12)
    st = Store([srv.endpoint])
    a = st._client.authstub  # python3-etcd3 has no auth admin API; its gRPC stubs do
    a.UserAdd(etcdrpc.AuthUserAddRequest(name="root", password=root_pw))
    a.UserGrantRole(etcdrpc.AuthUserGrantRoleRequest(user="root", role="root"))
    a.RoleAdd(etcdrpc.AuthRoleAddRequest(name="hotspare"))
    a.RoleGrantPermission(etcdrpc.AuthRoleGrantPermissionRequest(name="hotspare", perm=auth_pb2.Permission(
        permType=auth_pb2.Permission.READWRITE, key=b"/hotspare", range_end=b"/hotspare0")))
    a.UserAdd(etcdrpc.AuthUserAddRequest(name="trainer", password=pw))
    a.UserGrantRole(etcdrpc.AuthUserGrantRoleRequest(user="trainer", role="hotspare"))
    a.AuthEnable(etcdrpc.AuthEnableRequest())
    st.close()
    yield srv, root_pw, pw
    srv.stop()


def test_job_runs_with_user_and_password_from_the_spec_and_the_password_is_stored_nowhere(auth_etcd, tmp_path):
    srv, root_pw, pw = auth_etcd
    c = Cluster(srv, tmp_path, user="root", password=root_pw)
    try:
        (tmp_path / "pw").write_text(pw + "\n")
        c.spawn("controller", "--leader-ttl", "2", "--etcd-user", "trainer", "--etcd-password-file",
                str(tmp_path / "pw"), log="controller.log")
        spec = c.spec_file(name="auth", ranks=2, steps=30,
                           etcd={"endpoints": [srv.endpoint], "user": "trainer", "password": pw})
        summary, r = c.run_json(str(spec))
        assert summary["state"] == "succeeded", r.stdout + r.stderr[-4000:]
        assert pw not in r.stdout + r.stderr
        stored = c.job("auth").spec()
        assert stored.etcd.user == "trainer" and stored.etcd.password is None
        kvs, _ = c.store.get_prefix("/")
        assert kvs and not [kv.key for kv in kvs if pw.encode() in kv.value]
        files = [f for f in (tmp_path / "out" / "auth").rglob("*") if f.is_file()] + [tmp_path / "controller.log"]
        assert any(f.name == "rank0.log" for f in files) and any(f.name == "agent-node0.log" for f in files)
        assert not [f for f in files if pw.encode() in f.read_bytes()]
    finally:
        c.close()


def test_wrong_or_missing_password_is_one_clear_error(auth_etcd, tmp_path):
    srv, _, pw = auth_etcd
    c = Cluster(srv, tmp_path, user="trainer", password=pw)
    try:
        line = _one_clear_error(c.hotspare("status", "--etcd-user", "trainer"), srv.endpoint,
                                "etcd user trainer has no password")
        c.env["HOTSPARE_ETCD_PASSWORD"] = "not-" + pw
        line = _one_clear_error(c.hotspare("status", "--etcd-user", "trainer"), srv.endpoint,
                                "wrong etcd user or password")
        assert pw not in line
        del c.env["HOTSPARE_ETCD_PASSWORD"]
        _one_clear_error(c.hotspare("status"), srv.endpoint, "has authentication enabled")
        c.env["HOTSPARE_ETCD_PASSWORD"] = pw
        r = c.hotspare("status", "--etcd-user", "trainer")
        assert r.returncode == 0 and "no jobs" in r.stdout, r.stdout + r.stderr
    finally:
        c.close()


def test_auth_token_is_renewed_after_etcd_restarts(auth_etcd):
    srv, _, pw = auth_etcd
    st = Store([srv.endpoint], user="trainer", password=pw)
    try:
        st.put("/hotspare/r/spec", "{}")
        srv.stop()  # etcd's simple tokens live in its memory: a restart forgets ours
        srv.start(log_path=srv.data_dir.parent / "etcd.log")
        srv.wait_ready()
        assert wait_until(lambda: st.get("/hotspare/r/spec").value == b"{}", timeout=10)
        with pytest.raises(StoreError, match="permission denied"):
            st.put("/other/key", "x")  # the role covers hotspare's keys only
    finally:
        st.close()


def test_a_lease_is_kept_alive_across_an_etcd_restart_with_auth(auth_etcd):
    """A node's lease after etcd restarts: its keepalive stream opens again (with an auth
    token etcd forgot: etcd 3.4 keeps a lease alive whatever the token), or the node would be
    lost for no fault of its own."""
    srv, _, pw = auth_etcd
    st = Store([srv.endpoint], user="trainer", password=pw)
    try:
        lease = st.lease(2)
        st.put("/hotspare/r/nodes/n0", "x", lease=lease)
        srv.stop()
        srv.start(log_path=srv.data_dir.parent / "etcd.log")
        srv.wait_ready()
        assert wait_until(lambda: st.get("/hotspare/r/spec") is None, timeout=10)  # reads work again
        time.sleep(3 * lease.ttl)  # without keepalives it expires within TTL of etcd's restart
        assert st.get("/hotspare/r/nodes/n0") is not None and not lease.lost.is_set()
    finally:
        st.close()


def test_a_role_limited_to_one_jobs_keys_is_enough_for_that_jobs_commands(auth_etcd, tmp_path):
    """Security review F4: docs/security.md recommended per-job roles, but every command first
    read /hotspare/ and was refused with such a role. A command about one job now checks its
    connection inside that job's keys; another job's keys stay out of reach."""
    srv, root_pw, _ = auth_etcd
    st = Store([srv.endpoint], user="root", password=root_pw)
    st.get("/hotspare/")  # authenticated: the stubs below take the token as metadata
    a, md = st._client.authstub, st._client.metadata
    a.RoleAdd(etcdrpc.AuthRoleAddRequest(name="joba"), metadata=md)
    for prefix in ("/hotspare/joba/", "/hotspare-events/joba/", "/hotspare-progress/joba/", "/hotspare-rdzv/joba/"):
        end = prefix[:-1] + "0"  # the prefix's range: "/" + 1 == "0"
        a.RoleGrantPermission(etcdrpc.AuthRoleGrantPermissionRequest(name="joba", perm=auth_pb2.Permission(
            permType=auth_pb2.Permission.READWRITE, key=prefix.encode(), range_end=end.encode())), metadata=md)
    pw = secrets.token_urlsafe(12)
    a.UserAdd(etcdrpc.AuthUserAddRequest(name="joba-user", password=pw), metadata=md)
    a.UserGrantRole(etcdrpc.AuthUserGrantRoleRequest(user="joba-user", role="joba"), metadata=md)
    from hotspare.orchestrator.spec import load_spec

    for name in ("joba", "jobb"):
        JobStore(st, name).submit(load_spec(write_spec(tmp_path, name=name)), b"k" * 32)
    st.close()
    c = Cluster(srv, tmp_path, user="root", password=root_pw)
    try:
        c.env["HOTSPARE_ETCD_PASSWORD"] = pw
        r = c.hotspare("status", "joba", "--etcd-user", "joba-user")
        assert r.returncode == 0 and "joba" in r.stdout, r.stdout + r.stderr
        r = c.hotspare("status", "jobb", "--etcd-user", "joba-user")
        assert r.returncode == 2 and "permission" in (r.stdout + r.stderr).lower(), r.stdout + r.stderr
    finally:
        c.close()
