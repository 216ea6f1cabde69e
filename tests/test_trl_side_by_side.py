"""experiments/trl_side_by_side.py's pieces that need no TRL: which configs TRL can mirror,
and the training prompts it is handed (Arbor's, in order, as text that transformers
tokenises to Arbor's ids). The run itself is docs/results/b9/trl_s0.json."""

import pytest
import transformers

from experiments import trl_side_by_side
from experiments.configs import smollm2_basic_arithmetic
from rl import wiring
from tests.hf_reference import save_tiny_hf_model


def test_the_b9_config_is_comparable_and_others_are_refused_by_name():
  config = smollm2_basic_arithmetic.get_config()
  trl_side_by_side.check_comparable(wiring.settings(config))
  config.loss.name = "dapo"
  config.lora.rank = 0
  with pytest.raises(ValueError, match=r"loss.name = 'dapo'.*lora.rank = 0"):
    trl_side_by_side.check_comparable(wiring.settings(config))
  other = smollm2_basic_arithmetic.get_config()
  other.task.prompt_style = "full"
  with pytest.raises(ValueError, match="not scored by rl/tasks/math_answer.py"):
    trl_side_by_side.check_comparable(wiring.settings(other))
  epochs = smollm2_basic_arithmetic.get_config()
  epochs.rl.ppo_epochs = 2
  with pytest.raises(ValueError, match="ppo_epochs = 2"):
    trl_side_by_side.check_comparable(wiring.settings(epochs))


def test_training_prompts_are_the_runs_in_order_and_tokenise_alike(tmp_path):
  folder = save_tiny_hf_model(tmp_path / "m", "qwen2", add_bos=False)
  config = smollm2_basic_arithmetic.get_config()
  config.model.checkpoint = str(folder)
  config.rl.steps = 2
  run = wiring.settings(config)
  tokenizer, _, _ = wiring.load_policy(run, None)
  task = wiring.build_task(run)
  texts, ids, answers = trl_side_by_side.training_prompts(run, task, tokenizer)
  examples = task.examples("train", 2 * config.rollout.prompts_per_step)
  assert len(texts) == len(examples) == 8
  assert answers == [e.entry["answer"] for e in examples]
  assert all(e.prompt in text and text.endswith("<|assistant|>")
             for e, text in zip(examples, texts))
  theirs = transformers.PreTrainedTokenizerFast.from_pretrained(folder)
  assert theirs(text=texts, add_special_tokens=False)["input_ids"] == ids
