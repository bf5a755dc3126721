"""The one module that reads FSDP's private state refuses, with a clear error, a torch it was not verified
on: below the minimum version, or an FSDP2 whose internals moved."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from syncwise.sync import fsdp_internals
from syncwise.sync.fsdp_internals import MIN_TORCH, UnsupportedTorchError, require_supported_torch


def test_supported_torch_passes():
    require_supported_torch()


def test_older_torch_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.10.1+cpu")
    wanted = ".".join(map(str, MIN_TORCH))
    with pytest.raises(UnsupportedTorchError, match=rf"syncwise needs torch>={wanted} for FSDP2 \(found 2.10.1\+cpu\)"):
        require_supported_torch()


def test_moved_internals_are_named(monkeypatch):
    group = SimpleNamespace(reduce_grads=True, all_reduce_grads=True, reshard_after_backward=True,
                            post_forward_mesh_info=None, fsdp_params=[SimpleNamespace(all_gather_outputs=[])])
    state = SimpleNamespace(_fsdp_param_groups=[group], _is_root=True, _lazy_init=lambda: None)
    unit = SimpleNamespace(_get_fsdp_state=lambda: state)
    with pytest.raises(UnsupportedTorchError) as info:
        require_supported_torch(unit)
    message = str(info.value)
    for missing in ("_auto_reshard_after_forward", "group._partial_reduce_output", "param.unsharded_accumulated_grad"):
        assert missing in message
    assert fsdp_internals.torch_version() >= MIN_TORCH
