"""``source_from_accelerator`` says which source it built and why: on CPU accelerate never applies
its FSDP plugin, so a run configured for FSDP gets plain DDP / one process, and the INFO line is the
only place a user sees that (README, "accelerate")."""

from __future__ import annotations

import logging

import torch


def test_cpu_fsdp_plugin_is_logged_as_unsharded(caplog):
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin

    from weightsync.plugins.accelerate import source_from_accelerator

    accelerator = Accelerator(
        fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2), cpu=True, mixed_precision="bf16"
    )
    model = accelerator.prepare(torch.nn.Linear(4, 4))
    with caplog.at_level(logging.INFO, logger="weightsync"):
        source = source_from_accelerator(accelerator, model)
    assert [p.name for p in source.metadata] == ["weight", "bias"]
    assert all(p.dtype == torch.bfloat16 for p in source.metadata)  # the mixed-precision wire dtype
    lines = [r.getMessage() for r in caplog.records if r.name == "weightsync.plugins.accelerate"]
    assert len(lines) == 1, lines
    assert "wire dtype bfloat16 (mixed precision bf16)" in lines[0]
    assert "on CPU accelerate never applies FSDP" in lines[0] and "plain DDP" in lines[0]
