"""The environment room: what the policy meets -- prompts and tasks, reward functions, tools and the calls
that reach them, and the :class:`~syncwise.rl.env.base.Environment` every episode is."""
