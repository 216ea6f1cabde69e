"""The peers of the B1/B2 benchmarks, each run in its own virtualenv (docs/benchmarks_perf.md).

`ensure_env` creates a peer's virtualenv once (under runs/peer_envs/<name>), `run_peer`
runs that peer's script (`experiments/peers/<name>_peer.py`, never imported by Arbor) in
it with a JSON spec and returns the JSON it prints last. Peers are skipped when the
environment variable `CI` is set, so the smoke runs in the test suite stay offline and fast.

On real weights (B8, `--checkpoint`), `export_weights` writes the policy Arbor loaded as a
Hugging Face folder (config.json + model.safetensors via `models.save_hf`, and its tokenizer
as tokenizer.json + tokenizer_config.json), which the torch peer loads with
`from_pretrained` (spec key "weights"): both sides run the same weights. Only the torch peer
loads weights (`WEIGHT_PEERS`); Tunix's peer builds its own random Qwen2.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys

from absl import flags

PEER_LABELS = {"arbor": "Arbor", "tunix": "Tunix", "torch": "transformers"}

# Exact pins (docs/benchmarks_perf.md). pip installs each list in order; torch comes first so that it
# resolves to the machine's local CPU wheel, never a CUDA build.
PEER_PACKAGES = {
    "tunix": [["google-tunix==0.1.7"]],
    "torch": [["torch==2.13.0"], ["transformers==5.24.0", "trl==1.16.0", "peft==0.21.2",
                                    "math-verify==0.9.0"]],
}
_READY = ".arbor_ready"
WEIGHT_PEERS = ("torch",)  # peers whose script loads a weights folder (spec key "weights")
_EXPORTED = ".arbor_exported"


def location_flags() -> tuple[flags.FlagHolder, flags.FlagHolder]:
  """(--peer_envs, --peer_weights): where peer virtualenvs live and where a checkpoint's
  weights are exported for them. Defined on first use, so the scripts that run peers share
  them in one process (tests import several of those scripts)."""
  holders = []
  for name, default, about in (
      ("peer_envs", "runs/peer_envs", "Where peer virtualenvs live."),
      ("peer_weights", "runs/peer_weights", "Where a checkpoint's weights are exported for "
       "the peers.")):
    if name in flags.FLAGS:
      holders.append(flags.FlagHolder(flags.FLAGS, flags.FLAGS[name]))
    else:
      holders.append(flags.DEFINE_string(name, default, about))
  return holders[0], holders[1]


def peers_enabled(requested: list[str]) -> list[str]:
  """The requested peers, or none when `CI` is set."""
  unknown = sorted(set(requested) - set(PEER_PACKAGES))
  if unknown:
    raise ValueError(f"Unknown peers {unknown} (--peers); known: {sorted(PEER_PACKAGES)}.")
  return [] if os.environ.get("CI") else list(requested)


def ensure_env(name: str, root: str) -> str:
  """Creates (once) the virtualenv of peer `name` under `root`, or brings an existing one
  to PEER_PACKAGES when the pins changed; returns its python."""
  env = os.path.join(root, name)
  python = os.path.join(env, "bin", "python")
  wanted = "\n".join(" ".join(p) for p in PEER_PACKAGES[name]) + "\n"
  ready = os.path.join(env, _READY)
  if os.path.exists(ready):
    with open(ready) as f:
      if f.read() == wanted:
        return python
    print(f"Updating the {name} peer environment in {env} to {wanted.split()}.", flush=True)
  else:
    print(f"Creating the {name} peer environment in {env} (once; large download).", flush=True)
    subprocess.run([sys.executable, "-m", "venv", "--clear", env], check=True)
  for packages in PEER_PACKAGES[name]:
    subprocess.run([python, "-m", "pip", "install", "-q", *packages], check=True)
  with open(ready, "w") as f:
    f.write(wanted)
  return python


def run_peer(name: str, spec: dict, env_root: str, timeout_s: float = 3600,
             script: str | None = None) -> dict:
  """Runs experiments/peers/<script>.py (default: <name>_peer.py) in peer `name`'s
  virtualenv; returns its JSON."""
  python = ensure_env(name, env_root)
  script = os.path.join(os.path.dirname(__file__), f"{script or name + '_peer'}.py")
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
                   "mlp_dim", "rope_theta", "norm_eps", "max_seq_len", "tie_embeddings")}


def weight_peers(requested: list[str]) -> tuple[list[str], list[str]]:
  """(the requested peers that can load real weights, those that cannot), `CI` applied."""
  enabled = peers_enabled(requested)
  return ([n for n in enabled if n in WEIGHT_PEERS], [n for n in enabled if n not in WEIGHT_PEERS])


def weights_folder(root: str, checkpoint: str) -> str:
  """Where a checkpoint spec's weights are exported for the peers: root/<its base name>
  ("smollm2" -> root/smollm2, "a/model.gguf" -> root/model_gguf)."""
  return os.path.join(root, re.sub(r"[^A-Za-z0-9_-]+", "_",
                                   os.path.basename(os.path.normpath(checkpoint))))


def export_weights(folder: str, params, config, tokenizer, source: str) -> str:
  """Writes `params` (a models.config.ModelConfig `config` policy) and `tokenizer` (a
  models.hf_tokenizer.HFTokenizer) as a Hugging Face folder the torch peer loads, once per
  `source` (the checkpoint spec they came from; the folder is rewritten when it differs).

  Tokenizer: the `tokenizers` object the HFTokenizer wraps is saved as tokenizer.json, and
  tokenizer_config.json names its special tokens (so transformers' PreTrainedTokenizerFast
  and Arbor's HFTokenizer.from_pretrained both read it back) and chat template. config.json
  carries the token ids. Returns the folder.
  """
  from models import hf_checkpoint  # pylint: disable=import-outside-toplevel
  marker = os.path.join(folder, _EXPORTED)
  if os.path.exists(marker):
    with open(marker) as f:
      if f.read() == source:
        return folder
  os.makedirs(folder, exist_ok=True)
  ids = {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id,
         "pad_token_id": tokenizer.pad_id}
  hf_checkpoint.save_hf(folder, params, config, extra_config=ids)
  inner = tokenizer._tokenizer  # pylint: disable=protected-access  (the tokenizers.Tokenizer)
  inner.save(os.path.join(folder, "tokenizer.json"))
  settings = {"tokenizer_class": "PreTrainedTokenizerFast",
              "bos_token": tokenizer.token(tokenizer.bos_id),
              "eos_token": tokenizer.token(tokenizer.eos_id),
              "pad_token": tokenizer.token(tokenizer.pad_id),
              "add_bos_token": tokenizer.add_bos, "model_max_length": config.max_seq_len}
  if tokenizer.chat_template:
    settings["chat_template"] = tokenizer.chat_template
  with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
    json.dump({k: v for k, v in settings.items() if v is not None}, f, indent=2)
  with open(marker, "w") as f:
    f.write(source)
  return folder


def parity_max_abs(config, params, tokens: list[list[int]], peer: list[dict]) -> float:
  """The largest |Arbor logit - peer logit| at the peer's top ids of every position of
  `tokens` (the peer ran the exported weights on the same ids; torch_peer.py `parity`)."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from models import transformer  # pylint: disable=import-outside-toplevel
  ids = jnp.asarray(tokens, jnp.int32)
  mask = jnp.ones(ids.shape, bool)
  logits, _ = transformer.forward(params, ids, transformer.positions_from_mask(mask), mask, config)
  logits = np.asarray(logits)
  return float(max(np.max(np.abs(np.take_along_axis(logits[r], np.asarray(p["ids"]), -1)
                                 - np.asarray(p["values"])))
                   for r, p in enumerate(peer)))
