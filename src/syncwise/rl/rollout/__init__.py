"""The rollout room: what samples the responses. ``base`` is its door (the engine protocol, the set-up record,
the per-sample trajectory, the seeds); ``front`` the trainer's side of it (:class:`~.front.Rollout`); one
module per engine (``local``: compact and generate on a local copy, ``compact`` the sampler's kernel,
``vllm``); ``turns`` the loop every engine runs under, one turn or several."""
