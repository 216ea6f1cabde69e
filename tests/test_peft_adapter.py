"""models/peft_adapter.py: LoRA adapters as PEFT folders, written and read back, with PEFT's
names and layouts, and clear errors for folders Arbor cannot load."""

import json

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from models import lora as lora_lib
from models import peft_adapter
from models import transformer
from models.config import PRESETS

CONFIG = PRESETS["tiny2"]
LORA = lora_lib.LoraConfig(rank=2, alpha=4.0, targets=("q", "down"))


def trained_adapters():
  adapters = lora_lib.init_adapters(CONFIG, LORA, jax.random.PRNGKey(0))
  for target in LORA.targets:  # B = 0 at init; make it something to get wrong
    b = adapters["layers"][target]["b"]
    adapters["layers"][target]["b"] = jax.random.normal(jax.random.PRNGKey(1), b.shape)
  return adapters


def test_tensors_carry_peft_names_and_layouts():
  adapters = trained_adapters()
  tensors = peft_adapter.to_peft(adapters, CONFIG, LORA)
  assert len(tensors) == 2 * 2 * CONFIG.n_layers
  last = CONFIG.n_layers - 1
  q_a = tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"]
  np.testing.assert_array_equal(q_a, np.asarray(adapters["layers"]["q"]["a"][0]).T)
  assert q_a.shape == (2, CONFIG.d_model)  # lora_A.weight is [r, D_in]
  down_b = tensors[f"base_model.model.model.layers.{last}.mlp.down_proj.lora_B.weight"]
  np.testing.assert_array_equal(down_b, np.asarray(adapters["layers"]["down"]["b"][last]).T)
  assert down_b.shape == (CONFIG.d_model, 2)  # lora_B.weight is [D_out, r]
  live = peft_adapter.tensor_names(CONFIG, LORA, adapter_name="default")
  assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight" in live


def test_a_saved_folder_loads_back_to_the_same_policy(tmp_path):
  adapters = trained_adapters()
  peft_adapter.save(str(tmp_path), adapters, CONFIG, LORA, base_model="smollm2")
  settings = json.loads((tmp_path / peft_adapter.CONFIG_FILE).read_text())
  assert settings["r"] == 2 and settings["lora_alpha"] == 4.0
  assert settings["target_modules"] == ["down_proj", "q_proj"] and not settings["use_rslora"]
  loaded, lora = peft_adapter.load(str(tmp_path), CONFIG)
  assert lora == LORA
  base = transformer.init_params(CONFIG, jax.random.PRNGKey(2))
  merged = lora_lib.merge(base, adapters, LORA.scale)
  again = lora_lib.merge(base, loaded, lora.scale)
  for target in LORA.targets:
    np.testing.assert_array_equal(np.asarray(merged["layers"][target]),
                                  np.asarray(again["layers"][target]))
    assert not np.array_equal(np.asarray(merged["layers"][target]),
                              np.asarray(base["layers"][target]))


def test_folders_arbor_cannot_load_are_refused_with_the_file_named(tmp_path):
  with pytest.raises(ValueError, match="no adapter_config.json"):
    peft_adapter.load(str(tmp_path), CONFIG)
  peft_adapter.save(str(tmp_path), trained_adapters(), CONFIG, LORA)
  config_path = tmp_path / peft_adapter.CONFIG_FILE
  settings = json.loads(config_path.read_text())
  config_path.write_text(json.dumps(dict(settings, use_rslora=True)))
  with pytest.raises(ValueError, match="plain LoRA only"):
    peft_adapter.load(str(tmp_path), CONFIG)
  config_path.write_text(json.dumps(dict(settings, target_modules=["q_proj", "lm_head"])))
  with pytest.raises(ValueError, match=r"\['lm_head'\] are not projections"):
    peft_adapter.load(str(tmp_path), CONFIG)
  config_path.write_text(json.dumps(settings))
  weights = tmp_path / peft_adapter.WEIGHTS_FILE
  tensors = load_file(str(weights))
  name = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
  save_file({**tensors, name: tensors[name][:1]}, str(weights))
  with pytest.raises(ValueError, match="q_proj.lora_A.weight has shape"):
    peft_adapter.load(str(tmp_path), CONFIG)
  del tensors[name]
  save_file(tensors, str(weights))
  with pytest.raises(ValueError, match="lacks base_model.model.model.layers.0.self_attn.q_proj"):
    peft_adapter.load(str(tmp_path), CONFIG)
