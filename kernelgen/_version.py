__version__ = "0.1.0"

# The binding's calling convention (templates/binding.cpp.j2): bump it when that changes.
# Part of every cache key, and checked against a loaded module's KG_ABI. Here, beside the
# version, so the cache can check it without importing the renderer.
ABI_VERSION = 5
