"""Expert parallelism: the device mesh (mesh.py) and the all-to-all transports (ep.py)."""
