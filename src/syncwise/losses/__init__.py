"""Loss functions and the global normaliser that makes accumulated gradients equal the full-batch gradient.

A loss function is called once per micro-batch as ``loss_fn(model_outputs, micro_batch, normalizer)`` and
returns a :class:`LossOutput`. Its ``loss`` must be the micro-batch's share of the *full-batch* loss: a sum
over the micro-batch divided by a *global* count (all micro-batches, all DP ranks), multiplied by
``normalizer.dp_size`` because data-parallel gradient reduction averages over ranks. Summed over every
micro-batch and rank, the shares then give exactly the full-batch loss and gradient, however the batch is
split.
"""

from ..config import AGG_MODES
from .aggregate import aggregate, make_sft_loss, per_position, sequence_sums, sft_loss, target_sequences
from .batch import (
    LAYOUT_SHAPES,
    BatchKey,
    LossFn,
    LossOutput,
    Normalizer,
    check_batch_keys,
    is_maximum,
    reads,
    target_mask,
)
from .logprobs import (
    Logits,
    LogitsFromHidden,
    fused_head_ready,
    logprob_chunking,
    takes_fused_head,
    token_entropy,
    token_log_probs,
    token_log_probs_and_entropy,
    token_log_probs_and_predictions,
)

__all__ = [
    "AGG_MODES", "LAYOUT_SHAPES", "BatchKey", "Logits", "LogitsFromHidden", "LossFn", "LossOutput", "Normalizer",
    "aggregate", "check_batch_keys", "fused_head_ready", "is_maximum", "logprob_chunking", "make_sft_loss",
    "per_position", "reads", "sequence_sums", "sft_loss", "takes_fused_head", "target_mask", "target_sequences",
    "token_entropy", "token_log_probs", "token_log_probs_and_entropy", "token_log_probs_and_predictions",
]
