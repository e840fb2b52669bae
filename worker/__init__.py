"""One GPU's inference engine (model, KV pool, radix cache, scheduler) and its Ray actor."""
