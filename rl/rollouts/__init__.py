"""How a batch is made: generations turned into scored `Rollout` batches (`batches`),
which prompts to roll out (`selection`), resumable partial rollouts and their pool
(`partial`, `trajectory_store`) and the asynchronous producer / trainer pair
(`async_loop`)."""
