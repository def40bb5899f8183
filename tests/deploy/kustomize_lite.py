"""The part of kustomize that deploy/k8s uses, in Python, so CI renders the overlays without a
kustomize binary (none on PyPI or in Debian): ``resources`` (files and folders with their own
kustomization), ``namespace``, ``images`` (newName/newTag) and ``patches`` (strategic-merge
patch files). Any other kustomization key is an error, so a manifest that starts using one
fails here instead of being rendered wrong. Where ``kubectl kustomize`` exists the tests check
this renderer against it.

Strategic merge as the manifests need it: maps merge key by key, ``null`` deletes a key, lists
of maps whose items all carry ``name`` (containers, env, volumes, mounts) merge by name, every
other list is replaced; merged lists keep kustomize's order.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

KNOWN_KEYS = {"apiVersion", "kind", "resources", "namespace", "images", "patches"}
CLUSTER_SCOPED = {"Namespace", "PersistentVolume", "ClusterRole", "ClusterRoleBinding", "StorageClass",
                  "CustomResourceDefinition"}
Resource = dict[str, Any]


class KustomizeError(ValueError):
    pass


def load_yaml_docs(path: Path) -> list[Resource]:
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def resource_id(r: Resource) -> tuple[str, str]:
    return r["kind"], r["metadata"]["name"]


def render(folder: Path) -> list[Resource]:
    """The resources ``folder``'s kustomization.yaml produces."""
    folder = Path(folder)
    kfile = folder / "kustomization.yaml"
    if not kfile.is_file():
        raise KustomizeError(f"{folder} has no kustomization.yaml")
    (k,) = load_yaml_docs(kfile)
    unknown = sorted(set(k) - KNOWN_KEYS)
    if unknown:
        raise KustomizeError(f"{kfile}: keys {unknown} are not supported by this renderer")
    out: list[Resource] = []
    for entry in k.get("resources", []):
        p = (folder / entry).resolve()
        out += render(p) if p.is_dir() else load_yaml_docs(p)
    ids = [resource_id(r) for r in out]
    dup = sorted({i for i in ids if ids.count(i) > 1})
    if dup:
        raise KustomizeError(f"{kfile}: resources defined twice: {dup}")
    for patch in k.get("patches", []):
        if set(patch) != {"path"}:
            raise KustomizeError(f"{kfile}: only `patches: - path: FILE` is supported, got {patch}")
        for p in load_yaml_docs(folder / patch["path"]):
            target = [r for r in out if resource_id(r) == resource_id(p)]
            if not target:
                raise KustomizeError(f"{kfile}: patch {patch['path']} targets {resource_id(p)}, which no "
                                     "resource defines")
            out[out.index(target[0])] = merge(target[0], p)
    for image in k.get("images", []):
        for r in out:
            for c in _containers(r):
                _set_image(c, image)
    if "namespace" in k:
        for r in out:
            if r["kind"] not in CLUSTER_SCOPED:
                r["metadata"]["namespace"] = k["namespace"]
    return out


def merge(base: Any, patch: Any) -> Any:
    if isinstance(base, dict) and isinstance(patch, dict):
        out = copy.deepcopy(base)
        for key, value in patch.items():
            if value is None:
                out.pop(key, None)
            elif key in out:
                out[key] = merge(out[key], value)
            else:
                out[key] = _strip_nulls(copy.deepcopy(value))
        return out
    if isinstance(base, list) and isinstance(patch, list) and _named(base) and _named(patch):
        # kustomize's order: the patch's items (merged with the base's of the same name) in
        # the patch's order, then the base's items the patch does not name.
        by_name = {b["name"]: b for b in base}
        out_list = [merge(by_name[i["name"]], i) if i["name"] in by_name else _strip_nulls(copy.deepcopy(i))
                    for i in patch]
        named = {i["name"] for i in patch}
        return out_list + [copy.deepcopy(b) for b in base if b["name"] not in named]
    return copy.deepcopy(patch)


def _strip_nulls(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: _strip_nulls(x) for k, x in v.items() if x is not None}
    if isinstance(v, list):
        return [_strip_nulls(x) for x in v]
    return v


def _named(items: list) -> bool:
    return bool(items) and all(isinstance(i, dict) and "name" in i for i in items)


def pod_spec(r: Resource) -> dict | None:
    if r["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
        return r["spec"]["template"]["spec"]
    return None


def _containers(r: Resource) -> list[dict]:
    spec = pod_spec(r)
    return [] if spec is None else spec.get("initContainers", []) + spec.get("containers", [])


def _set_image(container: dict, image: dict) -> None:
    ref = container["image"]
    name, tag = (ref.rsplit(":", 1) + [""])[:2] if ":" in ref.rsplit("/", 1)[-1] else (ref, "")
    if name != image["name"]:
        return
    name = image.get("newName", name)
    tag = image.get("newTag", tag)
    container["image"] = f"{name}:{tag}" if tag else name
