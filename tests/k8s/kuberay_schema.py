"""Strict offline validation of Ray custom resources against KubeRay's CRD schemas.

Plain JSON Schema differs from what the Kubernetes API server does in three ways that matter
here, and this module closes each gap:

- The API server prunes unknown fields silently; we want a misspelled field to FAIL, so every
  object schema that lists ``properties`` gets ``additionalProperties: false`` (except where the
  CRD already says ``x-kubernetes-preserve-unknown-fields`` or sets ``additionalProperties``).
- The API server fills in ``default`` values before it checks ``required``.
- The API server drops ``null`` values.

CEL rules (``x-kubernetes-validations``) are not checked.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import jsonschema
import yaml


def strict(schema: dict[str, Any]) -> dict[str, Any]:
    """A deep copy of ``schema`` where every open object schema with properties is closed."""
    schema = copy.deepcopy(schema)
    _close(schema)
    return schema


def _close(node: Any) -> None:
    if isinstance(node, list):
        for item in node:
            _close(item)
        return
    if not isinstance(node, dict):
        return
    if (
        "properties" in node
        and "additionalProperties" not in node
        and not node.get("x-kubernetes-preserve-unknown-fields")
    ):
        node["additionalProperties"] = False
    for value in node.values():
        _close(value)


def normalize(instance: Any, schema: dict[str, Any]) -> Any:
    """``instance`` as the API server sees it: nulls dropped, schema defaults filled in."""
    if isinstance(instance, dict):
        props = schema.get("properties", {})
        extra = schema.get("additionalProperties")
        out = {}
        for key, value in instance.items():
            if value is None:
                continue
            sub = props.get(key, extra if isinstance(extra, dict) else {})
            out[key] = normalize(value, sub)
        for key, sub in props.items():
            if key not in out and "default" in sub:
                out[key] = normalize(copy.deepcopy(sub["default"]), sub)
        return out
    if isinstance(instance, list):
        items = schema.get("items", {})
        return [normalize(v, items if isinstance(items, dict) else {}) for v in instance]
    return instance


class CRDValidator:
    """Validates ``ray.io`` resources; built once from a directory of CRD YAML files."""

    def __init__(self, crd_dir: Path) -> None:
        self.schemas: dict[tuple[str, str], dict[str, Any]] = {}
        for path in sorted(crd_dir.glob("*.yaml")):
            with path.open() as f:
                crd = yaml.load(f, Loader=yaml.CSafeLoader)
            kind = crd["spec"]["names"]["kind"]
            for version in crd["spec"]["versions"]:
                if version.get("served", True):
                    api = f"{crd['spec']['group']}/{version['name']}"
                    self.schemas[(api, kind)] = strict(version["schema"]["openAPIV3Schema"])
        self._validators = {
            key: jsonschema.Draft7Validator(schema) for key, schema in self.schemas.items()
        }

    def kinds(self) -> set[str]:
        return {kind for _, kind in self.schemas}

    def errors(self, resource: dict[str, Any]) -> list[str]:
        """Every schema violation of ``resource``, as readable lines (empty: valid)."""
        key = (resource.get("apiVersion", ""), resource.get("kind", ""))
        if key not in self._validators:
            return [f"no CRD schema for {key[0]} {key[1]}"]
        instance = normalize(resource, self.schemas[key])
        return [
            f"{'/'.join(str(p) for p in err.absolute_path) or '<root>'}: {err.message}"
            for err in self._validators[key].iter_errors(instance)
        ]
