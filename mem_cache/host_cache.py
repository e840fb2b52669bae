"""The host KV tier's memory and its copy engine.

`HostKVPool` holds K/V in host memory (pinned on CUDA machines, so copies can be asynchronous).
A `KVCopier` moves the KV of slots between the device `KVPool` and the `HostKVPool`:

- `to_host(device_slots, host_slots)` / `to_device(host_slots, device_slots)` start a copy and
  return a ticket; `done(ticket)` polls it; `wait(ticket)` blocks until it is complete.
- Copies complete in the order they were issued (one copy stream), which the radix cache's
  bookkeeping relies on.
- `to_device` leaves the KV usable by the next kernel on the caller's current stream: on CUDA
  that stream waits for the copy stream (no host blocking), on CPU the copy is already done.

`PoolCopier` does it for real: synchronously on CPU, on a CUDA copy stream on GPU. `NullCopier`
moves no data (a cache with no KV behind it: the simulator, tests of the bookkeeping).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

from mem_cache.kv_pool import KVPool


class HostKVPool(KVPool):
    """Per-layer K/V tensors of shape [size, num_kv_heads, head_dim] in host memory."""

    def __init__(
        self,
        size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        pin_memory: bool | None = None,
    ) -> None:
        super().__init__(size, num_layers, num_kv_heads, head_dim, dtype, "cpu")
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
        if pin_memory:  # page-locked: lets the copy stream overlap with compute
            self.k_buffer = [b.pin_memory() for b in self.k_buffer]
            self.v_buffer = [b.pin_memory() for b in self.v_buffer]


class KVCopier(ABC):
    """Moves KV between device slots and host slots; see the module docstring."""

    @abstractmethod
    def to_host(self, device_slots: torch.Tensor, host_slots: torch.Tensor) -> object: ...

    @abstractmethod
    def to_device(self, host_slots: torch.Tensor, device_slots: torch.Tensor) -> object: ...

    @abstractmethod
    def done(self, ticket: object) -> bool: ...

    @abstractmethod
    def wait(self, ticket: object) -> None: ...


class NullCopier(KVCopier):
    """No KV behind the cache: every copy is complete as soon as it is issued."""

    def to_host(self, device_slots: torch.Tensor, host_slots: torch.Tensor) -> object:
        return None

    def to_device(self, host_slots: torch.Tensor, device_slots: torch.Tensor) -> object:
        return None

    def done(self, ticket: object) -> bool:
        return True

    def wait(self, ticket: object) -> None:
        return None


@dataclass
class _Pending:
    """A device->host copy in flight on CUDA: staged in pinned memory, scattered on completion."""

    event: torch.cuda.Event
    host_slots: torch.Tensor
    staged: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # per layer
    finished: bool = False


class PoolCopier(KVCopier):
    """Copies between a device `KVPool` and a `HostKVPool`: synchronous on CPU; on CUDA, on a
    dedicated copy stream, ordered after the work already queued on the current stream."""

    def __init__(self, device_pool: KVPool, host_pool: HostKVPool) -> None:
        self.device_pool = device_pool
        self.host_pool = host_pool
        self.cuda = device_pool.device.type == "cuda"
        self.stream = torch.cuda.Stream(device_pool.device) if self.cuda else None

    def to_host(self, device_slots: torch.Tensor, host_slots: torch.Tensor) -> object:
        dev, host = self.device_pool, self.host_pool
        if not self.cuda:
            for layer in range(dev.num_layers):
                host.k_buffer[layer][host_slots] = dev.k_buffer[layer][device_slots]
                host.v_buffer[layer][host_slots] = dev.v_buffer[layer][device_slots]
            return None
        assert self.stream is not None
        self.stream.wait_stream(torch.cuda.current_stream(dev.device))  # KV written by compute
        pending = _Pending(torch.cuda.Event(), host_slots.cpu())
        with torch.cuda.stream(self.stream):
            slots = device_slots.to(dev.device, non_blocking=True)
            for layer in range(dev.num_layers):
                k = torch.empty((len(slots), *dev.k_buffer[layer].shape[1:]), dtype=dev.dtype,
                                pin_memory=True)
                v = torch.empty_like(k, pin_memory=True)
                k.copy_(dev.k_buffer[layer][slots], non_blocking=True)
                v.copy_(dev.v_buffer[layer][slots], non_blocking=True)
                pending.staged.append((k, v))
            pending.event.record(self.stream)
        return pending

    def to_device(self, host_slots: torch.Tensor, device_slots: torch.Tensor) -> object:
        dev, host = self.device_pool, self.host_pool
        if not self.cuda:
            for layer in range(dev.num_layers):
                dev.k_buffer[layer][device_slots] = host.k_buffer[layer][host_slots]
                dev.v_buffer[layer][device_slots] = host.v_buffer[layer][host_slots]
            return None
        assert self.stream is not None
        current = torch.cuda.current_stream(dev.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            slots = device_slots.to(dev.device, non_blocking=True)
            for layer in range(dev.num_layers):
                k = host.k_buffer[layer][host_slots.cpu()].pin_memory()
                v = host.v_buffer[layer][host_slots.cpu()].pin_memory()
                dev.k_buffer[layer][slots] = k.to(dev.device, non_blocking=True)
                dev.v_buffer[layer][slots] = v.to(dev.device, non_blocking=True)
        current.wait_stream(self.stream)  # the next kernel on `current` sees the loaded KV
        return None

    def done(self, ticket: object) -> bool:
        if not isinstance(ticket, _Pending):
            return True
        if not ticket.finished and ticket.event.query():
            self._scatter(ticket)
        return ticket.finished

    def wait(self, ticket: object) -> None:
        if isinstance(ticket, _Pending) and not ticket.finished:
            ticket.event.synchronize()
            self._scatter(ticket)

    def _scatter(self, ticket: _Pending) -> None:
        host = self.host_pool
        for layer, (k, v) in enumerate(ticket.staged):
            host.k_buffer[layer][ticket.host_slots] = k
            host.v_buffer[layer][ticket.host_slots] = v
        ticket.staged.clear()
        ticket.finished = True
