"""Reinforcement-learning pieces: advantage estimators, policy / value / KL losses, the GRPO trainer."""
