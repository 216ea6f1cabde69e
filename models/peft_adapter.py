"""LoRA adapters as PEFT folders: what a LoRA run leaves behind, loadable by PEFT and by Arbor.

A folder holds `adapter_config.json` (PEFT's LoraConfig fields: r, lora_alpha,
target_modules, ...) and `adapter_model.safetensors` with one tensor per layer and target,
named as PEFT saves a causal LM's adapters:

    base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight   [r, D_in]  = A[i].T
    base_model.model.model.layers.{i}.self_attn.q_proj.lora_B.weight   [D_out, r] = B[i].T

(models/lora.py keeps A [L, D_in, r] and B [L, r, D_out] and scales A @ B by alpha / r, as
PEFT does without rsLoRA), so `peft.PeftModel.from_pretrained(base, folder)` on the
Hugging Face export of the same base (`models.hf_checkpoint.save_hf`) is Arbor's policy.
A live PEFT model names the same tensors with its adapter's name before `.weight`
(`tensor_names(..., adapter_name="default")`).
"""

from __future__ import annotations

import json
import os

import numpy as np
from safetensors.numpy import load_file, save_file

from models import hf_checkpoint
from models.config import ModelConfig
from models.lora import Adapters, LoraConfig, projection_shape

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


def module_name(target: str) -> str:
  """The Hugging Face module of an Arbor LoRA target ("q" -> "self_attn.q_proj")."""
  return hf_checkpoint._LAYER_LINEAR[target][:-len(".weight")]  # pylint: disable=protected-access


def tensor_names(config: ModelConfig, lora: LoraConfig,
                 adapter_name: str | None = None) -> dict[str, tuple[str, str, int]]:
  """PEFT's tensor names -> (target, 'a' or 'b', layer); with `adapter_name`, as a live
  PEFT model names its parameters ("...lora_A.default.weight")."""
  infix = f".{adapter_name}" if adapter_name else ""
  names = {}
  for target in lora.targets:
    for i in range(config.n_layers):
      base = f"base_model.model.model.layers.{i}.{module_name(target)}"
      names[f"{base}.lora_A{infix}.weight"] = (target, "a", i)
      names[f"{base}.lora_B{infix}.weight"] = (target, "b", i)
  return names


def to_peft(adapters: Adapters, config: ModelConfig, lora: LoraConfig,
            adapter_name: str | None = None) -> dict[str, np.ndarray]:
  """Arbor's adapters as PEFT tensors (float32, transposed per layer)."""
  return {name: np.ascontiguousarray(np.asarray(adapters["layers"][t][ab][i], np.float32).T)
          for name, (t, ab, i) in tensor_names(config, lora, adapter_name).items()}


def save(directory: str, adapters: Adapters, config: ModelConfig, lora: LoraConfig,
         base_model: str = "") -> str:
  """Writes the adapters as a PEFT folder; returns it."""
  os.makedirs(directory, exist_ok=True)
  settings = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank,
              "lora_alpha": lora.alpha, "lora_dropout": 0.0, "bias": "none",
              "target_modules": sorted(module_name(t).split(".")[1] for t in lora.targets),
              "use_rslora": False, "fan_in_fan_out": False, "inference_mode": True,
              "base_model_name_or_path": base_model}
  save_file(to_peft(adapters, config, lora), os.path.join(directory, WEIGHTS_FILE))
  with open(os.path.join(directory, CONFIG_FILE), "w") as f:
    json.dump(settings, f, indent=2)
  return directory


def load(directory: str, config: ModelConfig) -> tuple[Adapters, LoraConfig]:
  """A PEFT LoRA folder as Arbor's adapters for a base of shape `config`, and its LoraConfig.

  A ValueError names the file and the problem: not LoRA, rsLoRA (scaled alpha / sqrt(r)),
  a module Arbor cannot adapt, or a tensor missing or of the wrong shape."""
  path = os.path.join(directory, CONFIG_FILE)
  if not os.path.isfile(path):
    raise ValueError(f"{directory} holds no {CONFIG_FILE}: not a PEFT adapter folder.")
  settings = hf_checkpoint.read_json(path)
  if settings.get("peft_type") != "LORA" or settings.get("use_rslora"):
    raise ValueError(f"{path}: peft_type {settings.get('peft_type')!r}, use_rslora "
                     f"{settings.get('use_rslora')!r}; Arbor loads plain LoRA only.")
  by_module = {module_name(t).split(".")[1]: t for t in hf_checkpoint._LAYER_LINEAR}  # pylint: disable=protected-access
  modules = settings.get("target_modules") or []
  unknown = sorted(set(modules) - set(by_module))
  if unknown:
    raise ValueError(f"{path}: target_modules {unknown} are not projections Arbor adapts "
                     f"({sorted(by_module)}).")
  lora = LoraConfig(rank=int(settings["r"]), alpha=float(settings["lora_alpha"]),
                    targets=tuple(by_module[m] for m in modules))
  tensors = load_file(os.path.join(directory, WEIGHTS_FILE))
  layers = {t: {"a": [None] * config.n_layers, "b": [None] * config.n_layers}
            for t in lora.targets}
  for name, (target, ab, i) in tensor_names(config, lora).items():
    if name not in tensors:
      raise ValueError(f"{directory}/{WEIGHTS_FILE} lacks {name}.")
    d_in, d_out = projection_shape(config, target)
    want = (lora.rank, d_in) if ab == "a" else (d_out, lora.rank)
    if tensors[name].shape != want:
      raise ValueError(f"{directory}/{WEIGHTS_FILE}: {name} has shape "
                       f"{tensors[name].shape}, the base needs {want}.")
    layers[target][ab][i] = tensors[name].T
  return ({"layers": {t: {ab: np.stack(v).astype(np.float32) for ab, v in pair.items()}
                      for t, pair in layers.items()}}, lora)
