"""How a batch is made: producers, the (init, produce) pairs that make the RL phase's
batches with their state explicit (`producers`: independent sampling under a selection
rule, trees; `partial`: resumable partial rollouts), the rollout kinds that build them from
a config (`kinds`), what they report (`statistics`), generations turned into scored
`Rollout` batches (`batches`) and which prompts to roll out (`selection`). The loops that
drive them are `rl.loop` and, beside it, `rl.async_loop` (the asynchronous producer /
trainer pair)."""
