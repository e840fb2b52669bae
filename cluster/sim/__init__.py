"""A discrete-event simulator of a radixray cluster: real radix caches, the real router core.

`cluster.sim.cli` is `radixray simulate`; `simulator.simulate` runs one policy over a workload.
"""
