"""The neutral floor: types and small helpers every part of the package may import.

Nothing here imports from the rest of `sparse_framework` (tests/test_import_structure.py
checks it), so the store, the kernels, the algorithms, the adaptors and the backends can share
`Request`, `Batch`, `Selection`, `KVLayout`, the errors and the page arithmetic without
importing each other.
"""
