"""Optional extras that more than one layer starts the same way (a base module: it imports no moelab
module but the errors).

Ray (``pip install 'moelab[ray]'``) runs the lab's steps (``moelab run --backend ray``) and the token
store's units (``data.backend: ray``) as tasks.
"""

from __future__ import annotations

import os

from moelab.errors import UsageError


def ray_session():
    """The ``ray`` module, started: a local instance (every core, no dashboard) unless one is running,
    or the cluster at MOELAB_RAY_ADDRESS (``moelab run --ray-address``)."""
    try:
        import ray
    except ImportError:
        raise UsageError("--backend ray: Ray is not installed; pip install 'moelab[ray]'") from None
    if not ray.is_initialized():
        address = os.environ.get("MOELAB_RAY_ADDRESS") or None
        kwargs = {} if address else {"num_cpus": os.cpu_count(), "include_dashboard": False}
        ray.init(address=address, log_to_driver=True, **kwargs)
    return ray
