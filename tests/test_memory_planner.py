"""Tests for experiments.memory: the planner against the programs it plans for.

Each plan is compared with the real train step and sampler built here apart from the
planner (the model config written out rather than read from the config.json, concrete
arrays, this file's own GRPO config and batch), compiled, and with the arrays they take
and return: the plan must be those programs' memory, byte for byte. Mixed precision is
checked on the step's matmuls themselves (the dtypes of every dot_general in its jaxpr).

What these tests catch (each checked on a scratch copy of the code, never committed):
- the planner dropping compute_dtype (it plans the float32 step for a bfloat16 run):
  test_mixed_precision_plans_the_bfloat16_step_over_float32_masters (its temporaries are
  not the bfloat16 step's);
- a compute dtype that reaches no matmul (`ModelConfig.compute_jnp_dtype` returning the
  parameters' dtype): the same test's dot_general dtype checks;
- optimiser bytes counted as twice the parameters (AdamW's moments without their step
  counts, 8 bytes off): both tests that compare them with the initialised state;
- a sampler planned for prompts of seq_len slots instead of seq_len - new_tokens:
  test_the_plan_is_the_compiled_train_step_and_samplers_memory.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import decode_cost
from experiments import memory
from models import transformer
from rl import train
from rl.types import Rollout
from rl.objectives import losses
from sampling import sampler
from tests import tiny

BATCH, SEQ_LEN, NEW_TOKENS, VOCAB = 4, 128, 16, 8192
# The model the planner reads from `_config_json`'s file.
CONFIG = tiny.model(vocab_size=VOCAB, max_seq_len=256)
# The planner's objective (module docstring: GRPO, token mean, no KL).
GRPO = losses.LossSettings(
    name="grpo", eps_low=0.2, eps_high=0.2, aggregation="token_mean", norm_len=1.0,
    kl_coef=0.0)


def _config_json(tmp_path, vocab=VOCAB):
  path = tmp_path / "config.json"
  path.write_text(json.dumps({
      "model_type": "llama", "vocab_size": vocab, "hidden_size": CONFIG.d_model,
      "num_hidden_layers": CONFIG.n_layers, "num_attention_heads": CONFIG.n_heads,
      "num_key_value_heads": CONFIG.n_kv_heads, "intermediate_size": CONFIG.mlp_dim,
      "max_position_embeddings": CONFIG.max_seq_len,
      "tie_word_embeddings": CONFIG.tie_embeddings, "rope_theta": CONFIG.rope_theta}))
  return str(path)


def _plan(tmp_path, **overrides):
  tmp_path.mkdir(parents=True, exist_ok=True)
  args = dict(batch=BATCH, seq_len=SEQ_LEN, new_tokens=NEW_TOKENS, mesh_sizes=(1, 1, 1),
              dtype="float32", logprob_chunk=0, remat="none")
  return memory.plan(_config_json(tmp_path), **{**args, **overrides})


def _nbytes(tree) -> int:
  return sum(np.asarray(x).nbytes for x in jax.tree.leaves(tree))


def _rollout():
  rng = np.random.default_rng(0)
  completion = np.arange(SEQ_LEN)[None].repeat(BATCH, 0) >= SEQ_LEN // 2
  return Rollout(
      tokens=jnp.asarray(rng.integers(0, VOCAB, (BATCH, SEQ_LEN)), jnp.int32),
      prompt_mask=jnp.asarray(~completion), completion_mask=jnp.asarray(completion),
      behavior_logp=jnp.asarray(-2.0 * completion, jnp.float32),
      version=jnp.zeros((BATCH, SEQ_LEN), jnp.int32), group=jnp.arange(BATCH) // 2,
      reward=jnp.zeros((BATCH,)), advantages=jnp.asarray(completion, jnp.float32))


def _train_step(config):
  """(the real train step for `config`, a fresh state of it, a batch): concrete arrays."""
  optimizer = train.make_optimizer(1e-6)
  state = train.init_train_state(transformer.init_params(config, jax.random.PRNGKey(0)),
                                 optimizer)
  return train.make_train_step(config, optimizer, GRPO), state, _rollout()


def _analysis(compiled) -> dict:
  m = compiled.memory_analysis()
  return dict(argument_bytes=m.argument_size_in_bytes, output_bytes=m.output_size_in_bytes,
              temp_bytes=m.temp_size_in_bytes, alias_bytes=m.alias_size_in_bytes)


def _dot_dtypes(fn, *args) -> list[tuple[str, str, str]]:
  """(lhs, rhs, result) dtypes of every dot_general in fn's jaxpr, sub-jaxprs included
  (scans, remat, custom VJPs, the backward): the matmuls as written, before a backend's
  rewrites (XLA:CPU runs bfloat16 matmuls on float32 copies)."""
  found = []

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "dot_general":
        found.append(tuple(str(v.aval.dtype) for v in (*eqn.invars, eqn.outvars[0])))
      for value in eqn.params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
          if isinstance(item, jax.extend.core.ClosedJaxpr):
            walk(item.jaxpr)
          elif isinstance(item, jax.extend.core.Jaxpr):
            walk(item)

  walk(jax.make_jaxpr(fn)(*args).jaxpr)
  return found


@pytest.fixture(scope="module")
def dense_plan(tmp_path_factory):
  return _plan(tmp_path_factory.mktemp("dense"))


def test_the_plan_is_the_compiled_train_step_and_samplers_memory(dense_plan):
  """The dense float32 plan against the train step and the sampler compiled here for
  concrete arrays of the same shapes, and against those arrays: the same XLA memory
  analysis; parameters and AdamW moments of the initialised state's size; the donated
  state is what is aliased; the outputs are the new state and the metrics the step
  returns (and their tuple); the arguments are the state and the batch; the temporaries
  hold the [B, T, V] float32 logits the backward needs."""
  plan, t = dense_plan, dense_plan["train_step"]
  step, state, batch = _train_step(CONFIG)
  compiled = step.lower(state, batch).compile()
  assert {k: t[k] for k in _analysis(compiled)} == _analysis(compiled)
  assert plan["parameter_bytes_per_device"] == _nbytes(state.params) > 0
  assert plan["optimizer_bytes_per_device"] == _nbytes(state.opt_state)
  state_bytes = _nbytes(state)
  assert t["alias_bytes"] == state_bytes
  # jit passes only the inputs the step reads: every [B, T] array of the batch, not the
  # per-row group and reward that GRPO's step never reads.
  per_token = _nbytes([batch.tokens, batch.prompt_mask, batch.completion_mask,
                       batch.behavior_logp, batch.version, batch.advantages])
  assert state_bytes + per_token <= t["argument_bytes"] <= state_bytes + _nbytes(batch)
  outputs = compiled(state, batch, None)  # (the new state, the metrics)
  # XLA also counts the output tuple: one 8-byte pointer per array.
  assert t["output_bytes"] == _nbytes(outputs) + 8 * len(jax.tree.leaves(outputs))
  assert t["temp_bytes"] >= BATCH * SEQ_LEN * VOCAB * 4 == plan["logits_buffer_bytes"]
  assert t["peak_bytes"] == (t["argument_bytes"] + t["temp_bytes"] + t["output_bytes"]
                             - t["alias_bytes"])
  # The sampler: its program for prompts of SEQ_LEN - NEW_TOKENS slots, its arguments the
  # parameters and the prompts (and the RNG key and version), its KV cache inside it.
  prompt_len = SEQ_LEN - NEW_TOKENS
  prompts = jnp.zeros((BATCH, prompt_len), jnp.int32)
  mask = jnp.ones((BATCH, prompt_len), bool)
  params = transformer.init_params(CONFIG, jax.random.PRNGKey(0))
  s = plan["sampler"]
  sampling = sampler.SamplingConfig(max_new_tokens=NEW_TOKENS, temperature=1.0)
  compiled = sampler.generate.lower(params, prompts, mask, jax.random.PRNGKey(0), CONFIG,
                                    sampling, 0).compile()  # version 0: the launcher's call
  assert {k: s[k] for k in _analysis(compiled)} == _analysis(compiled)
  inputs = _nbytes((params, prompts, mask))
  assert s["argument_bytes"] == inputs + 8 + 4  # + the uint32[2] key and the int32 version
  kv_cache = 2 * CONFIG.n_layers * BATCH * SEQ_LEN * CONFIG.n_kv_heads * CONFIG.head_dim * 4
  assert s["temp_bytes"] >= kv_cache


@pytest.mark.slow
def test_chunked_logprobs_drop_the_logits_buffers_and_remat_the_activations(tmp_path,
                                                                           dense_plan):
  chunked = _plan(tmp_path / "chunked", logprob_chunk=32)
  remat = _plan(tmp_path / "remat", logprob_chunk=32, remat="full")
  logits = BATCH * SEQ_LEN * VOCAB * 4  # one [B, T, V] float32 buffer
  assert dense_plan["train_step"]["temp_bytes"] - chunked["train_step"]["temp_bytes"] >= logits
  assert remat["train_step"]["temp_bytes"] < chunked["train_step"]["temp_bytes"]
  table = memory.table([dense_plan, remat])
  assert table.count("\n") == 3 and "| dense | none |" in table and "| 32 | full |" in table


def test_mixed_precision_plans_the_bfloat16_step_over_float32_masters(tmp_path, dense_plan):
  """compute_dtype='bfloat16' over float32 parameters: the plan is the memory of the
  step compiled here with bfloat16 compute (not the float32 step's), whose matmuls take
  bfloat16 operands (every dot_general has one; those with a bfloat16 result have only
  those; the rest are the float32-accumulated logits and attention scores and their
  backward), while its parameters and AdamW moments, given and returned, stay float32 (the
  plan's parameter and optimiser bytes are the float32 state's). The float32 step's
  matmuls are all float32: the dtype check tells the two apart."""
  mixed = _plan(tmp_path, compute_dtype="bfloat16")
  step, state, batch = _train_step(CONFIG.replace(compute_dtype="bfloat16"))
  dots = _dot_dtypes(step, state, batch)
  full_dots = _dot_dtypes(*_train_step(CONFIG))
  assert len(dots) == len(full_dots) > 0
  assert all(dtypes == ("float32",) * 3 for dtypes in full_dots), full_dots
  assert all("bfloat16" in dtypes[:2] for dtypes in dots), dots
  assert all(dtypes == ("bfloat16",) * 3 for dtypes in dots if dtypes[2] == "bfloat16"), dots
  assert sum(dtypes == ("bfloat16",) * 3 for dtypes in dots) > len(dots) / 2, dots
  compiled = step.lower(state, batch).compile()
  t = mixed["train_step"]
  assert {k: t[k] for k in _analysis(compiled)} == _analysis(compiled)
  assert t["temp_bytes"] != dense_plan["train_step"]["temp_bytes"]  # another program
  assert mixed["parameter_bytes_per_device"] == _nbytes(state.params)
  assert mixed["optimizer_bytes_per_device"] == _nbytes(state.opt_state)
  new_state, _ = compiled(state, batch, None)
  assert {x.dtype for x in jax.tree.leaves((new_state.params, new_state.opt_state))
          if jnp.issubdtype(x.dtype, jnp.floating)} == {jnp.dtype("float32")}
  assert "| dense | none | bfloat16 |" in memory.table([mixed])
  assert "| dense | none | float32 |" in memory.table([dense_plan])


# --- mixture of experts ----------------------------------------------------------------------

# Published (total, active per token) parameter counts: Qwen/Qwen3-30B-A3B's model card
# ("30.5B in total and 3.3B activated") and Mistral AI's Mixtral 8x7B announcement ("46.7B
# total parameters but only uses 12.9B parameters per token").
PUBLISHED = {"qwen3_30b_a3b": (30.5e9, 3.3e9), "mixtral_8x7b": (46.7e9, 12.9e9)}


def _hand_count(c, experts: int) -> int:
  """Parameters from the config.json fields, by hand: embedding and (untied) head, per
  layer attention (q, k, v, o), two RMSNorms and Qwen3's q/k norms, the router and
  `experts` SwiGLU experts, and the final norm."""
  attention = c.d_model * (c.n_heads + 2 * c.n_kv_heads) * c.head_dim + c.n_heads * c.head_dim * c.d_model
  norms = 2 * c.d_model + (2 * c.head_dim if c.qk_norm else 0)
  per_layer = attention + norms + c.d_model * c.num_experts + experts * 3 * c.d_model * c.mlp_dim
  return 2 * c.vocab_size * c.d_model + c.n_layers * per_layer + c.d_model


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_moe_parameter_counts_match_the_published_ones(name):
  """The presets' total parameters are within 1% of the published totals, and the active
  ones count k experts per block, not X: by hand, and against the published figures.
  Mixtral's active count is within 1% of 12.9B. Qwen3-30B-A3B's is 3.353B, 1.6% above the
  card's 3.3B: that figure has two significant digits and is evidently truncated (3.353
  rounds to 3.4; no subset of the weights one token uses, such as leaving out the
  embedding, 3.04B, gives 3.3), so it is checked to that precision, within 2%."""
  config = memory.model_config(name, "float32", "none", 512)
  total, active = memory.parameter_counts(config)
  assert total == _hand_count(config, config.num_experts)
  assert active == _hand_count(config, config.experts_per_token)
  published_total, published_active = PUBLISHED[name]
  assert abs(total / published_total - 1) < 0.01, total
  assert abs(active / published_active - 1) < (0.02 if name == "qwen3_30b_a3b" else 0.01), active
  # The benchmarks' matmul FLOPs per token count k experts too: at an empty context, 2 per
  # active weight that multiplies (all but the embedding table, looked up, and the norms).
  c = config
  norms = c.n_layers * (2 * c.d_model + (2 * c.head_dim if c.qk_norm else 0)) + c.d_model
  assert decode_cost.decode_flops_per_token(c, 0) == 2 * (active - c.vocab_size * c.d_model
                                                          - norms)
  assert decode_cost.train_flops_per_token(c, 0) == 3 * decode_cost.decode_flops_per_token(c, 0)


def test_dense_counts_and_a_shared_experts_flops(dense_plan):
  """A dense model's active parameters are all of them (the plan's row reports both); a
  shared expert's SwiGLU and its sigmoid gate count for every token."""
  count = sum(x.size for x in jax.tree.leaves(transformer.init_params(CONFIG, jax.random.PRNGKey(0))))
  assert memory.parameter_counts(CONFIG) == (count, count)
  assert dense_plan["parameter_count"] == dense_plan["active_parameter_count"] == count
  assert dense_plan["parameters"] == 4 * count
  moe = CONFIG.replace(num_experts=4, experts_per_token=2, shared_expert_dim=16)
  total, active = memory.parameter_counts(moe)
  per_expert = 3 * moe.d_model * moe.mlp_dim
  assert total - active == moe.n_layers * 2 * per_expert
  assert decode_cost.mlp_weights_per_token(moe) == (
      2 * per_expert + moe.d_model * 4 + 3 * moe.d_model * 16 + moe.d_model)
