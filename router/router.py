"""`Router`: everything behind the HTTP handlers, with no HTTP in it.

It builds and holds the parts: the tokenizer, the routing core with its worker registry, the
link to the workers (`WorkerSync`, with its polling task), the dispatcher and the metrics; it
runs request building off the event loop and closes sessions. The HTTP face
(`router.api.app`) builds on it the request builder (`router.api.requests`) and the admin
verbs (`router.api.admin`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from router.backends.base import Backend
from router.backends.sync import WorkerSync
from router.config import RouterConfig, cost_config
from router.dispatch import Dispatcher
from router.metrics import RouterMetrics
from router.routing.core import CoreConfig, RoutingCore
from router.routing.policies import PolicyConfig
from router.routing.prefix_index import IndexConfig
from router.tokenizer import Tokenizer

T = TypeVar("T")


class Router:
    """The router's state and operations; `router.api.app` is its HTTP face."""

    def __init__(
        self,
        config: RouterConfig,
        backends: Sequence[Backend] = (),
        tokenizer: Tokenizer | None = None,
        core: RoutingCore | None = None,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer or Tokenizer(config.tokenizer or config.model)
        if core is None:
            estimate, terms = cost_config(config.cost_config)
            core = RoutingCore(config=CoreConfig(
                policy=config.policy,
                block_size=config.block_size,
                index=IndexConfig(kv_groups=config.kv_groups),
                estimate=estimate,
                policies=PolicyConfig(cost=terms),
            ))
        self.core = core
        self.registry = core.registry
        self.metrics = RouterMetrics()
        self.registry.subscribe(self.metrics)
        self.workers = WorkerSync(config, self.core, self.metrics)
        self.dispatcher = Dispatcher(
            self.core, self.workers, self.metrics, self.tokenizer, config.max_failovers,
            config.namespace,
        )
        threads = config.tokenize_threads
        self._tokenize = (
            ThreadPoolExecutor(threads, thread_name_prefix="radixray-tokenize") if threads else None
        )
        self._initial = list(backends)
        self._started: asyncio.Task | None = None

    # --- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        """Adds the initial backends and starts polling; safe to call many times."""
        if self._started is None:
            self._started = asyncio.get_running_loop().create_task(self._start())
        if not self._started.done():  # every request calls this: stay cheap once started
            await asyncio.shield(self._started)

    async def _start(self) -> None:
        await self.workers.join(self._initial)
        self.workers.start()

    async def stop(self) -> None:
        await self.workers.stop()
        if self._tokenize is not None:
            self._tokenize.shutdown(wait=False)

    # --- requests ---------------------------------------------------------------------------

    async def off_loop(self, build: Callable[[], T]) -> T:
        """`build()` (parse a body, render, tokenize) on the tokenize threads, or on the loop
        when there are none (`tokenize_threads` = 0); its exceptions reach the caller alike."""
        if self._tokenize is None:
            return build()
        return await asyncio.get_running_loop().run_in_executor(self._tokenize, build)

    # --- sessions ---------------------------------------------------------------------------

    async def close_session(self, session_id: str) -> bool:
        """Forgets the pin and frees the session's KV on whichever worker holds it."""
        pinned = self.core.close_session(session_id)
        backends = [w.backend for w in self.registry.live() if w.backend is not None]
        results = await asyncio.gather(
            *(b.close_session(session_id) for b in backends), return_exceptions=True
        )
        return pinned or any(r is True for r in results)
