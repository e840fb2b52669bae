"""What the router reads of engines it did not start: KV events, /metrics, speeds, probes."""
