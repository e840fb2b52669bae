"""One worker's KV memory: slot allocator, KV tensors, radix prefix cache, KV events.

torch only: nothing here knows about Ray, HTTP or the model.
"""
