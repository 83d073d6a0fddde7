"""The MTP tests' CLI round (``tests/test_mtp.py``, ``tests/test_mtp_hybrid.py``): ``export --mtp`` of a
preset in a world's ranks, ``check --mtp --checkpoint`` of the folder, then the same check after rank 0
changed one MTP tensor of a copy -- the CLI's own parser, checks and commands, run as a torchrun rank
runs them."""

from __future__ import annotations

import shutil
from typing import Any

__all__ = ["cli", "export_and_check"]


def cli(argv: list[str]) -> tuple[int, str]:
    """One ``weightsync`` command's rank code in this world: (exit code, rank 0's stdout)."""
    import contextlib
    import io

    from weightsync.plugins.cli.check import run_check
    from weightsync.plugins.cli.entry import _parser
    from weightsync.plugins.cli.export import run_export
    from weightsync.plugins.cli.validate import validate_args

    args = _parser().parse_args(argv)
    validate_args(args)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = run_export(args) if args.command == "export" else run_check(args)
    return code, buf.getvalue()


def export_and_check(rank: int, folder: str, base: list[str], changed_tensor: str) -> dict[str, Any]:
    """``export`` then ``check`` with ``base`` (model, layout and ``--mtp`` flags), then ``check`` of a
    copy of the folder whose ``changed_tensor`` rank 0 shifted by one."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from safetensors.torch import load_file, save_file

    res: dict[str, Any] = {"export": cli(["export", *base, "--out", folder])}
    ps.destroy_model_parallel()
    res["check"] = cli(["check", *base, "--checkpoint", folder])
    ps.destroy_model_parallel()
    changed = folder + "-changed"
    if rank == 0:
        shutil.copytree(folder, changed)
        bad = load_file(f"{changed}/model.safetensors")
        bad[changed_tensor] = bad[changed_tensor] + 1.0
        save_file(bad, f"{changed}/model.safetensors", metadata={"format": "pt"})
    dist.barrier()
    res["check_changed"] = cli(["check", *base, "--checkpoint", changed])
    ps.destroy_model_parallel()
    return res
