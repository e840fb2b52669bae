"""The CPU kernels: C sources (`csrc/`) built at first use by one builder (`build.py`), the
ctypes faces that call them, and the linear dispatch over them (`linear.py`).
"""
