"""TRL's trainers in a Python script: ``GRPOTrainer`` / ``SFTTrainer`` / ``DPOTrainer`` with ``GRPOConfig`` /
``SFTConfig`` / ``DPOConfig``, shaped as TRL's (``from syncwise import GRPOTrainer, GRPOConfig`` in place of
``from trl import ...``), running the job ``syncwise train`` / ``sft`` / ``dpo`` runs.

A trainer turns its config's TRL fields into syncwise's keys (:mod:`syncwise.config.trl_args`; a syncwise key by its
dotted name too) and keeps what the script holds -- reward functions, an environment class, tools, datasets,
callbacks -- as script objects (:mod:`syncwise.runtime.script_objects`). ``train()`` then:

- under ``python script.py``: this process is the launcher. It takes the run folder, checks the job (one line, a
  :class:`~syncwise.config.ConfigError`, for a mistake: nothing started), and starts ``dist.nproc`` local ranks,
  each of which runs the script again (as ``torchrun`` does) up to its ``train()``, which there is the rank's job;
  the rest of the script runs here alone, once the job has ended (a failed job: :class:`JobFailed`, its lines);
- in a notebook (or the REPL: no script to run again): the same, the ranks forked from this process (as
  accelerate's ``notebook_launcher`` does), so what it holds is theirs;
- under ``torchrun``: every process is a rank, runs the checks and the job, and goes on with the script.

So what a script defines reaches every rank by being defined there too, as under ``accelerate launch``: the script
must build its trainer alike in every process (its top level runs in each rank up to ``train()``).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import runpy
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from ..config import ConfigError, config_to_dict, load_job_config
from ..config.hub import resolve_hub_ids
from ..config.training import DistConfig
from ..config.trl_args import epochs_to_steps, fields_set, trl_overrides
from ..logs.callbacks import ARGS, CALLBACKS
from ..runtime import script_objects
from ..runtime.launcher import launch_local, rank_main
from ..runtime.rank_server import Worker, end_rank_server
from ..runtime.run_folder import RunFolderLock

SCRIPT_RANK_ENV = "SYNCWISE_SCRIPT_RANK"  # in the ranks a script's trainer started: which train() call is theirs
GIVEN_MODEL = "given_model"  # <out_dir>/given_model: a model object the script gave, saved for the ranks
GIVEN_TOKENIZER = "given_tokenizer"  # and its tokenizer object


class TrainerArguments:
    """A trainer's config: TRL's field names (``output_dir``, ``learning_rate``, ``num_generations``, ...) and any
    syncwise key by its dotted name (``**{"engine.micro_batch_size": 4}``) -- what is given, read as attributes."""

    job = ""

    def __init__(self, **fields: Any):
        self.given = fields

    def __getattr__(self, name: str) -> Any:
        given = self.__dict__.get("given", {})
        if name in given:
            return given[name]
        raise AttributeError(f"{type(self).__name__} has no {name!r} (given: {', '.join(given) or 'none'})")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self.given.items())})"


class GRPOConfig(TrainerArguments):
    """``syncwise train``'s keys by TRL's ``GRPOConfig`` field names."""

    job = "train"


class SFTConfig(TrainerArguments):
    """``syncwise sft``'s keys by TRL's ``SFTConfig`` field names."""

    job = "sft"


class DPOConfig(TrainerArguments):
    """``syncwise dpo``'s keys by TRL's ``DPOConfig`` field names."""

    job = "dpo"


class JobFailed(RuntimeError):
    """The job started and failed in a rank; the message is what the launcher printed."""


class _RankDone(BaseException):  # noqa: N818 -- not an error: ends a rank's run of the script after its job
    """Raised by ``train()`` in a rank a script's launcher started, once the job is done there: the rest of the
    script is the launcher's alone."""


class Trainer:
    """What the three trainers share (see the module's docstring); ``job``: ``train`` | ``sft`` | ``dpo``.

    A script may make several trainers and train them in turn: each trainer's objects are kept under names of its
    own (the n-th trainer the process made: alike in every process), and the ranks of the n-th ``train()`` call
    run the script up to that call -- the calls before it return what their jobs wrote, as they did here."""

    job, worker, data_key = "", "", ""
    _made = itertools.count()  # trainers made in this process
    _trained = itertools.count()  # train() calls in this process

    def __init__(self, model: Any, args: Any = None, train_dataset: Any = None, eval_dataset: Any = None,
                 processing_class: Any = None, callbacks: list[Any] | None = None, **script: Any):
        fields = fields_set(args) if args is not None else {}
        self.tag = f"trainer{next(Trainer._made)}"  # what its script objects are named under
        self.section = "train" if self.job == "train" else self.job
        world = int(fields.get("dist.nproc") or os.environ.get("WORLD_SIZE") or DistConfig().nproc)
        keys = trl_overrides(self.job, fields, world)
        self._model = model
        keys["model.path"] = self._model_path(model, keys)
        tokenizer_key = ("rl" if self.job == "train" else self.job) + ".tokenizer"
        if processing_class is not None:
            keys[tokenizer_key] = self._tokenizer_path(processing_class, keys)
        if train_dataset is not None:
            keys[self.data_key + "dataset"] = script_objects.register(f"{self.tag}/train_dataset", train_dataset)
        if eval_dataset is not None:
            keys[self.data_key + "eval_dataset"] = script_objects.register(f"{self.tag}/eval_dataset", eval_dataset)
        keys.update(self._job_keys(fields, keys, world, train_dataset, **script))
        self._callbacks, self._args = list(callbacks or []), args
        self.config, self.differences = load_job_config(self.job, None, [f"{k}={_yaml(v)}" for k, v in keys.items()])
        self.out_dir = Path(getattr(self.config, self.section).out_dir)
        self._processing_class = processing_class

    # -- what each trainer adds -------------------------------------------------------------------------------
    def _job_keys(self, fields: dict[str, Any], keys: dict[str, Any], world: int, train_dataset: Any,
                  **script: Any) -> dict[str, Any]:
        if script:
            raise ConfigError(f"{type(self).__name__}: no argument {', '.join(script)}")
        return {}

    # -- the model and tokenizer given ------------------------------------------------------------------------
    def _given_folder(self, keys: dict[str, Any], name: str) -> str:
        """``<out_dir>/<name>``: where the launcher saves an object the script gave, for every rank to load."""
        out_dir = keys.get(f"{self.section}.out_dir") or _default_out_dir(self.job)
        return str(Path(out_dir) / name)

    def _model_path(self, model: Any, keys: dict[str, Any]) -> str:
        """A folder or hub id as it is; a model object is saved (by the launcher, at ``train()``) to
        ``<out_dir>/given_model``, which every rank loads."""
        if isinstance(model, (str, os.PathLike)):
            return str(model)
        if not hasattr(model, "save_pretrained"):
            raise ConfigError(f"model: a folder, a hub id or a transformers model, got {type(model).__name__}")
        if hasattr(model, "peft_config"):
            raise ConfigError("model: a peft model's save holds its adapters only; give the base model (its folder "
                              "or object) and the adapter's settings as model.lora.* keys")
        if _under_torchrun():
            raise ConfigError("model: under torchrun give the model's folder or hub id (a model object would be "
                              "saved by every process)")
        return self._given_folder(keys, GIVEN_MODEL)

    def _tokenizer_path(self, tokenizer: Any, keys: dict[str, Any]) -> str:
        """As :meth:`_model_path`, for ``processing_class`` (saved to ``<out_dir>/given_tokenizer``)."""
        if isinstance(tokenizer, (str, os.PathLike)):
            return str(tokenizer)
        if not hasattr(tokenizer, "save_pretrained"):
            raise ConfigError(f"processing_class: a tokenizer or its folder, got {type(tokenizer).__name__}")
        if _under_torchrun():
            raise ConfigError("processing_class: under torchrun give the tokenizer's folder or hub id")
        return self._given_folder(keys, GIVEN_TOKENIZER)

    def _save_given(self) -> None:
        """The launcher saves the model / tokenizer objects the script gave."""
        if not isinstance(self._model, (str, os.PathLike)):
            self._model.save_pretrained(self.config.model.path)
        tokenizer = self._processing_class
        if tokenizer is not None and not isinstance(tokenizer, (str, os.PathLike)):
            tokenizer.save_pretrained(getattr(self.config, "rl" if self.job == "train" else self.job).tokenizer)

    # -- running it ---------------------------------------------------------------------------------------------
    def train(self, resume_from_checkpoint: str | bool | None = None) -> Any:
        """Run the job (see the module's docstring); transformers' ``TrainOutput`` (the last step, the mean loss,
        the last step's metrics). ``resume_from_checkpoint``: True (the run folder's latest) or a checkpoint
        folder."""
        if resume_from_checkpoint is not None and resume_from_checkpoint is not False:
            getattr(self.config, self.section).resume = ("auto" if resume_from_checkpoint is True
                                                         else str(resume_from_checkpoint))
        call = next(Trainer._trained)
        rank = os.environ.get(SCRIPT_RANK_ENV) is not None
        under_torchrun = not rank and _under_torchrun()
        say = not rank and os.environ.get("RANK", "0") == "0"
        if say and self.differences:
            print(f"syncwise {self.job}: beside the defaults: {'; '.join(self.differences)}", flush=True)
        script_objects.register(CALLBACKS, self._callbacks)  # the logs' (rank 0) for this job
        script_objects.register(ARGS, self._args)
        if rank:  # a rank the launcher started for its call-th train(): that job, then the rest is the launcher's
            if call < int(os.environ[SCRIPT_RANK_ENV]):
                return self._outcome()  # an earlier job of the script, run already
            Worker(self.worker).load()(self._checked(save=False, say=False, check=False))
            raise _RankDone
        if under_torchrun:  # every process a rank; rank 0 holds the run folder, as syncwise <job> does there
            lock = RunFolderLock(str(self.out_dir), f"{self.section}.out_dir") if say else contextlib.nullcontext()
            with lock:
                if rank_main(Worker(self.worker).load(), self._checked(save=False, say=say)):
                    raise JobFailed(f"syncwise {self.job}: the job failed on rank {os.environ.get('RANK', '0')}")
            return self._outcome()
        script = getattr(sys.modules["__main__"], "__file__", None)
        script = script if script is not None and Path(script).is_file() else None  # `python -`: "<stdin>"
        with RunFolderLock(str(self.out_dir), f"{self.section}.out_dir"):
            payload = self._checked(save=True, say=True)
            try:
                if script is None:  # a notebook or the REPL: no script to run again; the ranks are its forks
                    result = launch_local(Worker(self.worker), self.config.dist.nproc, payload,
                                          forked_from_here=True)
                else:
                    with _main_not_imported():
                        result = launch_local(Worker(f"{__name__}:script_rank"), self.config.dist.nproc,
                                              {"script": str(Path(script).resolve()), "argv": list(sys.argv),
                                               "call": call})
            finally:
                end_rank_server()
        if result.exit_code:
            raise JobFailed("\n".join(result.lines) or f"syncwise {self.job}: the job ended with exit status "
                            f"{result.exit_code}")
        return self._outcome()

    def _checked(self, save: bool, say: bool, check: bool = True) -> dict[str, Any]:
        """The job's config as its ranks receive it: the model / tokenizer objects the script gave saved (the
        launcher), hub ids resolved, then (``check``) what ``syncwise <job>`` checks before any rank starts -- a
        ConfigError, one line, for a mistake."""
        from .preflight import PreflightError, preflight

        if save:
            self._save_given()
        resolve_hub_ids(self.config, self.job, say=say)
        if check:
            try:
                preflight(self.config, self.job)
            except PreflightError as exc:
                raise ConfigError(str(exc)) from None
        return config_to_dict(self.config)

    def _outcome(self) -> Any:
        from transformers.trainer_utils import TrainOutput

        rows = self._rows()
        steps = [r for r in rows if "loss" in r]
        loss = sum(r["loss"] for r in steps) / len(steps) if steps else float("nan")
        return TrainOutput(int(steps[-1]["train/step"]) if steps else 0, loss, steps[-1] if steps else {})

    def _rows(self) -> list[dict[str, Any]]:
        import json

        log = self.out_dir / "metrics.jsonl"
        return [json.loads(line) for line in log.read_text().splitlines() if line.strip()] if log.exists() else []

    def evaluate(self) -> dict[str, Any]:
        """The held-out set's metrics the job logged last (``eval/...``: after its last step); a ConfigError where
        there are none (no eval_dataset, or train() not run)."""
        evaluated = [r for r in self._rows() if any(k.startswith("eval/") for k in r)]
        if not evaluated:
            raise ConfigError(f"evaluate: {self.out_dir / 'metrics.jsonl'} holds no evaluation (give eval_dataset "
                              "and run train() first)")
        return {k: v for k, v in evaluated[-1].items() if k.startswith("eval/") or k == "train/step"}

    def save_model(self, output_dir: str | None = None) -> None:
        """The trained model (and its tokenizer), as the job exported it, into ``output_dir`` (default: the
        config's output_dir): a folder ``from_pretrained`` loads. Rank 0 only under torchrun; in the ranks of a
        script's later job (running the script again up to their train() call) not at all: its launcher saved it."""
        if os.environ.get(SCRIPT_RANK_ENV) is not None or (os.environ.get("RANK", "0") != "0" and _under_torchrun()):
            return
        export = self.out_dir / "export"
        if not (export / "config.json").exists():
            raise ConfigError(f"save_model: no exported model in {export} (run train() first, with "
                              f"{self.section}.export=true)")
        target = Path(output_dir) if output_dir is not None else self.out_dir
        target.mkdir(parents=True, exist_ok=True)
        for item in export.iterdir():
            if item.is_file():
                shutil.copy2(item, target / item.name)


def _under_torchrun() -> bool:
    """A process torchrun started (its environment, as :func:`~syncwise.runtime.distributed.launched_by_torchrun`
    reads it), not a rank this module's launcher did."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and os.environ.get(SCRIPT_RANK_ENV) is None


@contextlib.contextmanager
def _main_not_imported() -> Iterator[None]:
    """multiprocessing imports the launcher's ``__main__`` (the script) in every process it starts, running its top
    level -- ``train()`` again, as ``__mp_main__``; the ranks run the script themselves (:func:`script_rank`), so
    while they start it is not told where the script is."""
    main = sys.modules["__main__"]
    saved = {name: main.__dict__.pop(name) for name in ("__file__",) if name in main.__dict__}
    spec, main.__spec__ = getattr(main, "__spec__", None), None
    try:
        yield
    finally:
        main.__dict__.update(saved)
        main.__spec__ = spec


def _yaml(value: Any) -> str:
    """A value as an override's YAML (a list or a number as it is, a string quoted where YAML would read it as
    something else)."""
    return yaml.safe_dump(value, default_flow_style=True, width=1 << 20).strip().removesuffix("\n...").strip()


def script_rank(payload: dict[str, Any]) -> None:
    """A rank of a script's job (the local launcher's entry): the script run again as ``__main__`` with its
    arguments, up to its ``payload["call"]``-th ``train()`` call, which runs this rank's share of the job."""
    os.environ[SCRIPT_RANK_ENV] = str(payload["call"])
    sys.argv = list(payload["argv"])
    try:
        runpy.run_path(payload["script"], run_name="__main__")
    except _RankDone:
        return
    raise RuntimeError(f"{payload['script']} ended before its train() call number {payload['call'] + 1} in this "
                       "rank: build and train the trainers alike in every process (not under a condition that differs "
                       "per process)")


class GRPOTrainer(Trainer):
    """TRL's ``GRPOTrainer(model, reward_funcs, args, train_dataset, eval_dataset, processing_class, callbacks)``:
    ``syncwise train`` with the script's reward functions (any TRL or syncwise signature, ``async def`` too),
    ``environment_factory`` (a class written to TRL's contract) and ``tools`` (functions)."""

    job, worker, data_key = "train", "syncwise.rl.job:train_worker", "rl."

    def __init__(self, model: Any, reward_funcs: Any = None, args: Any = None, train_dataset: Any = None,
                 eval_dataset: Any = None, processing_class: Any = None, callbacks: list[Any] | None = None,
                 environment_factory: Any = None, tools: list[Any] | None = None):
        super().__init__(model, args, train_dataset, eval_dataset, processing_class, callbacks,
                         reward_funcs=reward_funcs, environment_factory=environment_factory, tools=tools)

    def _job_keys(self, fields: dict[str, Any], keys: dict[str, Any], world: int, train_dataset: Any,
                  reward_funcs: Any = None, environment_factory: Any = None, tools: Any = None) -> dict[str, Any]:
        out: dict[str, Any] = {}
        funcs = reward_funcs if isinstance(reward_funcs, (list, tuple)) else [reward_funcs] if reward_funcs else []
        names: list[str] = []
        for fn in funcs:
            if isinstance(fn, str):  # TRL also takes a reward model's id: syncwise scores with functions
                raise ConfigError(f"reward_funcs: {fn!r}: syncwise scores with reward functions, not a reward model "
                                  "by name (a function can call one)")
            name = getattr(fn, "__name__", type(fn).__name__)
            name = name if name not in names else f"{name}_{len(names)}"
            names.append(name)
            out.setdefault("rl.reward_fn", []).append(script_objects.register(f"{self.tag}/reward:{name}", fn))
        if environment_factory is not None:
            out["rl.environment"] = script_objects.register(f"{self.tag}/environment", environment_factory)
        if tools:
            out["rl.tools"] = [script_objects.register(f"{self.tag}/tool:{getattr(t, '__name__', i)}", t)
                               for i, t in enumerate(tools)]
        if "max_steps" not in fields and "train.steps" not in keys and train_dataset is not None:
            # TRL trains num_train_epochs (3 by default) passes where max_steps is not given
            per_rank = int(keys.get("rl.prompts_per_rank") or _rl_default("prompts_per_rank"))
            out["train.steps"] = epochs_to_steps(float(fields.get("num_train_epochs", 3.0)), len(train_dataset),
                                                 per_rank * world)
        return out


def _default_out_dir(job: str) -> str:
    from ..config import DPOConfig as DPOSection
    from ..config import SFTConfig as SFTSection
    from ..config.jobs import TrainConfig

    return {"train": TrainConfig, "sft": SFTSection, "dpo": DPOSection}[job]().out_dir


def _rl_default(name: str) -> Any:
    from ..config.rl import RLConfig

    return getattr(RLConfig(), name)


class SFTTrainer(Trainer):
    """TRL's ``SFTTrainer(model, args, train_dataset, eval_dataset, processing_class, callbacks)``: ``syncwise sft``
    on the script's dataset (chat messages, prompt / completion or text rows)."""

    job, worker, data_key = "sft", "syncwise.jobs.sft:sft_worker", "sft."


class DPOTrainer(Trainer):
    """TRL's ``DPOTrainer(model, ref_model, args, train_dataset, eval_dataset, processing_class, callbacks)``:
    ``syncwise dpo`` on the script's preference pairs; ``ref_model`` a folder, hub id or model object (None: the
    initial policy, frozen)."""

    job, worker, data_key = "dpo", "syncwise.jobs.dpo:dpo_worker", "dpo."

    def __init__(self, model: Any, ref_model: Any = None, args: Any = None, train_dataset: Any = None,
                 eval_dataset: Any = None, processing_class: Any = None, callbacks: list[Any] | None = None):
        self._ref_model = ref_model
        super().__init__(model, args, train_dataset, eval_dataset, processing_class, callbacks)

    def _job_keys(self, fields: dict[str, Any], keys: dict[str, Any], world: int, train_dataset: Any,
                  **script: Any) -> dict[str, Any]:
        ref = self._ref_model
        if ref is None:
            return {}
        if isinstance(ref, (str, os.PathLike)):
            return {"dpo.ref_model.path": str(ref)}
        raise ConfigError("ref_model: give the reference model's folder or hub id (None: the initial policy, frozen)")
