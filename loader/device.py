"""Placing batches on devices ahead of time.

JAX's transfers are asynchronous: `jax.make_array_from_process_local_data` returns at once and the
copy proceeds in the background. Keeping `depth` batches in flight (Flax's prefetch_to_device
pattern) means the step that needs batch k finds it already on its devices, while k+1.. copy.
Each process passes its own rows; the result is the global batch as one `jax.Array` per feature,
laid out by `sharding` (e.g. NamedSharding(mesh, P("data"))).
"""

from __future__ import annotations

from typing import Any


def to_global_arrays(batch: Any, sharding) -> Any:
    """This process's rows of a batch -> global jax.Arrays with `sharding` (one per leaf)."""
    import jax
    import numpy as np

    def put(leaf):
        if isinstance(leaf, list):
            raise TypeError("device placement needs arrays, and this batch holds a list (raw bytes or ragged "
                            "features); decode to fixed-shape arrays (decode= or map_fn=) or drop sharding=")
        return jax.make_array_from_process_local_data(sharding, np.asarray(leaf))

    return jax.tree.map(put, batch, is_leaf=lambda x: isinstance(x, list))
