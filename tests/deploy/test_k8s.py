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
import subprocess
from pathlib import Path

import pytest
import yaml

from pdxfer.ports import parse_port_spec
from pdxfer.vllm.config import check_reachable, parse_extra_config
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

@pytest.mark.may_skip(reason="kubectl is not part of the set-up; the Python renderer it checks runs everywhere")
@pytest.mark.parametrize("name", OVERLAYS)
def test_python_renderer_matches_kubectl_kustomize(name):
    if shutil.which("kubectl") is None:
        pytest.skip("no kubectl here to compare the Python renderer with")
    out = subprocess.run(["kubectl", "kustomize", str(K8S / "overlays" / name)], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    want = _by_id([d for d in yaml.safe_load_all(out) if d])
    assert _by_id(render(K8S / "overlays" / name)) == want


def test_every_object_validates_against_the_kubernetes_schemas(overlay):
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed "
                             "(scripts/setup.sh installs it)")
    name, objs = overlay
    crds = {"ServiceMonitor"}  # Prometheus Operator's; no schema in kubernetes-validate (checked below)
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
    assert proxy_args.port == 8000 and proxy_args.prefill == ["http://pdxfer-prefill:8000"]
