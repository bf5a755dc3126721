"""The rollout front's training batch, built as whole tensors from the samples' lists: its layout by hand."""

from __future__ import annotations

import types

import torch

from syncwise.rl.rollout.front import Rollout


def _trajectory(prompt, tokens, sampled, full, drawn, ended):
    return types.SimpleNamespace(prompt=prompt, tokens=tokens, sampled=sampled, full_log_probs=full,
                                 drawn_log_probs=drawn, ended=ended)


def test_the_batch_pads_right_masks_the_responses_and_aligns_the_log_probs_with_targets():
    trajectories = [_trajectory([5, 6, 7], [8, 9], [1, 1], [-0.5, -1.0], [-0.25, -1.0], ended=True),
                    _trajectory([4], [3, 2, 1], [1, 0, 1], [-2.0, -3.0, -4.0], [-2.0, -3.0, -3.5], ended=False)]
    front = types.SimpleNamespace(cfg=types.SimpleNamespace(mask_truncated=True),
                                  tokenizer=types.SimpleNamespace(pad_token_id=0))
    result = types.SimpleNamespace(trajectories=trajectories)
    Rollout._batch(front, result)
    assert result.batch["input_ids"].tolist() == [[5, 6, 7, 8, 9], [4, 3, 2, 1, 0]]
    assert result.batch["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
    # the truncated sample (not ended) trains nothing with rl.mask_truncated; a tool's token (0) never
    assert result.batch["loss_mask"].tolist() == [[0, 0, 0, 1, 1], [0, 0, 0, 0, 0]]
    assert result.log_probs.tolist() == [[0.0, 0.0, -0.5, -1.0], [-2.0, 0.0, -4.0, 0.0]]
    torch.testing.assert_close(result.kept_mass, torch.tensor([-0.25, 0.0, 0.0, -0.5]).exp().double())
    front.cfg.mask_truncated = False
    Rollout._batch(front, result)
    assert result.batch["loss_mask"].tolist() == [[0, 0, 0, 1, 1], [0, 1, 0, 1, 0]]
