"""What a DPO job trains and evaluates on, from its config. The same function runs before any rank starts (the
command line's checks: a bad row is one line and exit 2) and in every rank (``datasets``' cache makes the second
time cheap)."""

from __future__ import annotations

from typing import Any

from ..config import Config
from ..data.preference import PreferenceData, load_preference_data


def preference_inputs(config: Config, tokenizer: Any, world: int) -> tuple[PreferenceData, PreferenceData | None,
                                                                            str]:
    """(training pairs, held-out pairs or None, a line where dpo.max_length was clamped to the model's positions);
    a ValueError naming the key for what cannot run on ``world`` ranks."""
    dpo = config.dpo
    if not dpo.dataset:
        raise ValueError("dpo.dataset: syncwise dpo needs preference pairs (JSONL, Parquet or a save_to_disk folder "
                         "with 'chosen' and 'rejected', and 'prompt' or a prompt implicit in both)")
    max_length, note = dpo.max_length, ""
    positions = getattr(_hf_config(config), "max_position_embeddings", None)
    if positions and max_length > positions:
        max_length, note = positions, (f"dpo.max_length={dpo.max_length} is past the model's {positions} positions: "
                                       f"sequences are held to {positions} tokens (dpo.truncation={dpo.truncation})")
    train = load_preference_data(dpo.dataset, tokenizer, max_length, dpo.truncation, dpo.on_bad_row, "dpo.dataset")
    held = None
    if dpo.eval_dataset:
        held = load_preference_data(dpo.eval_dataset, tokenizer, max_length, dpo.truncation, dpo.on_bad_row,
                                    "dpo.eval_dataset")
    if dpo.batch_size < world:
        raise ValueError(f"dpo.batch_size={dpo.batch_size} is smaller than the {world} ranks; every rank needs a pair "
                         "of each step")
    for key, data in (("dpo.dataset", train), ("dpo.eval_dataset", held)):
        if data is not None and len(data) < world:
            raise ValueError(f"{key}: {len(data)} pair(s) for {world} ranks; every rank needs at least one")
    return train, held, note


def _hf_config(config: Config):
    from transformers import AutoConfig

    if config.model.path:
        return AutoConfig.from_pretrained(config.model.path, local_files_only=True)
    from ..models import preset_config

    return preset_config(config.model.preset)
