"""The rollout component every on-policy algorithm calls: prompts, sampling settings, engines, tool calls and environments, reward functions, completions as tensors, completion logs."""
