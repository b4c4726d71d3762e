"""Eight (or any number of) JAX devices on one CPU, to learn shard_map and XLA's collectives on a laptop.

JAX fixes its device count when its CPU backend starts, so the count must be set before the first JAX
computation; `jax.config.update("jax_num_cpu_devices", n)` says so with a clear error when it is too late,
whereas a late XLA_FLAGS setting silently leaves one device. Meshes are built with `AxisType.Auto`: JAX 0.10
defaults to explicit sharding, which makes a matmul over a sharded contraction dimension an error instead of
an all-reduce that XLA inserts for you — the behaviour the chapters want to show.
"""

from __future__ import annotations

import re
from collections import Counter


def simulated_devices(n: int = 8) -> list:
    """Make JAX see `n` CPU devices and return them; call before any other JAX computation."""
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n={n!r} must be an integer >= 1")
    try:
        import jax
    except ImportError:
        raise ImportError("JAX is not installed: pip install -e '.[jax]'") from None
    try:
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:  # the backend already started: fine if it has the right number of devices
        if jax.device_count() != n:
            raise RuntimeError(f"JAX already started with {jax.device_count()} device(s); restart the kernel and call "
                               f"lab.jaxtrack.sim.simulated_devices({n}) before any other JAX computation") from None
    devices = jax.devices()
    if len(devices) != n:
        raise RuntimeError(f"asked for {n} JAX devices, got {len(devices)}")
    return devices


def make_mesh(shape: tuple[int, ...], names: tuple[str, ...]):
    """A device mesh whose axes XLA may shard automatically (inserting the collectives itself)."""
    import jax
    from jax.sharding import AxisType

    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape))


COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
_COLLECTIVE = re.compile(rf"=\s.*?\b({'|'.join(COLLECTIVES)})(?:-start)?\(")


def collectives_in(compiled) -> Counter:
    """How many of each collective a compiled program holds (`jax.jit(f).lower(...).compile()`, or its HLO text):
    what XLA decided to communicate, read from the program itself rather than assumed. An async pair
    (`all-gather-start` / `-done`) counts once."""
    text = compiled if isinstance(compiled, str) else compiled.as_text()
    return Counter(_COLLECTIVE.findall(text))
