"""The one place a run's sampler is chosen, for its RL batches and for held-out evaluation
alike: plain decoding on one device or over a device mesh, speculative decoding with
model-free drafts, or decoding with an environment that answers tool calls.
"""

from __future__ import annotations

import jax

from models.config import ModelConfig
from rl.rollouts import batches
from rl.rollouts import partial as partial_rollout
from sampling.sampler import SamplingConfig
from sampling.speculative import DraftConfig


def make_sampler(model_config: ModelConfig, sampling_config: SamplingConfig, *,
                 mesh: jax.sharding.Mesh | None = None, drafts: DraftConfig | None = None,
                 turns=None) -> batches.GenerateFn:
  """The sampler these options describe.

  Args:
    model_config: the policy's shapes.
    sampling_config: how to decode (budget, temperature, stops; temperature 0 is greedy).
    mesh: decode over this device mesh (`rl.rollouts.batches.make_generate`); None = one
      device.
    drafts: decode speculatively with these drafts (`sampling.speculative`: the same
      distribution, fewer forwards); one device.
    turns: an `rl.environments.turns.Turns`: the environment answers the policy's tool
      calls between decoding rounds (`rl.rollouts.partial.make_turns_generate`); one device.

  Returns:
    `generate_fn(params, prompt_tokens, prompt_mask, rng, version=0) -> Generation`.

  Raises:
    ValueError: for drafts together with turns, or either with a mesh (the run's config
      check refuses these combinations first, naming the fields).
  """
  if drafts is not None and turns is not None:
    raise ValueError("Speculative drafts do not pause rows at tool calls; drop one of them.")
  if turns is not None:
    if mesh is not None:
      raise ValueError("Turns run on one device; drop the mesh or the environment.")
    return partial_rollout.make_turns_generate(model_config, sampling_config, turns)
  return batches.make_generate(model_config, sampling_config, mesh, draft_config=drafts)
