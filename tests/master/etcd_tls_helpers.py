"""A real 3-member etcd cluster serving TLS on client and peer ports, client certificates
required, etcd auth on; certificates made here with trustme. Used by test_etcd_tls.py."""

from __future__ import annotations

import base64
import os
from dataclasses import dataclass
from urllib.parse import urlencode

import trustme

from pdxfer.master.backends.local_etcd import EtcdTls, LocalEtcd, LocalEtcdCluster, enable_auth, gateway_call

USER = "pdxfer"
PASSWORD = "s3cret-etcd-pw"
ROOT_PASSWORD = "root-pw"


@dataclass(frozen=True)
class Pki:
    """Files for the cluster and its clients. The client certificate has no Common Name: etcd's
    JSON gateway (what instances read the leader through) refuses one that has, with auth on."""

    dir: str
    member: EtcdTls
    client_cert: str
    client_key: str
    password_file: str
    wrong_cert: str  # signed by a CA the cluster does not trust
    wrong_key: str
    wrong_password_file: str


def make_pki(workdir: str) -> Pki:
    os.makedirs(workdir, exist_ok=True)

    def write(name: str, data: bytes) -> str:
        path = os.path.join(workdir, name)
        with open(path, "wb") as f:
            f.write(data)
        os.chmod(path, 0o600)
        return path

    def leaf(ca: trustme.CA, stem: str) -> tuple[str, str]:
        cert = ca.issue_cert("127.0.0.1", "localhost")
        return (write(f"{stem}.pem", b"".join(c.bytes() for c in cert.cert_chain_pems)),
                write(f"{stem}.key", cert.private_key_pem.bytes()))

    ca, other = trustme.CA(), trustme.CA()
    member_cert, member_key = leaf(ca, "member")
    client_cert, client_key = leaf(ca, "client")
    wrong_cert, wrong_key = leaf(other, "wrong")
    return Pki(workdir, EtcdTls(write("ca.pem", ca.cert_pem.bytes()), member_cert, member_key),
               client_cert, client_key, write("password", PASSWORD.encode() + b"\n"), wrong_cert, wrong_key,
               write("wrong-password", b"not-the-password\n"))


def start_secure_cluster(workdir: str, pki: Pki, prefix: str) -> LocalEtcdCluster:
    cluster = LocalEtcdCluster(workdir, 3, pki.member).start()
    try:
        # The user may touch keys under the test prefix's parent only.
        enable_auth(cluster.members[0], ROOT_PASSWORD, USER, PASSWORD, prefix.rsplit("/", 1)[0] + "/")
    except BaseException:
        cluster.kill()
        raise
    return cluster


def options(pki: Pki, **override: str | None) -> dict[str, str]:
    """The etcd:// options of a well-configured client, with some replaced (None: left out)."""
    opts: dict[str, str | None] = {"ca": pki.member.ca_file, "cert": pki.client_cert, "key": pki.client_key,
                                   "user": USER, "password-file": pki.password_file}
    opts.update(override)
    return {k: v for k, v in opts.items() if v is not None}


def url(endpoints: list[LocalEtcd], prefix: str, opts: dict[str, str]) -> str:
    return f"etcd://{','.join(m.endpoint for m in endpoints)}{prefix}?{urlencode(opts, safe='/')}"


def master_args(endpoints: list[LocalEtcd], prefix: str, opts: dict[str, str], ttl: float = 2) -> tuple[str, ...]:
    args = ["--etcd", ",".join(m.endpoint for m in endpoints), "--etcd-prefix", prefix, "--leader-ttl", str(ttl),
            "--etcd-timeout", "0.5"]
    for k, v in opts.items():
        args += [f"--etcd-{k}", v]
    return tuple(args)


def etcd_keys(member: LocalEtcd, prefix: str) -> dict[str, bytes]:
    """All keys under ``prefix``, read as root through the member's TLS gateway."""
    token = gateway_call(member.client_url, "/v3/auth/authenticate", {"name": "root", "password": ROOT_PASSWORD},
                         member.tls)["token"]
    start = prefix.encode()
    end = start[:-1] + bytes([start[-1] + 1])
    doc = gateway_call(member.client_url, "/v3/kv/range", {"key": base64.b64encode(start).decode(),
                                                           "range_end": base64.b64encode(end).decode()},
                       member.tls, token)
    return {base64.b64decode(kv["key"]).decode(): base64.b64decode(kv["value"]) for kv in doc.get("kvs", [])}
