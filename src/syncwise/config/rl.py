"""The RL sections: GRPO / PPO's task, rollouts, tools and advantages (``rl``), the actor's loss
(``rl.loss``) and PPO's critic (``critic``)."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Any

from .checks import ConfigError, choice, non_negative, positive
from .rollout_engines import ROLLOUT_ENGINES
from .training import DTYPES

POLICY_LOSSES = ("ppo", "gspo", "pg", "cispo")
AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_ESTIMATORS = ("k1", "k2", "k3")
ROLLOUT_IS_LEVELS = ("auto", "none", "token", "sequence")
OFF_POLICY_LOSSES = ("auto", "none", "decoupled", "tis", "mis")
BEHAVIOR_LEVELS = ("token", "sequence")


@dataclass
class PolicyLossConfig:
    """The actor's loss (``rl.loss.*``; ``syncwise.rl.algorithm.losses.make_policy_loss`` builds it)."""

    kind: str = "ppo"  # ppo (clipped), gspo (sequence-level ratio), pg (REINFORCE / GPG), cispo
    clip_low: float = 0.2  # ratio clipped to [1 - clip_low, 1 + clip_high]
    clip_high: float = 0.28  # the upper clip (DAPO's clip-higher: above clip_low)
    dual_clip: float = 0.0  # > 1: cap the loss of negative-advantage tokens at -A * dual_clip
    # A mixture of experts: its router's load-balancing loss x this, added to the actor's loss (0: off, as
    # verl's FSDP engine and TRL's GRPOTrainer by default)
    router_aux_loss_coef: float = 0.0
    agg: str = "token-mean"  # token-mean | seq-mean-token-mean | seq-mean-token-sum | seq-mean-token-sum-norm
    norm_constant: float = 0.0  # seq-mean-token-sum-norm's divisor (0: the longest loss span)
    entropy_coef: float = 0.0  # > 0: an entropy bonus of this weight
    kl_coef: float = 0.0  # > 0: KL to a frozen copy of the initial model
    kl_estimator: str = "k3"  # k1 | k2 | k3 (Schulman's estimators of KL(policy || reference))
    kl_clamp: float = 10.0  # k3: its value bounded to ±kl_clamp, zero gradient beyond, as verl (0: off)
    # Rollout importance correction: each token's policy loss weighted by exp(old - sampler log-prob),
    # truncated at rollout_is_cap and detached; per token, or one weight per sequence (its summed log-ratio).
    # auto: token where the sampler is another network than the trainer's (rl.rollout_engine=vllm, or
    # rl.rollout_dtype other than model.param_dtype), none where it is the same (Config.sampler_differs)
    rollout_is: str = "auto"
    rollout_is_cap: float = 2.0  # the rollout correction's weights truncated here
    # The three-policy loss for samples drawn by an older policy (rl.off_policy_lag, rl.max_staleness): the PPO
    # ratio is to the proximal policy (the update's old log-probs), each token weighted by w = exp(proximal -
    # behaviour), behaviour being the sampler's log-prob when it drew the token. decoupled (AReaL): w, tokens with
    # w > behavior_cap masked; tis: w truncated at behavior_cap; mis: w, masked outside
    # [1/behavior_cap, behavior_cap]; none: no weight. Per token, or one weight per sequence (its summed
    # log-ratio). auto: decoupled with rl.off_policy_lag or rl.max_staleness > 0 (unless rl.loss.rollout_is is
    # set), none otherwise
    off_policy: str = "auto"
    behavior_cap: float = 2.0  # the off-policy weight's cap (its band [1/cap, cap] for mis)
    behavior_level: str = "token"  # token | sequence: one off-policy weight per token, or per sequence

    @property
    def corrects_rollout(self) -> bool:
        """Whether the loss weights tokens by the rollout ratio (``auto`` unresolved -- a config built outside a
        job's :class:`Config`, which resolves it from the sampler -- does not)."""
        return self.rollout_is not in ("none", "auto")

    @property
    def corrects_behavior(self) -> bool:
        """Whether the loss weights tokens by the behaviour ratio (``rl.loss.off_policy``; ``auto`` unresolved
        does not)."""
        return self.off_policy not in ("none", "auto")

    def validate(self, prefix: str = "rl.loss.") -> PolicyLossConfig:
        choice(f"{prefix}kind", self.kind, POLICY_LOSSES)
        non_negative(f"{prefix}router_aux_loss_coef", self.router_aux_loss_coef, "0: off")
        choice(f"{prefix}agg", self.agg, AGG_MODES)
        choice(f"{prefix}kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        choice(f"{prefix}rollout_is", self.rollout_is, ROLLOUT_IS_LEVELS)
        positive(f"{prefix}rollout_is_cap", self.rollout_is_cap)
        choice(f"{prefix}off_policy", self.off_policy, OFF_POLICY_LOSSES)
        choice(f"{prefix}behavior_level", self.behavior_level, BEHAVIOR_LEVELS)
        if not self.behavior_cap > 1:
            raise ConfigError(f"{prefix}behavior_cap: must be > 1 (the band is [1/cap, cap]), got {self.behavior_cap}")
        if self.corrects_behavior and self.corrects_rollout:
            raise ConfigError(f"{prefix}off_policy={self.off_policy} with {prefix}rollout_is={self.rollout_is}: both "
                              f"weight tokens by the sampler's log-probs; use one ({prefix}off_policy covers a sampler "
                              f"that differs from the trainer too)")
        if self.dual_clip and self.dual_clip <= 1.0:
            raise ConfigError(f"{prefix}dual_clip: must be > 1 (or 0 to disable), got {self.dual_clip}")
        for name in ("clip_low", "clip_high", "norm_constant", "entropy_coef", "kl_coef", "kl_clamp"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{prefix}{name}: must be >= 0, got {getattr(self, name)}")
        return self


@dataclass
class RLConfig:
    """GRPO: the task, rollouts, advantages and the policy loss (`syncwise train`)."""

    task: str = "target"  # built-in task (syncwise.rl.env.tasks.TASKS); ignored when dataset is set
    # JSONL, Parquet or a datasets save_to_disk folder with a "prompt" column (other columns reach the reward)
    dataset: str | None = None
    # Held-out prompts in the same form, sampled by the policy and scored with the job's rewards before the first
    # step, every train.eval_every steps and after the last: eval/... in the log (TRL's eval_dataset)
    eval_dataset: str | None = None
    # "package.module:function" (the job's folder on the path) or "path/to/file.py:function"; several as a
    # list [a:f, b:g]. Your code, run with the job's rights
    reward_fn: str | list[str] | None = None
    reward_weights: list[float] = field(default_factory=list)  # one per reward function; empty: all 1
    # Prompts through the tokenizer's chat template: auto (message-list prompts; strings as they are) |
    # true (strings too, as one user message) | false (never)
    chat_template: str = "auto"
    max_prompt_length: int = 512  # prompt tokens; longer ones: rl.prompt_overflow
    prompt_overflow: str = "truncate_left"  # truncate_left | drop | error (counted and logged)
    tokenizer: str | None = None  # local tokenizer dir (default: model.path, or the built-in one)
    prompts_per_rank: int = 4  # prompts each rank takes per step
    samples_per_prompt: int = 8  # the GRPO group size
    max_new_tokens: int = 0  # 0: the task's (target 2, repeat 100; a rl.dataset: 256)
    temperature: float = 1.0  # sampling temperature; training-side log-probs use the same
    # Truncated sampling (0 / 1.0 / 0: off). The sampler's log-probs are of the distribution it drew from;
    # the trainer's of the full temperature-scaled one (rl.loss.rollout_is corrects the mismatch)
    top_k: int = 0  # keep the k most likely tokens (0: off)
    top_p: float = 1.0  # keep the smallest set whose mass reaches p (1.0: off)
    min_p: float = 0.0  # keep tokens at least min_p times the most likely one's probability (0: off)
    # Strings that end a response (kept in it, as vLLM's include_stop_str_in_output would); every end token
    # of the tokenizer and the model's generation_config ends one too
    stop: list[str] = field(default_factory=list)
    # Responses cut by rl.max_new_tokens left out of the loss (TRL's mask_truncated_completions)
    mask_truncated: bool = False
    # Multi-turn rollouts with tools (syncwise.rl.rollout.turns): functions the policy may call -- built-in names
    # (calculator) or "file.py:function" / "package.module:function", typed and documented. With tools,
    # rl.max_new_tokens bounds everything after the prompt (every turn and the tool results between)
    tools: list[str] = field(default_factory=list)
    tool_parser: str = "auto"  # auto (from the chat template) | hermes (<tool_call>{json}</tool_call>) | llama3_json
    max_turns: int = 4  # assistant turns per conversation; the last one's calls are not run
    tool_timeout_s: float = 10.0  # per call; past it the call's answer is an error (counted)
    # All of a step's tool calls on a rank, however many and however long: past it the calls still running or
    # not started answer an error (counted), so slow tools on one rank cannot keep the others waiting at the
    # next collective until dist.timeout_s ends the job. 0: half of dist.timeout_s (it must be less)
    tool_step_timeout_s: float = 0.0
    tool_max_chars: int = 4096  # a tool's answer is cut to this many characters (the cut said in it)
    tool_workers: int = 8  # a turn's calls over all conversations run side by side, this many at a time
    # Policy code (the python tool, or any tool, environment or reward calling syncwise.runtime.sandbox.run_python)
    # runs in namespaces of its own; where the machine makes none it is refused, unless this says to run it
    # UNPROTECTED: in the job's network, /tmp and files
    sandbox_unsafe_no_isolation: bool = False
    # An environment class, "file.py:Class" or "package.module:Class", written to TRL's environment_factory
    # contract (syncwise.rl.env.classes): one instance per conversation, reset(**row), its public methods but
    # reset and get_reward the tools, get_reward() one more reward; a metrics property logged as env/<name>
    environment: str | None = None
    # Your agent, "file.py:function" or "package.module:function", sync or async (syncwise.rl.rollout.agent_loop):
    # run once per sample against an OpenAI-compatible endpoint on the sampling process (token in, token out),
    # given by name any of row, base_url, api_key, model, client (an openai.AsyncOpenAI); it returns its reward,
    # or None for rl.reward_fn to score the final conversation
    agent: str | None = None
    agent_workers: int = 64  # rl.agent: runs at once on a sampling process (their requests sampled together)
    agent_timeout_s: float = 300.0  # rl.agent: one run's seconds; past it the run is cancelled (counted, masked)
    # What samples the responses (syncwise.rl.rollout.front): compact -- each prompt prefilled once, ended
    # sequences dropped, only drawn tokens' log-probs kept (syncwise.rl.rollout.compact); generate -- Hugging Face
    # generate (the earlier path, for comparison); vllm -- a vLLM engine on every rank (syncwise.rl.rollout.vllm)
    rollout_engine: str = "compact"
    # vllm: its KV cache per rank, in bytes. 0: the rank's whole rollout batch at full length
    # (prompts_per_rank x samples_per_prompt x (max_prompt_length + max_new_tokens)), within sync.memory_budget
    vllm_kv_cache_bytes: int = 0
    # vllm on CUDA: sleep mode during the update (level 1 offloads vLLM's weights to host memory and drops its
    # KV cache, level 2 drops both -- the refresh rewrites every weight anyway). auto: level 2 where the
    # training state and the first step's activations do not fit beside vLLM in sync.memory_budget, else 0
    # (awake). CPU has no sleep mode: auto is 0 there, and 1 or 2 is an error.
    vllm_sleep_level: int | str = "auto"
    # The rollout copy's dtype (bfloat16: half the copy and its KV cache; the sampler then differs from the
    # fp32 trainer -- rollout/log_prob_diff says by how much, rl.loss.rollout_is corrects for it)
    rollout_dtype: str = "float32"
    # A mixture of experts (Qwen3-MoE, Mixtral): the training passes route each sampled token through the experts
    # the sampler chose, the weights from the live router (syncwise.rl.rollout.routes). auto: where the model is
    # one and its rollouts can (the compact sampler, one turn, not partial rollouts); true: refused where not;
    # false: off
    router_replay: bool | str = "auto"
    advantage: str = "grpo"  # grpo | drgrpo | rloo
    mini_batches: int = 1  # optimizer steps per pass over a rollout batch (each rank's samples split alike)
    epochs: int = 1  # passes over each rollout batch
    # On-policy (mini_batches = epochs = 1) the old log-probs are the update's own (TRL's shortcut); true:
    # take them in a forward-only pass anyway, as verl does
    old_log_prob_pass: bool = False
    # Before the update, move samples between ranks so each trains on about the same real tokens
    # (Karmarkar-Karp over sequence lengths, all-gathered; the rows that move travel in one all-to-all). The
    # gradient is unchanged.
    balance_ranks: bool = True
    # Move only when that lowers the imbalance (busiest rank's real tokens / the mean) by at least this much:
    # below it the exchange costs more than the ranks would wait.
    balance_min_gain: float = 0.02
    # Supervised steps on the built-in task's correct responses before GRPO (a warm start the job runs
    # itself; a resumed run skips it). 0: none.
    warm_start_steps: int = 0
    # Leave out groups whose rewards are all equal (zero advantage: no policy-gradient signal), as DAPO's
    # dynamic sampling does; the loss is normalised over the samples that train. With kl_coef or entropy_coef
    # > 0 their KL and entropy terms are dropped too (the update is then not the full batch's).
    skip_uniform_groups: bool = False
    # grpo: group-relative advantages (rl.advantage); ppo: a learned critic (critic.*), GAE and whitened
    # token-level advantages, the value loss beside the policy loss
    algorithm: str = "grpo"
    gamma: float = 1.0  # ppo: GAE's discount (verl's default)
    lam: float = 1.0  # ppo: GAE's lambda (verl's default)
    # ppo: > 0 subtracts this x per-token KL(old policy || reference) from the token rewards (verl's
    # use_kl_in_reward with kl_penalty "kl"); the reference as for rl.loss.kl_coef
    kl_in_reward: float = 0.0
    # Off-policy steps with a fixed lag (verl's one-step-off-policy, prime-rl's async level): step t trains on
    # samples drawn by the policy of step t - k (the first k steps on the initial policy's). Each rank keeps the
    # k batches drawn ahead in its checkpoint; rl.loss.off_policy weighs the staleness in. 0: synchronous. Unset
    # (null): 1 with dist.rollout_ranks (unless rl.max_staleness), else 0 -- resolved where config.yaml records it.
    off_policy_lag: int | None = None
    # Partial rollouts carried across steps (AReaL's bounded staleness, colocated): each step samples in rounds
    # of rl.partial_chunk_tokens tokens until rl.prompts_per_rank groups have finished; the groups still
    # sampling continue after the refresh under the new weights (each token keeps the version that drew it),
    # new prompts are admitted while at most (max_staleness + 1) x rl.prompts_per_rank groups are in flight,
    # and a group started more than max_staleness versions before the step that would train it is dropped
    # (rollout/dropped_stale). Conversations too (rl.tools, rl.environment: turns, tool calls and episodes carried);
    # rl.stop strings found across rounds. 0: synchronous.
    max_staleness: int = 0
    partial_chunk_tokens: int = 0  # tokens per round of a partial rollout; 0: a quarter of the response limit
    # (multi-turn: the whole limit -- each round ends every conversation's turn)
    loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)

    @property
    def truncates(self) -> bool:
        """Whether rl.top_k / rl.top_p / rl.min_p cut the sampler's distribution."""
        return self.top_k > 0 or self.top_p < 1 or self.min_p > 0

    def missing_scorer(self) -> str | None:
        """What a job on these keys still needs to score its samples, or None: a prompt file brings no reward (the
        environment's get_reward, or the agent, may score instead). Config.validate refuses it for a job;
        ``syncwise config`` prints the config and says it."""
        if self.dataset and not self.reward_fn and not self.environment and not self.agent:
            return "rl.dataset needs rl.reward_fn (package.module:function): a prompt file brings no reward"
        return None

    def validate(self) -> RLConfig:
        """The section's own rules (those that read another section are :class:`~syncwise.config.Config`'s)."""
        self._validate_algorithm()
        self._validate_rollout()
        self._validate_tools()
        self.loss.validate()
        self._validate_agent()
        positive("rl.prompts_per_rank", self.prompts_per_rank)
        positive("rl.samples_per_prompt", self.samples_per_prompt)
        non_negative("rl.warm_start_steps", self.warm_start_steps)
        non_negative("rl.balance_min_gain", self.balance_min_gain)
        if self.off_policy_lag is not None:
            non_negative("rl.off_policy_lag", self.off_policy_lag, "0: synchronous")
        self._validate_partial()
        if self.warm_start_steps and self.dataset:
            raise ConfigError("rl.warm_start_steps: needs a built-in task's demonstrations, not rl.dataset")
        choice("rl.chat_template", self.chat_template, ("auto", "true", "false"))
        choice("rl.prompt_overflow", self.prompt_overflow, ("truncate_left", "drop", "error"))
        positive("rl.max_prompt_length", self.max_prompt_length)
        functions = reward_paths(self.reward_fn)
        if self.reward_weights and len(self.reward_weights) != len(functions):
            raise ConfigError(f"rl.reward_weights: {len(self.reward_weights)} weight(s) for {len(functions)} "
                              f"reward function(s)")
        positive("rl.mini_batches", self.mini_batches)
        positive("rl.epochs", self.epochs)
        samples = self.prompts_per_rank * self.samples_per_prompt
        if self.mini_batches > samples:
            raise ConfigError(f"rl.mini_batches={self.mini_batches} is more than the {samples} samples each rank has "
                              f"per step (rl.prompts_per_rank x rl.samples_per_prompt)")
        return self

    def _validate_algorithm(self) -> None:
        choice("rl.algorithm", self.algorithm, ("grpo", "ppo"))
        choice("rl.advantage", self.advantage, ("grpo", "drgrpo", "rloo"))
        non_negative("rl.kl_in_reward", self.kl_in_reward, "0: off")
        for key in ("gamma", "lam"):
            if not 0 <= getattr(self, key) <= 1:
                raise ConfigError(f"rl.{key}: must be in [0, 1], got {getattr(self, key)}")
        if self.algorithm == "ppo" and self.skip_uniform_groups:
            raise ConfigError("rl.skip_uniform_groups: a GRPO option (uniform groups have zero group advantage); "
                              "with rl.algorithm=ppo the critic's baseline gives them a signal")
        if self.algorithm != "ppo" and self.kl_in_reward:
            raise ConfigError("rl.kl_in_reward: a PPO option (token-level rewards); with GRPO use rl.loss.kl_coef")
        # GRPO: a group of one is its own baseline, advantage 0, nothing to learn (PPO's baseline is the critic)
        if self.samples_per_prompt < 2 and self.algorithm != "ppo":
            raise ConfigError(
                f"rl.samples_per_prompt=1: rl.advantage={self.advantage} compares samples of one prompt, and a "
                f"group of one has advantage 0 (no gradient, ever); use rl.samples_per_prompt >= 2")

    def _validate_rollout(self) -> None:
        """The rollout engine (and its own checks, from its table entry) and how it samples."""
        choice("rl.rollout_engine", self.rollout_engine, tuple(ROLLOUT_ENGINES))
        for spec in ROLLOUT_ENGINES.values():  # each engine's own keys, whichever engine is chosen
            if spec.check_keys is not None:
                spec.check_keys(self)
        choice("rl.rollout_dtype", self.rollout_dtype, DTYPES)
        if isinstance(self.router_replay, str) and self.router_replay != "auto":
            raise ConfigError(f"rl.router_replay: expected true, false or auto, got {self.router_replay!r}")
        non_negative("rl.max_new_tokens", self.max_new_tokens, "0: the task's")
        positive("rl.temperature", self.temperature)
        non_negative("rl.top_k", self.top_k, "0: off")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"rl.top_p: must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p < 1:
            raise ConfigError(f"rl.min_p: must be in [0, 1), got {self.min_p}")
        if any(not s for s in self.stop):
            raise ConfigError("rl.stop: an empty stop string would end every response at once")
        check = ROLLOUT_ENGINES[self.rollout_engine].check_config
        if check is not None:
            check(self)

    def _validate_partial(self) -> None:
        """The keys alone; how they combine is the table of rollout modes'
        (:func:`~syncwise.config.rollout_modes.resolve_rollout_mode`)."""
        non_negative("rl.max_staleness", self.max_staleness, "0: synchronous")
        non_negative("rl.partial_chunk_tokens", self.partial_chunk_tokens, "0: a quarter of the response limit, "
                                                                            "whole turns multi-turn")

    @property
    def sequences_in_flight(self) -> int:
        """Sequences a rank's rollout engine samples at once: a step's, or with partial rollouts the
        ``max_staleness + 1`` steps' in flight."""
        return self.prompts_per_rank * self.samples_per_prompt * (self.max_staleness + 1)

    @property
    def is_off_policy(self) -> bool:
        """Whether a step may train on samples an older policy drew (a lag, or partial rollouts)."""
        return bool(self.off_policy_lag or self.max_staleness)

    def _validate_agent(self) -> None:
        if not self.agent:
            return
        positive("rl.agent_workers", self.agent_workers)
        positive("rl.agent_timeout_s", self.agent_timeout_s)
        for key, clash in (("rl.tools", self.tools), ("rl.environment", self.environment)):
            if clash:
                raise ConfigError(f"rl.agent with {key}: the agent brings its own tools (the endpoint takes `tools=` "
                                  "and answers with `tool_calls`); give one of them")
        if self.max_staleness:
            raise ConfigError("rl.agent with rl.max_staleness: partial rollouts would carry an agent's run across "
                              "steps, which its code cannot pause; use rl.off_policy_lag for an off-policy agent job")
        if self.skip_uniform_groups:
            raise ConfigError("rl.agent with rl.skip_uniform_groups: a session may have several segments, and groups "
                              "are not skipped by row; leave rl.skip_uniform_groups=false")
        missing = [name for name in ("fastapi", "uvicorn") if importlib.util.find_spec(name) is None]
        if missing:
            raise ConfigError(f"rl.agent: the endpoint needs {', '.join(missing)}: pip install 'syncwise[agent]'")

    def _validate_tools(self) -> None:
        positive("rl.max_turns", self.max_turns)
        positive("rl.tool_timeout_s", self.tool_timeout_s)
        non_negative("rl.tool_step_timeout_s", self.tool_step_timeout_s, "0: half of dist.timeout_s")
        positive("rl.tool_max_chars", self.tool_max_chars)
        positive("rl.tool_workers", self.tool_workers)
        if (self.tools or self.environment) and self.chat_template == "false":
            key = "rl.tools" if self.tools else "rl.environment"
            raise ConfigError(f"{key} with rl.chat_template=false: tools are shown to the model and their results "
                              f"given back through the chat template")


# Sections of the critic that may differ from the actor's (critic.<section>.<key>=...)
CRITIC_SECTIONS = ("model", "engine", "sync", "optim")


@dataclass
class CriticConfig:
    """PPO's value model (``rl.algorithm=ppo``): the policy's architecture with a one-output head on the final
    hidden states, trained by its own engine. ``critic.model.*``, ``critic.engine.*``, ``critic.sync.*`` and
    ``critic.optim.*`` take the actor's keys; what is not set is the actor's (:meth:`Config.critic_config`)."""

    model: dict[str, Any] = field(default_factory=dict)  # e.g. path (default: the policy's), lora.rank
    engine: dict[str, Any] = field(default_factory=dict)  # e.g. micro_batch_size (default: the actor's)
    sync: dict[str, Any] = field(default_factory=dict)  # mode: auto by default, like the actor's
    optim: dict[str, Any] = field(default_factory=dict)  # e.g. lr
    cliprange_value: float = 0.5  # the value loss's clip around the old values (verl's default; 0: off)
    warmup_steps: int = 0  # steps that train only the critic before the actor starts
    export: bool = False  # also write the critic (with its value head) to <out_dir>/export/critic

    def validate(self) -> CriticConfig:
        non_negative("critic.cliprange_value", self.cliprange_value, "0: off")
        non_negative("critic.warmup_steps", self.warmup_steps)
        return self


def reward_paths(value: str | list[str] | None) -> list[str]:
    """``rl.reward_fn`` as a list of paths (one, several, or none)."""
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)
