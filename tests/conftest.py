"""Test-session set-up that must happen before JAX starts.

- `HF_HUB_OFFLINE=1`: tests never reach the network.
- `XLA_FLAGS=--xla_force_host_platform_device_count=8`: eight virtual CPU devices for the
 sharding tests (single-device code runs a little slower; that is the price).
- `JAX_PLATFORMS=cpu`: tests are CPU-only (export another value to override).
- Persistent compilation cache in the user's cache folder (`$XDG_CACHE_HOME/arbor/jax`,
 else `~/.cache/arbor/jax`), shared by every checkout and clone on the machine, so a rerun
 of the suite, or a fresh clone's first run, skips most XLA compilation (about three
 quarters of a cold run's time). Entries are keyed by the computation, the compile options
 and the jax/jaxlib version, so a stale entry is never used; the folder is capped at 2 GiB. Override the place with
 JAX_COMPILATION_CACHE_DIR.
"""

import os
import pathlib

_CACHE_HOME = pathlib.Path(os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache")
_DEVICE_FLAG = "--xla_force_host_platform_device_count"

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
_xla_flags = os.environ.get("XLA_FLAGS", "")
if _DEVICE_FLAG not in _xla_flags:  # an explicit device count from the caller wins
  os.environ["XLA_FLAGS"] = f"{_xla_flags} {_DEVICE_FLAG}=8".strip()

# The cache settings go through the environment (a value already there wins), so that the
# launcher subprocesses some tests start (`python -m experiments.train ...`) share the
# cache on the same terms.
_CACHE_SETTINGS = {
    "jax_compilation_cache_dir": str(_CACHE_HOME / "arbor" / "jax"),
    # Cache compilations that take a tenth of a second or more: eager ops compile in
    # milliseconds, and writing a file for each would cost more than it saves.
    "jax_persistent_cache_min_compile_time_secs": 0.1,
    # -1 removes the size threshold (0 lets JAX pick one per file system).
    "jax_persistent_cache_min_entry_size_bytes": -1,
    # The folder outlives code changes: keep it bounded (least recently used entries go
    # first; one run of the suite writes about 60 MB).
    "jax_compilation_cache_max_size": 2 * 2**30,
}
for _name, _value in _CACHE_SETTINGS.items():
  os.environ.setdefault(_name.upper(), str(_value))

import jax  # pylint: disable=wrong-import-position  (must follow the environment)

for _name, _value in _CACHE_SETTINGS.items():  # in case a plugin imported jax first
  jax.config.update(_name, type(_value)(os.environ[_name.upper()]))
