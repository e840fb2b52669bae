"""Where workers run: one placement-group bundle per worker, spread across the Ray nodes.

The workers started with the cluster share one placement group of N identical bundles with the
SPREAD strategy, so Ray puts them on as many nodes as it can and reserves each bundle's GPUs
before any model loads. A placement group cannot grow, so a worker added live gets its own
one-bundle group; a removed worker's bundle of the initial group is kept and handed to the next
worker added, so scaling down then up again costs no new reservation.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy


@dataclass(frozen=True)
class Slot:
    """One reserved bundle: `owned` is True when the group holds only this bundle."""

    group: PlacementGroup
    bundle_index: int
    owned: bool

    def strategy(self) -> PlacementGroupSchedulingStrategy:
        return PlacementGroupSchedulingStrategy(
            placement_group=self.group,
            placement_group_bundle_index=self.bundle_index,
            placement_group_capture_child_tasks=True,
        )


class PlacementError(RuntimeError):
    """The Ray cluster cannot hold the bundles asked for within the timeout."""


class Placement:
    """Hands out bundles of `bundle` resources; releases them when workers go."""

    def __init__(self, bundle: dict[str, float]) -> None:
        self.bundle = dict(bundle)
        self._groups: list[PlacementGroup] = []
        self._free: list[Slot] = []  # bundles of the initial group whose worker was removed

    async def reserve(self, count: int, timeout_s: float) -> list[Slot]:
        """Reserve `count` bundles in one SPREAD group; PlacementError if Ray cannot place them."""
        if count == 0:
            return []
        group = placement_group([dict(self.bundle)] * count, strategy="SPREAD")
        await self._wait(group, count, timeout_s)
        return [Slot(group, i, owned=False) for i in range(count)]

    async def acquire(self, timeout_s: float) -> Slot:
        """One bundle for a worker added live: a freed one if any, else a new group of one."""
        if self._free:
            return self._free.pop()
        group = placement_group([dict(self.bundle)], strategy="SPREAD")
        await self._wait(group, 1, timeout_s)
        return Slot(group, 0, owned=True)

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
        self._groups.append(group)
        try:
            await asyncio.wait_for(group.ready(), timeout_s)
        except asyncio.TimeoutError:
            self._groups.remove(group)
            remove_placement_group(group)
            raise PlacementError(
                f"Ray could not reserve {count} x {self.bundle} within {timeout_s:.0f}s; "
                "the cluster has too few free resources (see `ray status`)"
            ) from None
