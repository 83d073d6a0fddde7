"""Every rate and per-tensor cost ``weightsync plan`` multiplies its counts by, each with where it came from.

Invariant: this is the only place the estimate's numbers live. Each ``Constant`` says whether it was
measured (and by which bench run, with the arithmetic that turns the run's figures into the rate) or
is an assumption nobody here measured; ``plan`` prints the assumptions it used next to its estimate,
so a reader always knows which parts of a time are evidence and which are guesses. Counts (tensors,
bytes, collectives) never come from here: they come from the sources' own metadata and plans.

CPU: ``bench/bench_plan.py --fit`` fitted the two CPU source constants on FSDP2 passes. The same
constants overestimate ``MegatronSource`` TP passes (rank 0 receives its peer's shards point to
point, not by all-gather), so ``MegatronSource`` has its own pair, fitted with ``--layout megatron
--fit``. How close each fit came is recorded in ``docs/evidence.md``.

Figures are from ``bench/results/`` (``gpu-*.md``: absolute times of one host; ``history.jsonl``:
ratios) and ``docs/evidence.md``. The H200 runs used vLLM 0.33's engines, the session-12 H100 runs
(the IPC constants) vLLM 0.34's.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Constant", "CONSTANTS", "constant"]


@dataclass(frozen=True)
class Constant:
    """One number of the time model: ``value`` in ``unit``; ``measured`` False: an assumption."""

    name: str
    value: float
    unit: str
    device: str  # "gpu" | "cpu"
    measured: bool
    source: str  # the bench run and the arithmetic, or why it is an assumption

    def as_dict(self) -> dict:
        return {"name": self.name, "value": self.value, "unit": self.unit, "device": self.device,
                "measured": self.measured, "source": self.source}


_QWEN17 = "Qwen3-1.7B bf16, 310 tensors, 3,441,149,952 bytes, 1 H200"
_S12 = "bench/results/gpu-2026-12-06-s12.md (one H100 per run, vLLM 0.34)"

CONSTANTS: dict[str, Constant] = {c.name: c for c in (
    # ---- GPU ---------------------------------------------------------------------------------------
    Constant("d2d_copy_rate", 3_441_149_952 / 1.638e-3, "B/s", "gpu", True,
             f"bench/results/gpu-2026-12-02-run1.md bench_ipc 'd2d copy of the same bytes best_ms' 1.638 ({_QWEN17})"),
    # IPC, engine to engine with FSDPSource (FSDP2 world 1) as the source: least squares of
    # t = tensors * per_tensor + bytes / rate over four H100 cases of session 12 (vLLM 0.34's engines):
    # Qwen3-1.7B (310 tensors, 3.44 GB), Qwen3-8B (399, 16.4 GB), Qwen3-30B-A3B at 12 layers with fused
    # (135, 16.2 GB) and per-expert (4,719) experts -- bench/results/gpu-2026-12-06-s12.md. Each fitted
    # estimate: packed 0.88-1.11x measured, unpacked 0.72-1.20x (bench/bench_plan.py --gpu-results).
    Constant("ipc_packed_per_tensor", 48.6e-6, "s", "gpu", True,
             f"{_S12}: packed (1 GiB+ buffers) FSDPSource best 23.1 / 56.1 / 55.3 / 289.8 ms, fitted"),
    Constant("ipc_packed_rate", 383e9, "B/s", "gpu", True,
             f"{_S12}: packed, bytes per second beyond the per-tensor part (pack copy, IPC, the worker's load)"),
    Constant("ipc_unpacked_per_tensor", 80.8e-6, "s", "gpu", True,
             f"{_S12}: unpacked (vLLM's default: one IPC handle per tensor) FSDPSource best 40.0 / 61.1 / 26.5 / "
             "334.2 ms, fitted"),
    Constant("ipc_unpacked_rate", 890e9, "B/s", "gpu", True,
             f"{_S12}: unpacked, bytes per second beyond the per-tensor part (the worker's copy out of the handle)"),
    Constant("fsdp_source_per_tensor", 17.942e-3 / 310, "s", "gpu", True,
             "gpu-2026-12-02-run1.md bench_ipc 'FSDPSource last_pass' seconds 0.01794 over 310 tensors "
             "(world 1: no gather; the source's own host work per tensor)"),
    Constant("megatron_source_per_tensor", 7.67e-3 / 310, "s", "gpu", True,
             "gpu-2026-12-02-run1.md bench_megatron 'export best_ms' 7.67 (qwen3-1.7b tp1 bf16, 310 tensors)"),
    Constant("fp8_quantize_rate", 2.8e9 / 1.934e-3, "B/s", "gpu", True,
             "docs/evidence.md FP8 session 9 run 5 (gpu-2026-12-04-s9-fp8.md): 196 projections, 2.8 GB of "
             "bf16 read, quantized in 1.934 ms (256 MiB windows) -- bytes of the unquantized weights per second"),
    Constant("gather_rate", 150e9, "B/s", "gpu", False,
             "assumption: NVLink all-gather at 150 GB/s of bytes received per rank (no multi-GPU gather "
             "bench has run here: bench_gpu_sizes's multi-GPU cases are the real-sizes issue's)"),
    Constant("collective_latency", 30e-6, "s", "gpu", False,
             "assumption: 30 us launch + sync per NCCL collective (not measured here)"),
    Constant("nccl_per_tensor", 30e-6, "s", "gpu", False,
             "assumption: 30 us of host work per tensor in vLLM's NCCL engine, sender and worker "
             "(not measured: no multi-GPU NCCL engine run has been recorded)"),
    Constant("apply_per_tensor", 20e-6, "s", "gpu", False,
             "assumption: 20 us per tensor in the receiver's load_weights (not measured separately; "
             "ipc_*_per_tensor already includes the worker's load for IPC)"),
    Constant("delta_diff_rate", 3_441_149_952 / 1.638e-3 / 2, "B/s", "gpu", False,
             "assumption: half the D2D copy rate (docs/evidence.md Delta sync: 'Not measured: the H200 figures')"),
    Constant("sparse_apply_rate", 3_441_149_952 / 1.638e-3 / 3, "B/s", "gpu", False,
             "assumption: a third of the D2D copy rate over the dense bytes (vLLM's sparse apply stages "
             "full-shape NaN tensors and copies them: O(N); not measured)"),
    # ---- CPU ---------------------------------------------------------------------------------------
    Constant("cpu_gather_rate", 0.513e9, "B/s", "cpu", True,
             "bench/bench_plan.py --fit --reps 5 (2026-12-06, 2 gloo ranks on the shared 2-core machine): "
             "least squares over its 4 Qwen3-shaped FSDP2 passes (25-355 tensors, 1.3-35.7 MB received "
             "per rank); with it every case's estimate is 0.85-1.03x the measured pass (fitted in-sample)"),
    Constant("cpu_source_per_tensor", 82.8e-6, "s", "cpu", True,
             "bench/bench_plan.py --fit (same run as cpu_gather_rate): seconds per yielded tensor of an "
             "FSDPSource pass on CPU, everything but the gathers' bytes and latency"),
    Constant("cpu_megatron_per_tensor", 10.8e-6, "s", "cpu", True,
             "bench/bench_plan.py --layout megatron --reps 7 (2026-12-06 s12, 2 gloo ranks, TP2, shared 2-core "
             "host): least squares over two runs' 8 passes (measured 13.2-53.4 ms; the collective latency held at "
             "cpu_collective_latency); with it every pass of both runs is 0.74-1.29x measured"),
    Constant("cpu_megatron_p2p_rate", 0.96e9, "B/s", "cpu", True,
             "bench/bench_plan.py --layout megatron (same fit): bytes of peer shards rank 0 receives point to "
             "point per second"),
    Constant("cpu_collective_latency", 200e-6, "s", "cpu", False,
             "assumption: 200 us per gloo collective on one host (bench_check: the end-of-pass "
             "exchange is 0.2-0.7 ms)"),
    Constant("cpu_diff_rate", 15e6 * 2 / 16e-3, "B/s", "cpu", True,
             "docs/evidence.md Delta sync: cast + word compare + nonzero of 15M bf16 elements in 16 ms"),
    Constant("cpu_apply_per_tensor", 20e-6, "s", "cpu", False,
             "assumption: 20 us per tensor in a CPU receiver's load (the loopback server; not measured)"),
    Constant("cpu_copy_rate", 5e9, "B/s", "cpu", False,
             "assumption: 5 GB/s host memcpy for the loopback wire and apply on CPU"),
    Constant("cpu_quantize_rate", 0.5e9, "B/s", "cpu", False,
             "assumption: 0.5 GB/s of bf16 quantized by the torch path on CPU (not measured)"),
)}


def constant(name: str) -> Constant:
    """The constant ``name``; ``KeyError`` naming the known ones."""
    try:
        return CONSTANTS[name]
    except KeyError:
        raise KeyError(f"no time constant {name!r}; known: {', '.join(sorted(CONSTANTS))}") from None
