"""The text ``weightsync plan`` prints for a ``RefitPlan`` (``--json`` prints ``as_dict()`` instead)."""

from __future__ import annotations

from .refit import RefitPlan
from .units import human_bytes

__all__ = ["render", "human_bytes"]


def _ranks(ranks: list[int]) -> str:
    if len(ranks) > 3 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks)) if len(ranks) <= 6 else f"{','.join(map(str, ranks[:4]))},... ({len(ranks)})"


def render(p: RefitPlan) -> str:
    lay = p.layout
    if lay["kind"] == "fsdp":
        where = f"FSDP2 world {lay['world']}" + (f" (HSDP {lay['replicas']} x {lay['shard']})" if lay["replicas"] > 1 else "")
    else:
        where = f"Megatron tp{lay['tp']} pp{lay['pp']} vpp{lay['vpp']} ep{lay['ep']} (world {lay['world']}, dp {lay['dp']})"
    b = p.backend
    how = b["kind"] + (f" senders={b['senders']}" if b["kind"] == "nccl" else "") + (" fp8" if b["fp8"] else "")
    if b["kind"] == "sparse":
        how += f" changed={b['changed']:.2%}"
    lines = [f"model {p.model}: {p.parameters:,} parameters; {where}; {how}; wire dtype {b['wire_dtype']}; {b['device']} constants"]
    for s in p.sources:
        senders = ", ".join(f"rank {r}: {human_bytes(v)}" for r, v in s.bytes_per_sender.items()) if len(s.bytes_per_sender) <= 4 \
            else f"{len(s.bytes_per_sender)} senders, at most {human_bytes(max(s.bytes_per_sender.values()))}"
        lines.append(f"  {s.source}: {s.tensors:,} tensors, {human_bytes(s.bytes)} ({senders})")
        if s.source.startswith("DeltaSource"):
            continue
        for ranks, c in s.roles():
            lines.append(f"    rank{'s' if len(ranks) > 1 else ''} {_ranks(ranks)}: yields {c.tensors:,} tensors / {human_bytes(c.bytes)}; "
                         f"{c.collectives:,} collectives receiving {human_bytes(c.bytes_received)}; "
                         f"peak extra ~{human_bytes(c.peak_extra_bytes)}")
    parts = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in p.time_s.items())
    lines.append(f"  time estimate: {p.total_s * 1e3:.1f} ms = {parts} (serial sum; overlap not credited)")
    assumed = [k for k in p.constants if not k.measured]
    measured = [k for k in p.constants if k.measured]
    if measured:
        lines.append("  measured: " + "; ".join(f"{k.name} ({k.source.split(' ')[0]})" for k in measured))
    if assumed:
        lines.append("  ASSUMED (not measured): " + ", ".join(k.name for k in assumed))
    for n in p.notes:
        lines.append(f"  note: {n}")
    return "\n".join(lines)
