"""The load generator behind `radixray bench`: workloads as prompts, sent to any OpenAI-
compatible endpoint, timed. `cluster.loadgen.cli` holds the command's entry points."""
