"""The K and V tensors of every layer, indexed by slot id, and each running request's slot row.

`KVPool` holds memory only; who owns which slot is the allocator's and the radix cache's
business. `ReqToTokenPool` gives each running request one row: `req_to_token[row, i]` is the
slot holding the KV of the request's token `i`.
"""

from __future__ import annotations

import torch


class KVPool:
    """Per-layer K/V tensors of shape [size, num_kv_heads, head_dim].

    With `pad_slot`, one more row sits past the `size` slots: `pad_slot` (== size), which no
    allocator hands out. Padding rows of a batch replayed from a CUDA graph write their K/V
    there (`worker.cuda_graphs`); nothing reads it as anyone's KV.
    """

    def __init__(
        self,
        size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        pad_slot: bool = False,
    ) -> None:
        self.size = size
        self.pad_slot: int | None = size if pad_slot else None
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (size + int(pad_slot), num_kv_heads, head_dim)
        self.k_buffer = [self._zeros(shape) for _ in range(num_layers)]
        self.v_buffer = [self._zeros(shape) for _ in range(num_layers)]

    def _zeros(self, shape: tuple[int, int, int]) -> torch.Tensor:
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    def set_kv(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write `k`, `v` ([n, num_kv_heads, head_dim]) of one layer into `slots` ([n])."""
        self.k_buffer[layer][slots] = k.to(self.dtype)
        self.v_buffer[layer][slots] = v.to(self.dtype)

    def get_kv(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Gather the K and V of `slots` for one layer (copies)."""
        return self.k_buffer[layer][slots], self.v_buffer[layer][slots]

    def bytes_per_slot(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem


class ReqToTokenPool:
    """`max_requests` rows of `max_context` slot ids; a running request owns one row.

    `req_to_token` lives in host memory: the scheduler, the radix cache and the session table
    read and write it without touching the device. On a GPU the attention kernel reads a copy
    on the device, `device_table`, brought up to date incrementally: every `write` is logged,
    the engine ships the log with the next pass (`pending_writes`, one upload with the pass's
    inputs, applied on the device before the pass in stream order) and drops what it shipped
    (`drop_writes`). On a CPU `device_table` is `req_to_token` itself and nothing is logged.
    """

    def __init__(
        self,
        max_requests: int,
        max_context: int,
        device: str | torch.device = "cpu",
        mirror: bool | None = None,
    ) -> None:
        self.max_requests = max_requests
        self.max_context = max_context
        self.req_to_token = torch.zeros((max_requests, max_context), dtype=torch.int64)
        self._table = self.req_to_token.numpy()  # the same memory: a slice write costs ~1 us
        device = torch.device(device)
        # None: a copy on any device but the CPU (True there too: how tests check the log)
        self.mirrored = device.type != "cpu" if mirror is None else mirror
        self.device_table = (
            torch.zeros((max_requests, max_context), dtype=torch.int64, device=device)
            if self.mirrored
            else self.req_to_token
        )
        self._log: list[tuple[int, int, list[int]]] = []  # (row, start, slots), oldest first
        self._free_rows = list(range(max_requests - 1, -1, -1))
        self._used_rows: set[int] = set()

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        """Row `row`'s entries from `start` on become `slots` (int64, host)."""
        values = (slots if slots.is_cpu else slots.cpu()).numpy()
        self._table[row, start : start + len(values)] = values
        if self.mirrored:
            self._log.append((row, start, values.tolist()))

    def pending_writes(self) -> tuple[int, torch.Tensor | None]:
        """The logged writes not yet shipped: how many, and the entries they leave as int64
        [3, N] (row, column, slot), each entry once with its last value (a scatter with
        repeated indices keeps an arbitrary one on a GPU), or (0, None)."""
        if not self._log:
            return 0, None
        width = self.max_context
        latest: dict[int, int] = {}
        for row, start, values in self._log:
            base = row * width + start
            for i, slot in enumerate(values):
                latest[base + i] = slot
        keys = torch.tensor(list(latest), dtype=torch.int64)
        slots = torch.tensor(list(latest.values()), dtype=torch.int64)
        return len(self._log), torch.stack((keys // width, keys % width, slots))

    def drop_writes(self, count: int) -> None:
        """The first `count` logged writes went out with a pass (`pending_writes`)."""
        del self._log[:count]

    def available(self) -> int:
        return len(self._free_rows)

    def alloc(self) -> int | None:
        """One free row, or None when every row is taken."""
        if not self._free_rows:
            return None
        row = self._free_rows.pop()
        self._used_rows.add(row)
        return row

    def free(self, row: int) -> None:
        if row not in self._used_rows:
            raise ValueError(f"row {row} is not in use")
        self._used_rows.remove(row)
        self._free_rows.append(row)
