"""What of a fleet lives in Ray on its own, and how a new fleet actor finds it again.

The fleet actor (`cluster/fleet.py`) may die: its process killed, its node's raylet restarted.
Its workers must not go with it, so nothing of a worker is owned by the fleet's process:

- every worker actor is `lifetime="detached"` and named
  `radixray:{fleet}:{pool}:{worker_id}@{group}#{bundle}`, in the fleet's Ray namespace;
- every placement group is `lifetime="detached"` and named `radixray:{fleet}:{pool}:{group}`,
  `group` being `init-*` for the group of the workers started with the fleet (a removed
  worker's bundle there is handed to the next worker added) and `live-*` for the one-bundle
  group of a worker added live.

The name holds all a fleet needs to rebuild its pool: which worker, in which bundle of which
group. When Ray restarts the fleet actor (or a router creates it again by name), the new
actor lists the named actors and groups of its fleet (`find`) and adopts them with their
caches (`WorkerPool.adopt`). Whoever stops a fleet whose actor does not answer kills them
by name (`kill_all`), so that nothing outlives `radixray serve`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.placement_group import (
    PlacementGroup,
    get_placement_group,
    placement_group_table,
    remove_placement_group,
)

log = logging.getLogger("radixray.cluster")

INITIAL, LIVE = "init", "live"  # the two kinds of group (module docstring)


def prefix(fleet_name: str) -> str:
    """What every Ray name of this fleet's workers and groups starts with."""
    return f"radixray:{fleet_name}:"


def group_name(fleet_name: str, pool_id: str, group: str) -> str:
    return f"{prefix(fleet_name)}{pool_id}:{group}"


def worker_name(fleet_name: str, pool_id: str, worker_id: str, group: str, bundle: int) -> str:
    return f"{prefix(fleet_name)}{pool_id}:{worker_id}@{group}#{bundle}"


@dataclass(frozen=True)
class FoundWorker:
    """A named worker actor of the fleet, as its name describes it."""

    pool_id: str
    worker_id: str
    group: str  # the group's own part of its name (`init-*`, `live-*`)
    bundle: int
    actor: Any


@dataclass
class Found:
    """Everything of one fleet that Ray still holds: its workers and its groups by name."""

    workers: list[FoundWorker] = field(default_factory=list)
    groups: dict[str, PlacementGroup] = field(default_factory=dict)  # group -> its group

    @property
    def pool_id(self) -> str | None:
        """The pool the workers belong to (the newest name when several do)."""
        pools = sorted({w.pool_id for w in self.workers})
        return pools[-1] if pools else None


def parse_worker(fleet_name: str, name: str) -> tuple[str, str, str, int] | None:
    """(pool, worker_id, group, bundle) of a worker's name, None for another name."""
    head = prefix(fleet_name)
    if not name.startswith(head):
        return None
    pool_id, sep, rest = name[len(head):].partition(":")
    worker_id, at, place = rest.partition("@")
    group, hash_, bundle = place.rpartition("#")
    if not (sep and at and hash_ and bundle.isdigit() and worker_id and group):
        return None
    return pool_id, worker_id, group, int(bundle)


def find(fleet_name: str, namespace: str) -> Found:
    """The fleet's live named workers (in `namespace`) and its placed or pending groups (in the
    caller's namespace, where the fleet creates them)."""
    found = Found()
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry["namespace"] != namespace:
            continue
        parsed = parse_worker(fleet_name, entry["name"])
        if parsed is None:
            continue
        try:
            actor = ray.get_actor(entry["name"], namespace=namespace)
        except ValueError:  # died since it was listed
            continue
        found.workers.append(FoundWorker(*parsed, actor))
    head = prefix(fleet_name)
    for info in placement_group_table().values():
        name = info.get("name") or ""
        if name.startswith(head) and info.get("state") != "REMOVED":
            try:
                found.groups[name[len(head):].partition(":")[2]] = get_placement_group(name)
            except ValueError:  # removed since it was listed
                continue
    return found


def kill_all(fleet_name: str, namespace: str) -> int:
    """Kill every named worker of the fleet and remove its groups; returns the workers killed."""
    found = find(fleet_name, namespace)
    for worker in found.workers:
        ray.kill(worker.actor, no_restart=True)
    for group in found.groups.values():
        try:
            remove_placement_group(group)
        except Exception as exc:  # noqa: BLE001 - removed meanwhile
            log.warning("removing a placement group: %r", exc)
    return len(found.workers)
