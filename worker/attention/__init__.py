"""Attention over a paged KV pool: the interface (`base.py`), one backend per file (`torch_ref`,
`native`, `triton_paged`, `flashinfer_paged`) and the registry that makes one by name
(`registry.py`). Nothing is imported here, so a GPU backend loads only when named.
"""
