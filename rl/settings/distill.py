"""config.distill: on-policy distillation from a frozen teacher.

The objectives are in rl/objectives/distillation.py; this module imports no JAX, so the
default config and the launcher's `--help` stay light.
"""

from __future__ import annotations

import dataclasses

from rl.settings import Settings, setting, used_when


@dataclasses.dataclass(frozen=True)
class DistillSettings(Settings):
  """config.distill: on-policy distillation (docs/distillation.md). A frozen teacher scores
  every sampled token inside the train step; loss = policy objective + coef x the
  distillation term. Refused: a teacher without a coefficient or the reverse, and pure OPD
  without a teacher (nothing would train)."""
  SECTION = "distill"
  teacher: str = setting("", "\"\" = off; an Arbor workdir (its newest checkpoint), a HF "
                         "folder, a .gguf file or \"smollm2\"; same tokenizer as the student, "
                         "context >= prompt_len + max_new_tokens")
  objective: str = setting("reverse_kl", "reverse_kl (exact) | k1 | k3 (sampled, as per-token "
                           "advantages) | forward_kl_topk (DISTILL_OBJECTIVES)",
                           used_when=used_when("teacher"))
  coef: float = setting(0.0, "weight of the distillation term (> 0 with a teacher)", low=0)
  with_reward: bool = setting(True, "False: pure OPD, the policy objective is dropped")
  top_k: int = setting(16, "forward_kl_topk: teacher tokens kept (renormalised)", low=1,
                       used_when=used_when("objective", "forward_kl_topk"))

  def check(self) -> None:
    super().check()
    if bool(self.teacher) != (self.coef > 0):
      raise ValueError(
          f"config.distill.teacher = {self.teacher!r} with config.distill.coef = {self.coef}: "
          "distillation needs both a teacher and a coefficient > 0 (or neither).")
    if not self.with_reward and not self.teacher:
      raise ValueError("config.distill.with_reward = False drops the policy objective: it "
                       "needs a teacher (config.distill.teacher and coef > 0), or nothing "
                       "trains.")
