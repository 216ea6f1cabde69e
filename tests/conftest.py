"""Test-session set-up that must happen before JAX starts.

- `HF_HUB_OFFLINE=1`: tests never reach the network.
- `XLA_FLAGS=--xla_force_host_platform_device_count=8`: eight virtual CPU devices for the
 sharding tests (single-device code runs a little slower; that is the price).
- `JAX_PLATFORMS=cpu`: tests are CPU-only (export another value to override).
- Persistent compilation cache in `<repo>/.jax_cache` (git-ignored), so reruns of the
 suite skip most XLA compilation. Override the place with JAX_COMPILATION_CACHE_DIR.
"""

import os
import pathlib

_REPO = pathlib.Path(__file__).resolve().parent.parent
_DEVICE_FLAG = "--xla_force_host_platform_device_count"

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(_REPO / ".jax_cache"))
_xla_flags = os.environ.get("XLA_FLAGS", "")
if _DEVICE_FLAG not in _xla_flags:  # an explicit device count from the caller wins
  os.environ["XLA_FLAGS"] = f"{_xla_flags} {_DEVICE_FLAG}=8".strip()

import jax  # pylint: disable=wrong-import-position  (must follow the environment)

jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
# Cache only compilations that take a tenth of a second or more: eager ops compile in
# milliseconds, and writing a file for each would cost more than it saves.
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.1)
# -1 removes the size threshold (0 lets JAX pick one per file system).
jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
