"""The K and V tensors of every layer, indexed by slot id, and each running request's slot row.

`KVPool` holds memory only; who owns which slot is the allocator's and the radix cache's
business. `ReqToTokenPool` gives each running request one row: `req_to_token[row, i]` is the
slot holding the KV of the request's token `i`.
"""

from __future__ import annotations

import torch


class KVPool:
    """Per-layer K/V tensors of shape [size, num_kv_heads, head_dim]."""

    def __init__(
        self,
        size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> None:
        self.size = size
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (size, num_kv_heads, head_dim)
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
    """`max_requests` rows of `max_context` slot ids; a running request owns one row."""

    def __init__(self, max_requests: int, max_context: int, device: str | torch.device = "cpu"):
        self.max_requests = max_requests
        self.max_context = max_context
        self.req_to_token = torch.zeros(
            (max_requests, max_context), dtype=torch.int64, device=torch.device(device)
        )
        self._free_rows = list(range(max_requests - 1, -1, -1))
        self._used_rows: set[int] = set()

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
