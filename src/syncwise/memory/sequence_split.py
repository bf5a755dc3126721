"""How many ranks share each sequence (``dist.sequence_parallel=auto``), chosen from memory as the sync mode is:
the fewest whose predicted per-rank peak for the job's longest sequence fits the budget.

Per rank and N: the sharded parameters and AdamW state, the sharded gradients, and one micro-batch of the longest
sequence's activations at 1/N of its tokens (:func:`~syncwise.memory.activations.estimate_activations` with
``sequence_parallel``: the attention's heads exchanged, one layer's exchange in flight) with what FSDP2 holds in
flight beside them. Only sizes that divide the ranks and the model's heads are candidates
(:func:`syncwise.data.ulysses.split_check`). No peer decides this from memory: verl, prime-rl and torchtitan take
the size as given.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..data.ulysses import kv_repeats, split_check
from ..sync.modes import SyncMode
from .accounting import DTYPE_BYTES, format_bytes
from .activations import attention_shape, estimate_activations, working_bytes
from .plan import in_flight_bytes, resident_per_rank, sharded_model_for


@dataclass(frozen=True)
class SplitOption:
    size: int  # ranks sharing each sequence
    peak_bytes: int  # predicted per-rank peak for the longest sequence
    exchange_bytes: int  # sent per rank for one micro-batch of the longest sequence (forward and backward)
    exchanges: int = 0  # all-to-alls of that micro-batch: two a layer forward, two backward

    def exchange_seconds(self, latency_s: float, bandwidth: float) -> float:
        """The micro-batch's all-to-all time over links of ``latency_s`` and ``bandwidth`` bytes/s per rank."""
        return self.exchanges * latency_s * max(self.size - 1, 0) + self.exchange_bytes / bandwidth


def split_options(hf_config, world: int, longest: int, *, param_dtype: str, reduce_dtype: str, lora_rank: int = 0,
                  checkpointing: bool = False, fused_head: bool = True, logprob_chunk: int = 1024,
                  value_head: bool = False) -> list[SplitOption]:
    """Every size that divides ``world`` and the model's heads, smallest first, with its predicted peak."""
    sharded = sharded_model_for(hf_config, world, param_dtype, reduce_dtype, lora_rank, value_head=value_head)
    held = resident_per_rank(sharded, world) + sharded.retained_grad_bytes(SyncMode.PER_MICROBATCH, 1)
    in_loss, in_layer = in_flight_bytes(sharded)
    heads, kv_heads, head_dim = attention_shape(hf_config)
    layers = int(hf_config.num_hidden_layers)
    options = []
    for size in (n for n in range(1, world + 1) if world % n == 0):
        if size > 1 and split_check(heads, kv_heads, size):
            continue
        act = estimate_activations(hf_config, longest, 1, checkpointing, param_dtype, logprob_chunk, fused_head,
                                   head_trains=not lora_rank, value_head=value_head, sequence_parallel=size)
        repeated = kv_heads * kv_repeats(kv_heads, size)
        per_layer = (heads + 2 * repeated + heads) * head_dim * act.tokens * (size - 1) // size
        exchange = 2 * layers * per_layer * DTYPE_BYTES[param_dtype] if size > 1 else 0  # forward and backward
        options.append(SplitOption(size, held + working_bytes(act, in_loss, in_layer), exchange,
                                   4 * layers if size > 1 else 0))
    return options


def choose_split(options: list[SplitOption], budget: int, longest: int) -> tuple[int, str]:
    """The fewest ranks per sequence whose peak fits ``budget``, and the line that says so (the most there are,
    with a line saying it still does not fit, where none does)."""
    table = ", ".join(f"N={o.size}: {format_bytes(o.peak_bytes)}" for o in options)
    for option in options:
        if option.peak_bytes <= budget:
            return option.size, (f"dist.sequence_parallel=auto: {option.size} (the fewest ranks per sequence whose "
                                 f"predicted peak for a {longest}-token sequence fits the budget "
                                 f"{format_bytes(budget)}; {table})")
    last = options[-1]
    return last.size, (f"dist.sequence_parallel=auto: {last.size}, and a {longest}-token sequence is still predicted "
                       f"over the budget {format_bytes(budget)} ({table}); shorten the sequences, checkpoint "
                       f"activations (engine.activation_checkpointing=true) or add ranks")
