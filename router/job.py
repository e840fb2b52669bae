"""`Job`: one OpenAI request, validated and tokenized, reduced to what generation needs (token
ids per prompt, sampling, `n`, stop strings, the session). `router.api.requests` builds it;
`router.dispatch` runs one `GenerateRequest` per choice of it; `router.api.render` names it in
the response."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

from worker.protocol import GenerateRequest, SamplingParams


@dataclass
class Job:
    """One OpenAI request, validated and tokenized."""

    request_id: str
    model: str
    prompts: list[list[int]]
    sampling: SamplingParams
    n: int = 1
    stop: list[str] = field(default_factory=list)
    skip_special_tokens: bool = True
    session_id: str | None = None
    namespace: str | None = None
    session_ttl_s: float | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    arrival: float = field(default_factory=time.perf_counter)

    def generate_requests(self) -> list[GenerateRequest]:
        """One request per choice, index = prompt * n + i; seeds differ per choice."""
        out = []
        for p, ids in enumerate(self.prompts):
            for i in range(self.n):
                sampling = self.sampling
                if sampling.seed is not None and i:
                    sampling = dataclasses.replace(sampling, seed=sampling.seed + i)
                out.append(
                    GenerateRequest(
                        request_id=f"{self.request_id}-{p * self.n + i}",
                        input_ids=ids,
                        sampling=sampling,
                        namespace=self.namespace,
                        session_id=self.session_id,
                        session_ttl_s=self.session_ttl_s if self.session_id else None,
                    )
                )
        return out
