"""SFT datasets: read with Hugging Face ``datasets`` (JSONL, Parquet, or a ``save_to_disk`` folder), tokenised
once with its cache (:mod:`syncwise.data.chat` for the formats), every row checked before any rank trains,
and walked in a deterministic per-epoch order (:class:`SampleOrder`) that a resumed run continues exactly."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..runtime import script_objects
from .chat import FORMATS, TRUNCATION, RowError, assistant_mask_source, detect_format, tokenize_row, truncated
from .partition import karmarkar_karp

TOKENS_FORMAT = "tokens"  # pre-tokenised rows: 'input_ids' (and optionally 'loss_mask'), as built-in tasks give
_CACHE_VERSION = "1"  # bump when tokenisation changes, so cached results are not reused


class DatasetError(ValueError):
    """A dataset the job cannot train on: one line naming the key, the file and the row."""


@dataclass
class SFTData:
    """A tokenised dataset: per row its token ids and loss mask (1: a training target)."""

    source: str  # what the rows came from (a path, or a built-in task)
    format: str
    input_ids: list[list[int]]
    loss_masks: list[list[int]]
    truncated: list[bool]
    mask_source: str | None = None  # messages: "markers" or "prefix"
    skipped: int = 0  # bad rows left out (sft.on_bad_row=skip)
    dropped: int = 0  # longer than sft.max_length with truncation=drop, or truncation cut every target
    lengths: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.lengths = [len(ids) for ids in self.input_ids]

    def __len__(self) -> int:
        return len(self.input_ids)

    def describe(self) -> str:
        """One line for the job's start: the format (and how assistant turns were found), rows, what was left out."""
        how = {"markers": " (assistant tokens from the template's generation markers)",
               "prefix": " (assistant tokens by rendering each turn's prefix)"}.get(self.mask_source or "", "")
        text = FORMATS.get(self.format, "pre-tokenised rows")
        left_out = f", {self.skipped} bad row(s) skipped" if self.skipped else ""
        left_out += f", {self.dropped} too long dropped" if self.dropped else ""
        return f"{self.source}: {len(self)} rows, {self.format} -- {text}{how}{left_out}"

    def subset(self, rows: list[int], source: str) -> SFTData:
        return SFTData(source, self.format, [self.input_ids[i] for i in rows], [self.loss_masks[i] for i in rows],
                       [self.truncated[i] for i in rows], self.mask_source)


def read_rows(path: str, key: str):
    """The ``datasets.Dataset`` at ``path`` (``.jsonl`` / ``.json``, ``.parquet``, or a ``save_to_disk``
    folder), or the one a Python script gave its trainer (``<script>:name``: a ``datasets.Dataset``, its
``DatasetDict``'s train split, or a list of dicts); a :class:`DatasetError` naming ``key``, the file and, for
JSONL, the line, if it cannot be read."""
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    if script_objects.is_reference(path):
        return _script_rows(path, key)
    file = Path(path)
    if not file.exists():
        raise DatasetError(f"{key}: {path} does not exist")
    try:
        if file.is_dir():
            loaded = datasets.load_from_disk(str(file))
            if isinstance(loaded, datasets.DatasetDict):
                if "train" not in loaded:
                    raise DatasetError(f"{key}: {path} holds splits {sorted(loaded)}, none called 'train'")
                loaded = loaded["train"]
            return loaded
        kind = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}.get(file.suffix)
        if kind is None:
            raise DatasetError(f"{key}: {path}: expected a .jsonl, .json or .parquet file or a save_to_disk folder")
        return datasets.load_dataset(kind, data_files=str(file), split="train")
    except DatasetError:
        raise
    except Exception as exc:  # the reader's own error: find the line it means, where we can
        where = _jsonl_problem(file) if file.suffix in (".jsonl", ".json") else None
        raise DatasetError(f"{key}: {path}: {where or _first_line(exc)}") from exc


def _script_rows(reference: str, key: str):
    """The rows a script gave (see :func:`read_rows`) as a ``datasets.Dataset``."""
    import datasets

    try:
        given = script_objects.lookup(reference, key)
    except ValueError as exc:
        raise DatasetError(str(exc)) from exc
    if isinstance(given, datasets.DatasetDict):
        if "train" not in given:
            raise DatasetError(f"{key}: the DatasetDict given holds splits {sorted(given)}, none called 'train'")
        given = given["train"]
    if isinstance(given, datasets.IterableDataset):
        raise DatasetError(f"{key}: an IterableDataset is read as it streams; give a datasets.Dataset or a list "
                           "of dicts (dataset.take(n) then Dataset.from_list, or the files themselves)")
    if isinstance(given, datasets.Dataset):
        return given
    if isinstance(given, list) and all(isinstance(row, dict) for row in given):
        try:
            return datasets.Dataset.from_list(given)
        except Exception as exc:  # arrow cannot type the column
            raise DatasetError(f"{key}: the list of rows given cannot be made a datasets.Dataset: {exc}") from exc
    raise DatasetError(f"{key}: expected a datasets.Dataset or a list of dicts, got {type(given).__name__}")


def load_sft_data(path: str, tokenizer, max_length: int, truncation: str, on_bad_row: str,
                  key: str = "sft.dataset") -> SFTData:
    """Read, detect the format, tokenise (cached by ``datasets``), check every row; truncate to
    ``max_length``. A bad row is a :class:`DatasetError` (``on_bad_row=error``) or left out and counted."""
    rows = read_rows(path, key)
    if len(rows) == 0:
        raise DatasetError(f"{key}: {path} has no rows")
    return tokenize_dataset(rows, path, tokenizer, max_length, truncation, on_bad_row, key)


def tokenize_dataset(rows, source: str, tokenizer, max_length: int, truncation: str, on_bad_row: str,
                     key: str = "sft.dataset") -> SFTData:
    """Tokenise a ``datasets.Dataset`` (see :func:`load_sft_data`)."""
    if truncation not in TRUNCATION:
        raise ValueError(f"truncation {truncation!r} is not one of {', '.join(TRUNCATION)}")
    columns = rows.column_names
    try:
        fmt = TOKENS_FORMAT if "input_ids" in columns else detect_format(columns, rows[0])
        mask_source = assistant_mask_source(tokenizer) if fmt == "messages" else None
        if fmt != TOKENS_FORMAT and tokenizer is None:
            raise RowError(f"the {fmt} format needs a tokenizer")
    except RowError as exc:
        raise DatasetError(f"{key}: {source}: {exc}") from exc

    def encode(row: dict[str, Any]) -> dict[str, Any]:
        try:
            ids, mask = _tokens(row) if fmt == TOKENS_FORMAT else tokenize_row(row, fmt, tokenizer, mask_source)
        except RowError as exc:
            return {"input_ids": [], "loss_mask": [], "truncated": False, "dropped": False, "error": str(exc)}
        cut = truncated(ids, mask, max_length, truncation)
        return {"input_ids": cut.input_ids, "loss_mask": cut.loss_mask, "truncated": cut.truncated,
                "dropped": cut.dropped, "error": ""}

    fingerprint = tokenized_fingerprint(rows, fmt, mask_source, tokenizer, max_length, truncation)
    done = rows.map(encode, remove_columns=columns, new_fingerprint=fingerprint)
    errors = [i for i, e in enumerate(done["error"]) if e]
    if errors and on_bad_row == "error":
        first = errors[0]
        raise DatasetError(f"{key}: {source} {row_name(source, first)}: {done[first]['error']}"
                           + (f" ({len(errors) - 1} more bad row(s); sft.on_bad_row=skip leaves them out)"
                              if len(errors) > 1 else " (sft.on_bad_row=skip leaves such rows out)"))
    keep = [i for i, (e, dropped) in enumerate(zip(done["error"], done["dropped"], strict=True))
            if not e and not dropped]
    if not keep:
        raise DatasetError(f"{key}: {source}: no row left to train on ({len(errors)} bad, "
                           f"{sum(done['dropped'])} longer than sft.max_length={max_length} and dropped)")
    kept = done.select(keep).to_dict()  # plain lists: a step reads a few rows, each by index
    return SFTData(source, fmt, kept["input_ids"], kept["loss_mask"], kept["truncated"], mask_source,
                   skipped=len(errors), dropped=sum(done["dropped"]))


def rows_dataset(rows: list[dict[str, Any]]):
    """A ``datasets.Dataset`` of in-memory rows (a built-in task's)."""
    import datasets

    return datasets.Dataset.from_list(rows)


def split_off(data: SFTData, fraction: float, seed: int) -> tuple[SFTData, SFTData]:
    """(train, eval): a seeded ``fraction`` of the rows held out for evaluation."""
    count = max(1, round(len(data) * fraction))
    if count >= len(data):
        raise DatasetError(f"sft.eval_fraction={fraction}: leaves no training row of {len(data)}")
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(seed * 7919 + 17)).tolist()
    held = sorted(order[:count])
    rest = sorted(order[count:])
    return data.subset(rest, data.source), data.subset(held, f"{data.source} (eval {fraction:g})")


class SampleOrder:
    """The order samples are trained in: epoch by epoch, each a permutation seeded by (seed, epoch); a
    global position counts samples from the start of the job, so step boundaries -- and where a resumed
    run goes on -- follow from it alone."""

    def __init__(self, lengths: list[int], seed: int):
        self.lengths, self.seed = lengths, seed
        self._epoch, self._perm = -1, []

    def __len__(self) -> int:
        return len(self.lengths)

    def index(self, position: int) -> int:
        epoch, offset = divmod(position, len(self.lengths))
        if epoch != self._epoch:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._epoch, self._perm = epoch, torch.randperm(len(self.lengths), generator=gen).tolist()
        return self._perm[offset]

    def step(self, position: int, batch_size: int, batch_tokens: int, min_samples: int) -> tuple[list[int], int]:
        """The samples of the step that starts at ``position`` -- ``batch_size`` of them, or (``batch_tokens`` >
        0) as many as reach that many real tokens, at least ``min_samples`` -- and the next step's position."""
        if batch_tokens <= 0:
            return [self.index(p) for p in range(position, position + batch_size)], position + batch_size
        samples, tokens = [], 0
        while tokens < batch_tokens or len(samples) < min_samples:
            samples.append(self.index(position + len(samples)))
            tokens += self.lengths[samples[-1]]
        return samples, position + len(samples)

    def steps_for(self, epochs: float, batch_size: int, batch_tokens: int, min_samples: int) -> int:
        """How many steps ``epochs`` passes over the data take."""
        end, position, steps = round(epochs * len(self.lengths)), 0, 0
        while position < end:
            _, position = self.step(position, batch_size, batch_tokens, min_samples)
            steps += 1
        return max(steps, 1)


def rank_share(samples: list[int], lengths: list[int], rank: int, world: int) -> list[int]:
    """This rank's samples of a step: a Karmarkar-Karp split of the step's samples by length (each rank about
    the same real tokens), the same on every rank; the gradient does not depend on the split."""
    parts = karmarkar_karp([float(lengths[i]) for i in samples], world)
    parts = sorted((sorted(p) for p in parts), key=lambda p: (p[0] if p else len(samples)))
    return [samples[i] for i in parts[rank]]


def padded_batch(data: SFTData, rows: list[int], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded ``input_ids``, ``attention_mask`` and ``loss_mask`` of these rows."""
    width = max(data.lengths[i] for i in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    loss_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for r, i in enumerate(rows):
        n = data.lengths[i]
        input_ids[r, :n] = torch.tensor(data.input_ids[i])
        attention[r, :n] = 1
        loss_mask[r, :n] = torch.tensor(data.loss_masks[i])
    return {"input_ids": input_ids, "attention_mask": attention, "loss_mask": loss_mask}


def _tokens(row: dict[str, Any]) -> tuple[list[int], list[int]]:
    ids = row.get("input_ids")
    if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
        raise RowError("'input_ids' is not a non-empty list of token ids")
    mask = row.get("loss_mask") or [1] * len(ids)
    if len(mask) != len(ids):
        raise RowError(f"'loss_mask' has {len(mask)} entries for {len(ids)} tokens")
    if not any(mask[1:]):
        raise RowError("no trainable token (the loss mask is empty)")
    return list(ids), [int(m) for m in mask]


def tokenized_fingerprint(rows, fmt: str, mask_source: str | None, tokenizer, max_length: int, truncation: str) -> str:
    """The cache key of the tokenised dataset: the rows', the tokenizer's (vocabulary, template, special
    tokens) and the settings'."""
    digest = hashlib.sha256()
    parts = [_CACHE_VERSION, rows._fingerprint, fmt, str(mask_source), str(max_length), truncation]
    if tokenizer is not None:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        parts += [backend.to_str() if backend is not None else repr(sorted(tokenizer.get_vocab().items())),
                  str(getattr(tokenizer, "chat_template", None)), str(tokenizer.eos_token_id),
                  str(getattr(tokenizer, "bos_token_id", None)), type(tokenizer).__name__]
    for part in parts:
        digest.update(part.encode())
        digest.update(b"\0")
    return digest.hexdigest()[:32]


def row_name(source: str, index: int) -> str:
    """``line N`` of a JSONL file (blank lines skipped as the reader skips them), else ``row N`` (from 1)."""
    path = Path(source)
    if path.suffix in (".jsonl", ".json") and path.is_file():
        seen = -1
        with open(path) as f:
            for number, line in enumerate(f, start=1):
                if line.strip():
                    seen += 1
                    if seen == index:
                        return f"line {number}"
    return f"row {index + 1}"


def _jsonl_problem(path: Path) -> str | None:
    """The first line of a JSONL file that is not a JSON object, or whose column changes type."""
    types: dict[str, str] = {}
    with open(path) as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                return f"line {number} is not JSON ({exc.msg})"
            if not isinstance(row, dict):
                return f"line {number} is a JSON {type(row).__name__}, not an object"
            for key, value in row.items():
                kind = type(value).__name__
                if value is not None and types.setdefault(key, kind) != kind:
                    return f"line {number}: '{key}' is {kind}, where earlier lines have {types[key]}"
    return None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    cause = exc.__cause__ or exc.__context__
    if cause is not None and str(cause).strip():
        text = f"{text}: {str(cause).strip()}"
    return text.splitlines()[0]
