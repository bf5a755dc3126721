"""Hub model ids where a model folder is asked for (``model.path=Qwen/Qwen2.5-0.5B-Instruct``, as TRL users name
models): resolved through ``huggingface_hub`` to the snapshot folder in its cache -- the cache first, nothing
downloaded under ``HF_HUB_OFFLINE=1`` -- before any rank starts, so that every rank reads the same local folder
(under torchrun each process resolves it; the hub's own file locks let one download while the others wait)."""

from __future__ import annotations

import os
import re
from pathlib import Path

from .checks import ConfigError

# org/name (an optional revision after '@' is not taken: pin one by its snapshot folder instead)
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
WEIGHTS = ("*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.py")  # config, weights, tokenizer, template


class HubModelMissing(ConfigError):
    """A hub id that resolves to nothing here: the message names the key and what to do."""


def resolve_model_folder(value: str | None, key: str) -> str | None:
    """``value`` itself where it is a folder (or unset); a hub id's snapshot folder; a :class:`HubModelMissing`
    naming ``key`` where it is neither."""
    if not value or Path(value).exists() or not HUB_ID.match(value):
        return value
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError, RepositoryNotFoundError

    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    try:
        return snapshot_download(value, allow_patterns=list(WEIGHTS), local_files_only=offline)
    except (LocalEntryNotFoundError, RepositoryNotFoundError, HFValidationError, OSError) as exc:
        how = ("HF_HUB_OFFLINE=1, so nothing is downloaded: download it first (`hf download " + value + "`) or unset "
               "HF_HUB_OFFLINE") if offline else f"the hub did not give it ({type(exc).__name__})"
        raise HubModelMissing(f"{key}: {value} is no folder here, nor a model in the Hugging Face cache; {how}") \
            from None


def resolve_hub_ids(config, job: str, say: bool) -> None:
    """The model folders a job reads, where given as hub ids (``model.path=Qwen/Qwen2.5-0.5B-Instruct``), replaced
    by their snapshot folders in the Hugging Face cache before any rank starts (each said in a line where
    ``say``); a ConfigError naming the key where one is neither a folder nor in the cache."""
    keys = [("model", "path"), (job if job in ("sft", "dpo") else "rl", "tokenizer")]
    if job == "dpo":
        keys.append(("dpo.ref_model", "path"))
    for section, name in keys:
        owner = config
        for part in section.split("."):
            owner = getattr(owner, part)
        given = getattr(owner, name)
        folder = resolve_model_folder(given, f"{section}.{name}")
        if folder != given:
            setattr(owner, name, folder)
            if say:
                print(f"syncwise {job}: {section}.{name}={given}: the Hugging Face cache's {folder}", flush=True)
