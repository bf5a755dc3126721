"""User mistakes caught before any rank starts: a model directory without a config, a tokenizer that does
not load, a prompt file that does not parse, an SFT row that cannot be trained on, a reward function that
does not import, a checkpoint that is not there. Each is one :class:`PreflightError` naming the key or
file; the command prints it and exits 2.

What can only fail inside a rank (a reward function that raises on some prompt, a collective timeout) is
reported by :mod:`syncwise.runtime.launcher` instead.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from ..config import Config, ConfigError

WEIGHT_FILES = (
    "model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json",
)


class PreflightError(ValueError):
    """A mistake in what the job was given; the message names the key or file."""


def check_model(config: Config) -> None:
    """``model.path`` is a Hugging Face model directory (config and weights), or ``model.preset`` exists."""
    from transformers import AutoConfig

    from ..models import PRESETS

    path = config.model.path
    if not path:
        if config.model.preset not in PRESETS:
            raise PreflightError(f"model.preset: {config.model.preset!r} is not one of {', '.join(PRESETS)}")
        return
    folder = Path(path)
    if not folder.is_dir():
        raise PreflightError(f"model.path: {path} is not a directory (a local Hugging Face model folder)")
    if not (folder / "config.json").is_file():
        raise PreflightError(f"model.path: {path} has no config.json (a local Hugging Face model folder)")
    try:
        AutoConfig.from_pretrained(folder, local_files_only=True)
    except Exception as exc:  # transformers raises several kinds for a bad config
        raise PreflightError(f"model.path: {folder / 'config.json'} does not load: {_first_line(exc)}") from exc
    if not any((folder / name).is_file() for name in WEIGHT_FILES):
        raise PreflightError(f"model.path: {path} has no weights ({' or '.join(WEIGHT_FILES[::2])})")
    check_attention(config.model.attn_implementation, AutoConfig.from_pretrained(folder, local_files_only=True))
    check_weights(config)


def check_weights(config: Config) -> None:
    """``model.path``'s safetensors hold every tensor the model needs, in its shape and a float dtype, and none it
    has no place for: compared from the files' headers with the model built on the meta device (no memory)."""
    from ..models import build_model
    from ..models.checkpoint_files import safetensors_of
    from ..models.loading import preflight_weights

    if not safetensors_of(config.model.path):
        return
    try:
        preflight_weights(build_model(config.model, deferred=True), config.model.path)
    except ValueError as exc:
        raise PreflightError(str(exc)) from exc


# model.attn_implementation -> the flag a transformers model class sets when it has that kernel
_ATTENTION_SUPPORT = {"sdpa": "_supports_sdpa", "flash_attention_2": "_supports_flash_attn",
                      "flash_attention_3": "_supports_flash_attn", "flex_attention": "_supports_flex_attn"}


def check_attention(implementation: str, hf_config) -> None:
    """The model's class has ``model.attn_implementation`` (GPT-Neo's, say, has no sdpa kernel in
    transformers): a one-line error naming the key and what the class does support, not transformers' message
    from inside a rank."""
    from transformers import AutoModelForCausalLM

    flag = _ATTENTION_SUPPORT.get(implementation)
    model_class = AutoModelForCausalLM._model_mapping.get(type(hf_config), None)
    if flag is None or model_class is None or getattr(model_class, flag, True):
        return
    others = [name for name, other in _ATTENTION_SUPPORT.items() if getattr(model_class, other, False)]
    raise PreflightError(f"model.attn_implementation={implementation}: {model_class.__name__} has no such kernel in "
                         f"transformers; use model.attn_implementation=eager"
                         + (f" (or {', '.join(others)})" if others else ""))


def _hf_config(config: Config):
    """The Hugging Face config of the job's model (``model.path``'s, or the preset's)."""
    from ..models import hf_config_for

    return hf_config_for(config.model)


def _meta_model_units(config: Config, value_head: bool = False):
    """The job's model (with its LoRA adapters; ``value_head``: as PPO's critic) and FSDP units on the meta
    device: no weights, no memory."""
    from ..models import meta_model_units

    return meta_model_units(_hf_config(config), config.model.lora, value_head=value_head)


def check_lora(config: Config, value_head: bool = False) -> None:
    """``model.lora.target_modules`` names modules the model has."""
    if not config.model.lora.rank:
        return
    try:
        _meta_model_units(config, value_head)
    except ValueError as exc:
        raise PreflightError(_first_line(exc)) from exc


def check_rl(config: Config) -> None:
    """The tokenizer loads; the prompt file parses (every row a string ``prompt``); the reward imports."""
    from ..checkpoint import CheckpointError, CheckpointManager
    from ..rl.env.tasks import load_tokenizer, prompt_source
    from ..rl.env.tool_calls import check_parser_name, choose_parser

    rl = config.rl
    key = "rl.tokenizer" if rl.tokenizer else "model.path"
    folder = rl.tokenizer or config.model.path
    if folder and not any((Path(folder) / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        raise PreflightError(f"{key}: {folder} has no tokenizer (tokenizer.json or tokenizer_config.json)")
    try:
        load_tokenizer(config)
    except Exception as exc:  # transformers raises several kinds for a folder without a tokenizer
        raise PreflightError(
            f"{key}: cannot load a tokenizer from {rl.tokenizer or config.model.path}: {_first_line(exc)}"
        ) from exc
    try:
        source = prompt_source(rl.task, rl.dataset, rl.reward_fn, rl.reward_weights, rl.tools, rl.environment)
        tokenizer = load_tokenizer(config)
        check_parser_name(rl.tool_parser)
        if rl.tools or rl.environment:  # the template shows the tools and takes their results: it must know how
            choose_parser(tokenizer, rl.tool_parser)
        source.encode(tokenizer, rl)
        if rl.eval_dataset:
            from ..rl.evaluation import eval_source

            eval_source(config, tokenizer)
        if rl.agent:  # it imports, and asks only for what an agent is given
            from ..rl.env.agents import AgentFunction

            AgentFunction.load(rl.agent)
    except ValueError as exc:
        raise PreflightError(str(exc)) from exc
    check_sandbox(config, source.all_tools)
    check_positions(config, source.prompt_ids, rl.max_new_tokens or source.max_new_tokens)
    check_rollout_engine(config, rl.max_new_tokens or source.max_new_tokens)
    try:
        checkpoint = CheckpointManager(Path(config.train.out_dir) / "checkpoints").resolve(config.train.resume)
        if checkpoint is not None and rl.algorithm == "ppo":
            CheckpointManager.check_holds(checkpoint, ["critic"])
    except CheckpointError as exc:
        raise PreflightError(str(exc)) from exc


def check_positions(config: Config, prompt_ids: list[list[int]], max_new_tokens: int) -> None:
    """The longest prompt (as encoded: the template, the tools' schemas, ``rl.max_prompt_length``) and the
    responses' tokens fit the model's positions; else one line, not a batch error at the first step."""
    positions = getattr(_hf_config(config), "max_position_embeddings", None)
    longest = max((len(ids) for ids in prompt_ids or []), default=0)
    if positions and longest + max_new_tokens > positions:
        raise PreflightError(
            f"rl.max_new_tokens: the longest prompt ({longest} tokens; rl.max_prompt_length="
            f"{config.rl.max_prompt_length}) and {max_new_tokens} new tokens need {longest + max_new_tokens} "
            f"positions; the model has {positions} (max_position_embeddings): lower rl.max_prompt_length or "
            "rl.max_new_tokens")


def check_sandbox(config: Config, tools: dict) -> None:
    """The ``python`` tool runs policy code in namespaces of its own; where this machine makes none
    (:func:`syncwise.runtime.sandbox.isolation`) it would share the job's network, ``/tmp`` and files: refused in
    one line unless ``rl.sandbox_unsafe_no_isolation`` says to. (A tool, environment or reward of the user's that
    calls ``run_python`` is refused by it, at its first call.)"""
    from ..runtime.sandbox import REFUSAL, isolation
    from ..tools import BUILTIN_TOOLS

    if config.rl.sandbox_unsafe_no_isolation or isolation().namespaces:
        return
    if any(tool.fn is BUILTIN_TOOLS["python"] for tool in tools.values()):
        raise PreflightError(f"rl.tools: python: {REFUSAL}")


def check_moe(config: Config, job: str) -> None:
    """A mixture of experts' keys: a load-balancing weight on a dense model, and (``train``)
    ``rl.router_replay=true`` where the model or its rollouts cannot replay -- one line each."""
    from ..models.moe import router_aux_coef
    from ..rl.rollout.routes import replays_routes

    hf_config = _hf_config(config)
    try:
        if job == "sft":
            router_aux_coef(hf_config, config.sft.router_aux_loss_coef, "sft.router_aux_loss_coef")
        elif job == "train":
            router_aux_coef(hf_config, config.rl.loss.router_aux_loss_coef, "rl.loss.router_aux_loss_coef")
            replays_routes(config, hf_config)
    except (ValueError, ConfigError) as exc:
        raise PreflightError(str(exc)) from exc


def check_rollout_engine(config: Config, max_new_tokens: int) -> None:
    """``rl.rollout_engine``: the package it needs is installed, its table entry's checks of the model on the
    job's device pass (vLLM's CPU head sizes, its sleep level), and what it holds is sized (a KV cache that holds
    one whole sequence). What needs the engine itself imported (vLLM's architectures, ~10 s) is checked where
    it is built."""
    from ..config.rollout_engines import ROLLOUT_ENGINES
    from ..memory.rollout import footprint_of

    spec = ROLLOUT_ENGINES[config.rl.rollout_engine]
    try:
        spec.require()
        device_type, hf_config = _job_device(config).type, _hf_config(config)
        if spec.check_model is not None:
            spec.check_model(config.rl, hf_config, device_type)
        footprint_of(config.rl, hf_config, 0, max_new_tokens, device_type)
    except ValueError as exc:
        raise PreflightError(str(exc)) from exc


def check_sft(config: Config) -> None:
    """The tokenizer loads; every row of the dataset (and the evaluation set) tokenises into something to
    train on, or is skipped as asked; the checkpoint to resume exists. The tokenised rows stay in
    ``datasets``' cache for the ranks."""
    from ..sft.data import sft_inputs, write_task_data

    sft = config.sft
    folder = sft.tokenizer or config.model.path
    key = "sft.tokenizer" if sft.tokenizer else "model.path"
    if sft.dataset and folder and not any((Path(folder) / name).is_file()
                                          for name in ("tokenizer.json", "tokenizer_config.json")):
        raise PreflightError(f"{key}: {folder} has no tokenizer (tokenizer.json or tokenizer_config.json)")
    with _data_checked(key, folder):
        write_task_data(config)
        inputs = sft_inputs(config)
        inputs.check_world(int(os.environ.get("WORLD_SIZE", config.dist.nproc)), sft)
    _check_resume(sft.out_dir, sft.resume)


def check_dpo(config: Config) -> None:
    """The tokenizer loads; every pair of the dataset (and the evaluation set) tokenises into something to train on,
    or is skipped as asked; the reference model is a model folder; the checkpoint to resume exists."""
    from ..dpo.data import preference_inputs
    from ..sft.data import load_sft_tokenizer

    dpo = config.dpo
    key, folder = ("dpo.tokenizer", dpo.tokenizer) if dpo.tokenizer else ("model.path", config.model.path)
    if not folder or not any((Path(folder) / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        raise PreflightError(f"{key}: {folder or 'the model preset'} has no tokenizer (tokenizer.json or "
                             "tokenizer_config.json); preference pairs are text, and need one")
    ref = dpo.ref_model.path
    if ref and not (Path(ref) / "config.json").is_file():
        raise PreflightError(f"dpo.ref_model.path: {ref} is not a model folder (no config.json)")
    with _data_checked(key, folder):
        preference_inputs(config, load_sft_tokenizer(folder), int(os.environ.get("WORLD_SIZE", config.dist.nproc)))
    _check_resume(dpo.out_dir, dpo.resume)


@contextlib.contextmanager
def _data_checked(key: str, folder: str | None) -> Iterator[None]:
    """A dataset's or tokenizer's error inside, as the job's one line."""
    from ..data.sft_dataset import DatasetError

    try:
        yield
    except (DatasetError, ValueError) as exc:
        raise PreflightError(str(exc)) from exc
    except OSError as exc:  # transformers: a folder without a loadable tokenizer
        raise PreflightError(f"{key}: cannot load a tokenizer from {folder}: {_first_line(exc)}") from exc


def _check_resume(out_dir: str, resume: str) -> None:
    """The checkpoint a job's ``resume`` names exists (sft / dpo)."""
    from ..checkpoint import CheckpointError, CheckpointManager

    try:
        CheckpointManager(Path(out_dir) / "checkpoints").resolve(resume)
    except CheckpointError as exc:
        raise PreflightError(str(exc)) from exc


def check_torch(config: Config) -> None:
    """The installed torch has the FSDP2 syncwise was verified on."""
    from ..sync.fsdp_internals import UnsupportedTorchError, require_supported_torch

    if config.engine.strategy == "fsdp2":
        try:
            require_supported_torch()
        except UnsupportedTorchError as exc:
            raise PreflightError(f"engine.strategy=fsdp2: {exc}") from exc


def check_deferred_units(config: Config, value_head: bool = False) -> None:
    """``sync.deferred_units`` names units the model has, or counts no more than it has (the model is built
    on the meta device: no weights, no memory)."""
    from ..memory.accounting import sharded_model_of
    from ..memory.units import resolve_deferred_units, unit_names

    if config.sync.mode != "partial":
        return
    model, units = _meta_model_units(config, value_head)
    estimator = sharded_model_of(units, max(config.dist.nproc, 1), config.model.param_dtype, config.model.reduce_dtype)
    try:
        resolve_deferred_units(config.sync.deferred_units, unit_names(model, units), estimator)
    except ValueError as exc:
        raise PreflightError(str(exc)) from exc


def check_critic(config: Config) -> None:
    """PPO: the critic's model, LoRA targets and deferred units as the actor's are checked (each error named
    ``critic.``), and both models fit beside each other: their parameters and AdamW state on each rank, the
    rollout copy and the smallest mode's sharded gradients, within the critic's ``sync.memory_budget``."""
    if config.rl.algorithm != "ppo":
        return
    critic = config.critic_config()
    try:
        check_model(critic)
        check_lora(critic, value_head=True)
        check_deferred_units(critic, value_head=True)
    except PreflightError as exc:
        raise PreflightError(f"critic.{exc}") from None
    short = critic_shortfall(config, critic)
    if short:
        raise PreflightError(short)


def critic_shortfall(config: Config, critic: Config) -> str | None:
    """Why the actor and the critic cannot both be in memory in any sync mode, or None: per rank, both models'
    sharded parameters and AdamW state, the rollout copy and the critic's sharded gradients (per_microbatch,
    the mode that holds least) against the critic's budget (``critic.sync.memory_budget``, else the
    actor's; 0: 90% of the device) -- before a step runs, activations not yet counted."""
    from ..memory.accounting import DTYPE_BYTES, format_bytes, resolve_budget
    from ..memory.plan import resident_per_rank, sharded_model_for
    from ..sync.modes import SyncMode

    world = max(int(os.environ.get("WORLD_SIZE", config.dist.nproc)), 1)
    shard = world // max(config.engine.hsdp_replicas, 1)
    sizes = {}
    for name, cfg, value_head in (("actor", config, False), ("critic", critic, True)):
        ranks = shard if cfg.engine.strategy in ("fsdp2", "fsdp1") else 1  # DDP keeps a whole copy per rank
        sharded = sharded_model_for(_hf_config(cfg), ranks, "float32", "float32", cfg.model.lora.rank, value_head)
        sizes[name] = (resident_per_rank(sharded, ranks), sharded.retained_grad_bytes(SyncMode.PER_MICROBATCH, 1),
                       sharded.num_params)
    copy = sizes["actor"][2] * DTYPE_BYTES[config.rl.rollout_dtype]
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    budget = resolve_budget(critic.sync.memory_budget, _job_device(config), local_ranks)
    need = sizes["actor"][0] + sizes["critic"][0] + sizes["critic"][1] + copy
    if need <= budget:
        return None
    return (f"critic: does not fit beside the actor in any sync mode: per rank the actor's parameters and AdamW "
            f"{format_bytes(sizes['actor'][0])}, the critic's {format_bytes(sizes['critic'][0])} and its "
            f"gradients {format_bytes(sizes['critic'][1])}, the rollout copy {format_bytes(copy)} = "
            f"{format_bytes(need)} > budget {format_bytes(budget)}; use more ranks, LoRA for the critic "
            f"(critic.model.lora.rank) or a larger critic.sync.memory_budget")


def preflight(config: Config, job: str) -> None:
    """Everything about ``job`` (``train``, ``sft`` or ``dpo``) that can be checked before ranks start."""
    check_torch(config)
    check_model(config)
    check_lora(config)
    check_deferred_units(config)
    check_moe(config, job)
    from ..engine.sequence_parallel import split_problem

    if reason := split_problem(config, _hf_config(config), int(os.environ.get("WORLD_SIZE", config.dist.nproc))):
        raise PreflightError(reason)
    if job == "train":
        check_critic(config)
        check_rl(config)
    else:
        if config.dist.rollout_ranks:
            raise PreflightError(f"dist.rollout_ranks={config.dist.rollout_ranks} is for syncwise train's rollouts; "
                                 f"syncwise {job} samples nothing (every rank trains)")
        check_sft(config) if job == "sft" else check_dpo(config)


def check_job(payload: dict, job: str) -> None:
    """:func:`preflight` of a job's config as its ranks receive it (the launcher's gate, run apart from it)."""
    from ..config import load_config_dict

    preflight(load_config_dict(payload), job)


def _job_device(config: Config):
    """The device the job's ranks will use (CUDA unless gloo is asked for or there is none)."""
    import torch

    return torch.device("cuda" if config.dist.backend != "gloo" and torch.cuda.is_available() else "cpu")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
