"""Tests for experiments.memory: the planner's parts add up, chunked log-probs and remat
shrink what it reports by what they should, and a HF config.json is read."""

import json

from experiments import memory


def _config_json(tmp_path, vocab):
  path = tmp_path / "config.json"
  path.write_text(json.dumps({
      "model_type": "llama", "vocab_size": vocab, "hidden_size": 32, "num_hidden_layers": 2,
      "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 64,
      "max_position_embeddings": 256, "tie_word_embeddings": True, "rope_theta": 10000.0}))
  return str(path)


def test_chunked_logprobs_drop_the_logits_buffers_and_remat_the_activations(tmp_path):
  spec = _config_json(tmp_path, vocab=8192)
  common = dict(batch=4, seq_len=128, new_tokens=16, mesh_sizes=(1, 1, 1), dtype="float32")
  dense = memory.plan(spec, logprob_chunk=0, remat="none", **common)
  chunked = memory.plan(spec, logprob_chunk=32, remat="none", **common)
  remat = memory.plan(spec, logprob_chunk=32, remat="full", **common)
  logits = 4 * 128 * 8192 * 4  # one [B, T, V] float32 buffer
  assert dense["logits_buffer_bytes"] == logits
  assert dense["train_step"]["temp_bytes"] - chunked["train_step"]["temp_bytes"] >= logits
  assert remat["train_step"]["temp_bytes"] < chunked["train_step"]["temp_bytes"]
  for row in (dense, chunked, remat):
    t = row["train_step"]
    assert t["peak_bytes"] == (t["argument_bytes"] + t["temp_bytes"] + t["output_bytes"]
                               - t["alias_bytes"])
    # Parameters (embedding 8192 x 32, 2 layers) and AdamW's two moments of them.
    assert row["parameters"] == row["parameter_bytes_per_device"]
    assert row["optimizer_bytes_per_device"] >= 2 * row["parameters"]
  table = memory.table([dense, remat])
  assert table.count("\n") == 3 and "| dense | none |" in table and "| 32 | full |" in table


def test_mixed_precision_plans_float32_masters_and_bfloat16_compute(tmp_path):
  """compute_dtype='bfloat16' over float32 parameters: the same parameter and moment bytes,
  the compute dtype in the row and the table. (Its temporaries are not compared: XLA:CPU
  runs bfloat16 matmuls on float32 copies of their operands, so on this backend they grow.)"""
  spec = _config_json(tmp_path, vocab=8192)
  common = dict(batch=4, seq_len=128, new_tokens=16, mesh_sizes=(1, 1, 1), dtype="float32",
                logprob_chunk=32, remat="none")
  full = memory.plan(spec, **common)
  mixed = memory.plan(spec, compute_dtype="bfloat16", **common)
  assert mixed["parameter_bytes_per_device"] == full["parameter_bytes_per_device"]
  assert mixed["optimizer_bytes_per_device"] == full["optimizer_bytes_per_device"]
  assert mixed["train_step"]["temp_bytes"] != full["train_step"]["temp_bytes"]  # it reached XLA
  assert "| 32 | none | bfloat16 |" in memory.table([mixed])
  assert "| 32 | none | float32 |" in memory.table([full])
