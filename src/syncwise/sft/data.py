"""What an SFT job trains and evaluates on, from its config: a dataset with its tokenizer, or a built-in
task. The same function runs before any rank starts (the command line's checks: a bad row is one line and
exit 2) and in every rank (``datasets``' cache makes the second time cheap)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import Config
from ..data.sft_dataset import SFTData, load_sft_data, rows_dataset, split_off, tokenize_dataset
from .tasks import progression_rows, write_example_data

PROGRESSION_STEPS = 30  # the progression task's epoch: 30 steps of sft.batch_size samples
EVAL_STEPS = 2  # its held-out rows: two steps' worth


@dataclass
class SFTInputs:
    tokenizer: Any  # None for the progression task (token ids directly)
    train: SFTData
    eval: SFTData | None
    model_path: str | None  # the model to start from (model.path, or the arith_chat task's own folder)
    note: str = ""  # said in the job's first lines: sft.max_length clamped to the model's positions

    def check_world(self, world: int, sft) -> None:
        """Every rank needs a sample of every step (and of every evaluation pass)."""
        if not sft.batch_tokens and sft.batch_size < world:
            raise ValueError(f"sft.batch_size={sft.batch_size} is smaller than the {world} ranks; every rank "
                             "needs a sample of each step")
        for what, data in (("sft.dataset", self.train), ("the evaluation rows", self.eval)):
            if data is not None and len(data) < world:
                raise ValueError(f"{what}: {len(data)} row(s) for {world} ranks; every rank needs at least one")


def task_data_dir(config: Config) -> Path:
    """Where the arith_chat task is written (and found again by every rank and a resumed run)."""
    return Path(config.sft.out_dir) / "data"


def write_task_data(config: Config) -> None:
    """The arith_chat task's files, written once (before the ranks, or by rank 0 while the others wait:
    transformers' ``save_pretrained`` writes nothing on the other ranks of a process group)."""
    if config.sft.dataset is None and config.sft.task == "arith_chat":
        write_example_data(task_data_dir(config), seed=config.sft.seed)


def sft_inputs(config: Config) -> SFTInputs:
    """Tokenizer, training and evaluation data of ``config``'s SFT job (the arith_chat task's files must have
    been written: :func:`write_task_data`)."""
    sft = config.sft
    model_path = config.model.path
    if sft.dataset is None and sft.task == "arith_chat":
        data_dir = task_data_dir(config)
        if not (data_dir / "model" / "config.json").is_file():
            raise ValueError(f"sft.task=arith_chat: {data_dir} holds no complete task data")
        model_path = model_path or str(data_dir / "model")
        train_path, eval_path = str(data_dir / "train.jsonl"), str(data_dir / "eval.jsonl")
    else:
        train_path, eval_path = sft.dataset, sft.eval_dataset
    if train_path is None:  # the progression task
        size = sft.batch_size * PROGRESSION_STEPS
        vocab = _model_vocab_size(config)  # the progression's token ids stay below it
        train = _built_in(progression_rows(size, sft.seed, sft.min_len, sft.max_len, vocab), sft, "task progression")
        held = progression_rows(sft.batch_size * EVAL_STEPS, sft.seed + 1, sft.min_len, sft.max_len, vocab)
        return SFTInputs(None, train, _built_in(held, sft, "task progression (eval)"), model_path)
    tokenizer = load_sft_tokenizer(sft.tokenizer or model_path)
    max_length, note = usable_length(sft, _model_config(config, model_path))
    train = load_sft_data(train_path, tokenizer, max_length, sft.truncation, sft.on_bad_row, "sft.dataset")
    held = None
    if eval_path:
        held = load_sft_data(eval_path, tokenizer, max_length, sft.truncation, sft.on_bad_row, "sft.eval_dataset")
    elif sft.eval_fraction:
        train, held = split_off(train, sft.eval_fraction, sft.seed)
    return SFTInputs(tokenizer, train, held, model_path, note)


def usable_length(sft, hf_config) -> tuple[int, str]:
    """``sft.max_length``, clamped to the model's positions where it is past them (a row longer than the model can
    place is cut, or dropped, by ``sft.truncation`` like any long row), and the line that says so."""
    positions = getattr(hf_config, "max_position_embeddings", None)
    if not positions or sft.max_length <= positions:
        return sft.max_length, ""
    return positions, (f"sft.max_length={sft.max_length} is past the model's {positions} positions "
                       f"(max_position_embeddings): rows are held to {positions} tokens (sft.truncation="
                       f"{sft.truncation})")


def _model_config(config: Config, model_path: str | None):
    """The config of the model the job trains (its directory's, or the preset's)."""
    from transformers import AutoConfig

    if model_path:
        return AutoConfig.from_pretrained(model_path, local_files_only=True)
    from ..models import preset_config

    return preset_config(config.model.preset)


def _model_vocab_size(config: Config) -> int:
    """The vocabulary of the model the job trains (its directory's config, or the preset)."""
    if config.model.path:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(config.model.path, local_files_only=True).vocab_size
    from ..models import PRESETS

    return PRESETS[config.model.preset]["vocab_size"]


def load_sft_tokenizer(path: str | None):
    """The tokenizer at ``path`` (sft.tokenizer or model.path), with a pad token (its end token if it has
    none). A dataset of text needs one: a clear error without."""
    if not path:
        raise ValueError("sft.dataset: a dataset of text needs a tokenizer: set model.path (a model directory "
                         "with its tokenizer) or sft.tokenizer")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _built_in(rows: list[dict[str, Any]], sft, source: str) -> SFTData:
    return tokenize_dataset(rows_dataset(rows), source, None, sft.max_length, sft.truncation, sft.on_bad_row)
