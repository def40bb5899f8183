"""What the proxy's public port tells a client on another host (pdxfer.serve.operator_view):
answers, a health status, no instance URL, no metrics; the fleet's operator (its own host, or the
fleet's token) sees all of it. A real proxy bound to every address, reached through this host's
own non-loopback address, in front of real HTTP instances."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from pdxfer.serve.proxy import PDProxy, RunningProxy
from tests.serve.test_drain import host_address
from tests.serve.test_proxy import instances, post  # noqa: F401  (instances: a fixture)


def _get(url: str, token: str | None = None) -> tuple[int, dict, bytes]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def _post(url: str, body: dict, token: str | None = None) -> tuple[int, dict, bytes]:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json",
                                  **({"Authorization": f"Bearer {token}"} if token else {})})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def test_a_client_elsewhere_gets_answers_but_no_view_of_the_fleet(instances):
    p, d, bad = instances("P"), instances("D"), instances("B", status=500)
    with RunningProxy(PDProxy([p.url], [d.url], master_token="s3cret"), host="0.0.0.0") as px:
        remote = f"http://{host_address()}:{px.port}"
        status, headers, data = _post(remote + "/v1/completions", {"prompt": "x", "max_tokens": 2})
        assert status == 200 and json.loads(data)["by"] == "D"
        assert not [h for h in headers if h.lower().startswith("x-pdxfer-")], headers  # no instance URL
        status, headers, data = _post(remote + "/v1/completions", {"prompt": "x", "max_tokens": 2, "stream": True})
        assert status == 200 and b"[DONE]" in data  # streamed: its headers left before any check could drop them
        assert not [h for h in headers if h.lower().startswith("x-pdxfer-")], headers
        code, _, body = _get(remote + "/health")
        assert code == 200 and json.loads(body) == {"status": "ok"}
        code, _, body = _get(remote + "/metrics")
        assert code == 401 and b"pdxfer_proxy" not in body
        for where in (d.url, p.url, str(d.port)):
            assert where.encode() not in body
        # The operator (the token from elsewhere, or this host) sees everything.
        code, _, body = _get(remote + "/metrics", token="s3cret")
        assert code == 200 and b"pdxfer_proxy_routes_total" in body
        assert json.loads(_get(remote + "/health", token="s3cret")[2])["decode"][0]["url"] == d.url
        status, headers, _ = _post(px.url + "/v1/completions", {"prompt": "x", "max_tokens": 2})
        assert headers["X-Pdxfer-Decode"] == d.url
    with RunningProxy(PDProxy([p.url], [bad.url]), host="0.0.0.0") as px:
        remote = f"http://{host_address()}:{px.port}"
        # The proxy's own error answer names no instance for a client elsewhere ...
        status, _, data = _post(remote + "/v1/completions", {"prompt": "x", "max_tokens": 2})
        err = json.loads(data)["error"]
        assert status == 502 and err == {"message": "an instance behind this proxy failed the request",
                                          "type": "bad_gateway", "code": 502}, err
        assert bad.url.encode() not in data and str(bad.port).encode() not in data
        code, _, body = _get(remote + "/health")
        assert json.loads(body) == {"status": "ok" if code == 200 else "unavailable"}
        # ... and in full for the operator.
        status, _, data = _post(px.url + "/v1/completions", {"prompt": "x", "max_tokens": 2})
        assert status == 502 and json.loads(data)["error"]["instance"] == bad.url


def test_an_instances_own_client_error_passes_through_unchanged(instances):
    p, d = instances("P"), instances("D", status=400)
    with RunningProxy(PDProxy([p.url], [d.url]), host="0.0.0.0") as px:
        status, _, data = _post(f"http://{host_address()}:{px.port}/v1/completions", {"prompt": "x", "max_tokens": 2})
    assert status == 400 and json.loads(data)["error"]["message"] == "D says no"
