"""A real Prometheus server for the live monitoring test: its configuration made from the
example's (deploy/monitoring/prometheus.example.yml) with the test's targets, the process, and
its HTTP query API."""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Mapping, Sequence

import yaml

from pdxfer.common.procs import ManagedProcess, free_port, wait_http_ready

READY_TIMEOUT_S = 60


def config_from_example(example: Path, targets: Mapping[str, Sequence[Mapping[str, Any]]],
                        rules: Path, interval: str = "1s") -> dict[str, Any]:
    """The example configuration with each job's static_configs replaced by ``targets[job]``
    (a job the example has and ``targets`` lacks, or the other way round, is an error), the
    rules file at ``rules`` and every interval ``interval``."""
    cfg = yaml.safe_load(example.read_text())
    jobs = {s["job_name"] for s in cfg["scrape_configs"]}
    if jobs != set(targets):
        raise ValueError(f"{example.name} scrapes jobs {sorted(jobs)}; targets were given for {sorted(targets)}")
    for sc in cfg["scrape_configs"]:
        sc["static_configs"] = [dict(t) for t in targets[sc["job_name"]]]
    cfg["global"] = {**cfg.get("global", {}), "scrape_interval": interval, "evaluation_interval": interval}
    cfg["rule_files"] = [str(rules)]
    return cfg


class PrometheusServer:
    """``prometheus`` on a free loopback port with its data in ``workdir``; stop() ends it."""

    def __init__(self, binary: str, config: Mapping[str, Any], workdir: Path) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.config_path = workdir / "prometheus.yml"
        self.config_path.write_text(yaml.safe_dump(dict(config), sort_keys=False))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = ManagedProcess(
            [binary, f"--config.file={self.config_path}", f"--storage.tsdb.path={workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            workdir / "prometheus.log", name="prometheus", die_with_parent=True)
        try:
            wait_http_ready(self.url + "/-/ready", READY_TIMEOUT_S, self.proc)
        except BaseException:
            self.proc.stop(5)
            raise

    def api(self, path: str, params: Mapping[str, str] | None = None, timeout: float = 10) -> Any:
        """GET /api/v1/<path>: its ``data``; raises RuntimeError naming the error Prometheus gave."""
        url = f"{self.url}/api/v1/{path}" + (f"?{urllib.parse.urlencode(params)}" if params else "")
        try:
            with urllib.request.urlopen(url, timeout=timeout) as r:
                doc = json.loads(r.read())
        except urllib.error.HTTPError as e:
            doc = json.loads(e.read() or b"{}")
        if doc.get("status") != "success":
            raise RuntimeError(f"{path} {dict(params or {})}: {doc.get('errorType')}: {doc.get('error')}")
        return doc["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's samples: [{"metric": labels, "value": float}]."""
        data = self.api("query", {"query": expr})
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": float(data["result"][1])}]
        return [{"metric": s["metric"], "value": float(s["value"][1])} for s in data["result"]]

    def stop(self) -> None:
        self.proc.stop(10)


def positive(samples: list[dict[str, Any]]) -> bool:
    """True when some sample is a finite number above 0 (NaN is what an empty quantile gives)."""
    return any(math.isfinite(s["value"]) and s["value"] > 0 for s in samples)
