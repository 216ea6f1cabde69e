"""The peers of the B1/B2 benchmarks, each run in its own virtualenv (docs/benchmarks_perf.md).

`ensure_env` creates a peer's virtualenv once (under runs/peer_envs/<name>), `run_peer`
runs that peer's script (`experiments/peers/<name>_peer.py`, never imported by Arbor) in
it with a JSON spec and returns the JSON it prints last. Peers are skipped when the
environment variable `CI` is set, so the smoke runs in the test suite stay offline and fast.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

PEER_LABELS = {"arbor": "Arbor", "tunix": "Tunix", "torch": "transformers"}

# Exact pins (docs/benchmarks_perf.md). pip installs each list in order; torch comes first so that it
# resolves to the machine's local CPU wheel, never a CUDA build.
PEER_PACKAGES = {
    "tunix": [["google-tunix==0.1.7"]],
    "torch": [["torch==2.13.0"], ["transformers==5.24.0", "trl==1.16.0"]],
}
_READY = ".arbor_ready"


def peers_enabled(requested: list[str]) -> list[str]:
  """The requested peers, or none when `CI` is set."""
  unknown = sorted(set(requested) - set(PEER_PACKAGES))
  if unknown:
    raise ValueError(f"Unknown peers {unknown} (--peers); known: {sorted(PEER_PACKAGES)}.")
  return [] if os.environ.get("CI") else list(requested)


def ensure_env(name: str, root: str) -> str:
  """Creates (once) the virtualenv of peer `name` under `root`; returns its python."""
  env = os.path.join(root, name)
  python = os.path.join(env, "bin", "python")
  if os.path.exists(os.path.join(env, _READY)):
    return python
  print(f"Creating the {name} peer environment in {env} (once; large download).", flush=True)
  subprocess.run([sys.executable, "-m", "venv", "--clear", env], check=True)
  for packages in PEER_PACKAGES[name]:
    subprocess.run([python, "-m", "pip", "install", "-q", *packages], check=True)
  with open(os.path.join(env, _READY), "w") as f:
    f.write("\n".join(" ".join(p) for p in PEER_PACKAGES[name]) + "\n")
  return python


def run_peer(name: str, spec: dict, env_root: str, timeout_s: float = 3600) -> dict:
  """Runs experiments/peers/<name>_peer.py in the peer's virtualenv; returns its JSON."""
  python = ensure_env(name, env_root)
  script = os.path.join(os.path.dirname(__file__), f"{name}_peer.py")
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PYTHONPATH")}
  env.update(JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
  done = subprocess.run([python, script, json.dumps(spec)], capture_output=True, text=True,
                        env=env, timeout=timeout_s, check=False)
  lines = done.stdout.strip().splitlines()
  if done.returncode or not lines:
    raise RuntimeError(f"Peer {name} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
  return json.loads(lines[-1])


def peer_shape(config) -> dict:
  """The fields of a models.config.ModelConfig the peer scripts build their Qwen2 from."""
  return {k: v for k, v in dataclasses.asdict(config).items()
          if k in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                   "mlp_dim", "rope_theta", "norm_eps", "max_seq_len")}
