"""Who sends each tensor: ``senders="rank0"`` (vLLM 0.33's single sender) or ``"owners"`` (vLLM 0.34's
dense NCCL engine: each parameter is broadcast by its first owner, ``ParamMeta.owners[0]``).

The rules every many-sender source follows (``MegatronSource``, ``FSDPSource`` under HSDP), and why:

* vLLM 0.34's trainer engine forms its transfer group from rank 0 and every distinct ``owners[0]``
  (``broadcast_ranks``, the same rule as the engine's ``_broadcast_plan``), walks the broadcasters
  in rank order, and pulls a broadcaster's ``iter_full()`` **only on its own turn**; every other
  group member waits in that turn's broadcasts meanwhile. Ranks outside the group drain their
  ``iter_full()`` at once. So a broadcaster's pass may exchange tensors only with ranks outside the
  group (its *helpers*), each helper serves one broadcaster, and nothing in a pass may be a
  collective over all ranks (the first pass's cross-rank agreement runs at construction instead).
* Every parameter declares owners, each rank owns parameters of one broadcaster only (vLLM
  refuses otherwise at ``trainer_init``), and metadata order restricted to a broadcaster is the
  order it yields in.
* vLLM 0.33's engine has one sender: ``"owners"`` there raises ``ValueError`` naming the installed
  version at construction, on every rank, before any byte moves (``require_many_senders``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Literal

from vllm.distributed.weight_transfer.base import ParamMeta

__all__ = ["Senders", "SENDERS", "check_senders", "require_many_senders", "broadcast_ranks", "split_contiguous",
           "many_senders_supported", "vllm_version"]

Senders = Literal["rank0", "owners"]
SENDERS: tuple[str, ...] = ("rank0", "owners")


def check_senders(value: object, *, rank: int, who: str) -> Senders:
    """``value`` if it is one of ``SENDERS``; else ``ValueError`` naming the parameter and rank."""
    if value not in SENDERS:
        raise ValueError(f"rank {rank}: {who}(senders=...) must be one of {SENDERS}, got {value!r}")
    return value  # type: ignore[return-value]


def vllm_version() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


def many_senders_supported() -> bool:
    """Whether the installed vLLM's dense NCCL trainer engine broadcasts from each first owner
    (0.34+: it plans per broadcaster), rather than refusing owners that do not start at rank 0."""
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerWeightTransferEngine

    return callable(getattr(NCCLTrainerWeightTransferEngine, "_broadcast_plan", None))


def require_many_senders(*, rank: int, who: str) -> None:
    """Raise ``ValueError`` (naming the installed vLLM) unless its NCCL engine has many senders."""
    if not many_senders_supported():
        raise ValueError(
            f"rank {rank}: {who}(senders='owners') needs vLLM 0.34 or newer, whose NCCL engine "
            f"broadcasts each parameter from its first owner; the installed vLLM {vllm_version()} "
            "sends everything from rank 0. Use senders='rank0' (the default) with this vLLM"
        )


def broadcast_ranks(metadata: Iterable[ParamMeta]) -> list[int]:
    """The trainer ranks in vLLM's transfer group, in group-rank order: rank 0 and every distinct
    ``owners[0]`` (``owners=None`` counts as rank 0). The NCCL world is these plus the workers."""
    return sorted({0, *(0 if m.owners is None else m.owners[0] for m in metadata)})


def split_contiguous(sizes: Sequence[int], bins: int) -> list[int]:
    """Bin of each item: ``bins`` contiguous runs in item order, item ``i`` in the run its start
    offset falls in (``floor(start * bins / total)``), so every run holds at most
    ``sum(sizes) / bins + max(sizes)`` and each run's items stay in order (a batched gather is cut
    at most ``bins - 1`` times). Deterministic from ``sizes``."""
    total = sum(sizes)
    out: list[int] = []
    start = 0
    for size in sizes:
        out.append(min(bins - 1, start * bins // total) if total else 0)
        start += size
    return out
