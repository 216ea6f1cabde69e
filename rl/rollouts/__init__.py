"""How a batch is made: producers, the (init, produce) pairs that make the RL phase's
batches with their state explicit (`producers`: independent sampling under a selection
rule, trees; `partial`: resumable partial rollouts), the rollout kinds that build them from
a config (`kinds`), what they report (`statistics`), generations turned into scored
`Rollout` batches (`batches`), which prompts to roll out (`selection`) and the asynchronous
producer / trainer pair (`async_loop`)."""
