"""Where workers run: one placement-group bundle per worker, spread across the Ray nodes.

The workers started with the cluster share one placement group of N identical bundles with the
SPREAD strategy, so Ray puts them on as many nodes as it can and reserves each bundle's GPUs
before any model loads. A placement group cannot grow, so a worker added live gets its own
one-bundle group; a removed worker's bundle of the initial group is kept and handed to the next
worker added, so scaling down then up again costs no new reservation.

Groups are detached and named (`names`, a prefix: `cluster/adoption.py`), so that they outlive
the fleet actor that created them, and a fleet actor restarted by Ray takes them over (`adopt`).

A group Ray cannot place at once is explained rather than waited on in silence: after
`GRACE_S` still pending, `shortage` names each resource the bundles lack, how much is asked and
how much the cluster has free of its total, and Ray's verdict on the group (`INFEASIBLE`: no
node is big enough; `NO_RESOURCES`: the nodes are, but not with what is free now). What happens
then depends on whether the cluster can change:

- `fixed=True`, a local Ray that `radixray serve` started: it holds this machine and nothing
  else, no autoscaler adds nodes and no other job frees resources, so a shortage now is a
  shortage forever: `PlacementError` at once, with that message;
- `fixed=False`, a Ray that was joined (`--address`, a Ray the caller had started, the Serve app
  on KubeRay): an autoscaler may add a node for the pending group, or another job may end, so
  the message is repeated every `NOTICE_EVERY_S` until the group is placed or the timeout ends.

A pending group whose resources look sufficient (fragmented over nodes, or Ray is slow to
update) is always waited on, with the same periodic message.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import ray
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    placement_group_table,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster.adoption import INITIAL, LIVE

log = logging.getLogger("radixray.cluster")

GRACE_S = 3.0  # a group pending longer is diagnosed (one that fits takes < 1 s)
NOTICE_EVERY_S = 15.0  # how often a wait on a cluster that may grow says what it waits for
EPS = 1e-6  # Ray counts resources in units of 1e-4


@dataclass(frozen=True)
class Slot:
    """One reserved bundle: `owned` is True when the group holds only this bundle; `name` is the
    group's own part of its Ray name (`init-*` or `live-*`)."""

    group: PlacementGroup
    bundle_index: int
    owned: bool
    name: str = ""

    def strategy(self) -> PlacementGroupSchedulingStrategy:
        return PlacementGroupSchedulingStrategy(
            placement_group=self.group,
            placement_group_bundle_index=self.bundle_index,
            placement_group_capture_child_tasks=True,
        )


class PlacementError(RuntimeError):
    """The Ray cluster cannot hold the bundles asked for (now on a fixed cluster, or within
    the timeout); the message names the resources that are short."""


def shortage(bundle: dict[str, float], count: int) -> list[str]:
    """What the cluster lacks for `count` more bundles: one phrase per short resource, e.g.
    'CPU: 3 x 1 = 3 requested, 2 free of 2'. Empty when the free totals would hold them."""
    free, total = ray.available_resources(), ray.cluster_resources()
    largest: dict[str, float] = {}
    for node in ray.nodes():
        if node["Alive"]:
            for name, amount in node["Resources"].items():
                largest[name] = max(largest.get(name, 0.0), amount)
    short = []
    for name, amount in bundle.items():
        have = f"{free.get(name, 0.0):g} free of {total.get(name, 0.0):g}"
        if amount > largest.get(name, 0.0) + EPS:
            short.append(f"{name}: {amount:g} per worker requested, but no node has that much "
                         f"(largest {largest.get(name, 0.0):g}; cluster {have})")
        elif amount * count > free.get(name, 0.0) + EPS:
            short.append(f"{name}: {count} x {amount:g} = {amount * count:g} requested, {have}")
    return short


class Placement:
    """Hands out bundles of `bundle` resources; releases them when workers go.

    `fixed`: the cluster cannot grow, so a shortage fails at once (module docstring); `notify`
    receives the messages of a wait (default: the log); `names`: the prefix of the groups'
    Ray names (`cluster/adoption.py`; "": unnamed groups that die with their creator)."""

    def __init__(
        self,
        bundle: dict[str, float],
        fixed: bool = False,
        notify: Callable[[str], None] | None = None,
        names: str = "",
    ) -> None:
        self.bundle = dict(bundle)
        self.fixed = fixed
        self.notify = notify or log.warning
        self.names = names
        self.waiting = 0  # groups being waited for now
        self._groups: list[PlacementGroup] = []
        self._free: list[Slot] = []  # bundles of the initial group whose worker was removed

    async def reserve(self, count: int, timeout_s: float) -> list[Slot]:
        """Reserve `count` bundles in one SPREAD group; PlacementError if Ray cannot place them."""
        if count == 0:
            return []
        name, group = self._group(INITIAL, count)
        await self._wait(group, count, timeout_s)
        return [Slot(group, i, owned=False, name=name) for i in range(count)]

    async def acquire(self, timeout_s: float) -> Slot:
        """One bundle for a worker added live: a freed one if any, else a new group of one."""
        if self._free:
            return self._free.pop()
        name, group = self._group(LIVE, 1)
        await self._wait(group, 1, timeout_s)
        return Slot(group, 0, owned=True, name=name)

    def adopt(
        self, groups: dict[str, PlacementGroup], used: set[tuple[str, int]]
    ) -> dict[str, Slot]:
        """Take over the groups a previous fleet actor left (by their names' own part), with
        the bundles its workers hold (`used`: (name, bundle index)); returns the slot of each
        used bundle by `"{name}#{index}"`. An initial group's unused bundles become free; a
        live group without its worker (an add cut short) is removed."""
        slots: dict[str, Slot] = {}
        for name, group in sorted(groups.items()):
            owned = name.startswith(LIVE)
            indexes = range(len(group.bundle_specs))
            if owned and (name, 0) not in used:
                remove_placement_group(group)
                continue
            self._groups.append(group)
            for i in indexes:
                slot = Slot(group, i, owned=owned, name=name)
                if (name, i) in used:
                    slots[f"{name}#{i}"] = slot
                else:
                    self._free.append(slot)
        return slots

    def _group(self, kind: str, count: int) -> tuple[str, PlacementGroup]:
        """A new group of `count` bundles: detached and named when `names` is set."""
        name = f"{kind}-{uuid.uuid4().hex[:8]}"
        if not self.names:
            return name, placement_group([dict(self.bundle)] * count, strategy="SPREAD")
        return name, placement_group([dict(self.bundle)] * count, strategy="SPREAD",
                                     name=self.names + name, lifetime="detached")

    def release(self, slot: Slot) -> None:
        """Give back a removed worker's bundle (its actor must be gone already)."""
        if slot.owned:
            self._groups.remove(slot.group)
            remove_placement_group(slot.group)
        else:
            self._free.append(slot)

    def remove_all(self) -> None:
        """Drop every group this object created (at shutdown)."""
        for group in self._groups:
            remove_placement_group(group)
        self._groups.clear()
        self._free.clear()

    async def _wait(self, group: PlacementGroup, count: int, timeout_s: float) -> None:
        """Until `group` is placed; on failure (or cancellation) the group is removed."""
        self._groups.append(group)
        self.waiting += 1
        ready = asyncio.ensure_future(group.ready())
        deadline = time.monotonic() + timeout_s
        try:
            wait_s = min(GRACE_S, timeout_s)
            while not (await asyncio.wait({ready}, timeout=wait_s))[0]:
                short = shortage(self.bundle, count)
                what = self._explain(group, count, short)
                left_s = deadline - time.monotonic()
                if left_s <= 0:
                    raise PlacementError(f"{what}; gave up after {timeout_s:.0f}s")
                if self.fixed and short:
                    raise PlacementError(f"{what}. This local Ray cannot grow: ask for fewer "
                                         "--workers or less per worker (--cpus-per-worker, "
                                         "--gpus-per-worker)")
                self.notify(f"radixray: waiting for Ray to grow or free resources "
                            f"({left_s:.0f}s left): {what}")
                wait_s = min(NOTICE_EVERY_S, left_s)
            ready.result()
        except BaseException:
            ready.cancel()
            self._groups.remove(group)
            remove_placement_group(group)
            raise
        finally:
            self.waiting -= 1

    def _explain(self, group: PlacementGroup, count: int, short: list[str]) -> str:
        """'cannot place 3 worker(s) of {'CPU': 4.0} (INFEASIBLE): CPU: ...'."""
        state = placement_group_table(group).get("stats", {}).get("scheduling_state", "?")
        what = "; ".join(short) or "the free resources look sufficient (fragmented over nodes?)"
        return f"cannot place {count} worker(s) of {self.bundle} ({state}): {what}"
