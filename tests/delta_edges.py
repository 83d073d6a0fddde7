"""Edge values for the delta diff: the kernel path (``diff_triton``) against the torch path of
``Snapshots.diff_group`` and against a naive oracle (torch's cast, integer compare, ``nonzero``).

Shared by ``tests/test_delta_kernels.py`` (CPU: the torch path always; the kernel under Triton's
interpreter) and ``tests/gpu/part_delta.py`` (CUDA: the compiled kernel). ``check(device)`` returns
``(label, ok, detail)`` rows; every row must be ok.

Per (master dtype, wire dtype) -- fp32, bf16, fp16 masters; bf16, fp16, fp32 wires -- a group of
pieces of odd sizes (ending mid-block, one empty, one of a single element) whose first piece holds
the edge values twice: once where the snapshot holds the same wire bits (unchanged: a NaN equal to
a NaN bit for bit stays unchanged) and once against the values reversed (changed). The edges: +-0,
+-inf, NaNs of both signs and several payloads, the largest finites (some round to inf), fp32, bf16
and fp16 subnormals, round-to-nearest-even ties of bf16 and fp16. Elsewhere ~3% of the elements
differ. Checked: changed positions (per piece, ascending) and values bit for bit, NaN flags, and
the snapshot after the commit equal to the new wire bits -- plus one group where every element
changed (the output's capacity guess overflows: the second launch) and a direct call with a
7-slot capacity.
"""

from __future__ import annotations

import os
import struct
from contextlib import contextmanager
from typing import Any

import torch

MASTERS = (torch.float32, torch.bfloat16, torch.float16)
WIRES = (torch.bfloat16, torch.float16, torch.float32)
_INT = {2: torch.int16, 4: torch.int32}


def _f32(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def edge_values() -> torch.Tensor:
    """fp32 edge values (bit patterns kept: built from their bits where it matters)."""
    vals = [0.0, -0.0, float("inf"), float("-inf"), 3.4028234663852886e38, -3.4028234663852886e38,
            3.3895313892515355e38, 3.39e38, 65504.0, 65520.0, -65519.0, 1e-40, -1e-45, 2.0 ** -126, 2.0 ** -130,
            -(2.0 ** -133), 2.0 ** -24, 3 * 2.0 ** -25, 2.0 ** -25, 6e-8, 1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8,
            1.0 + 2 ** -8 + 2 ** -20, -(1.0 + 2 ** -8), 1.0 + 2 ** -11, 1.0 + 3 * 2 ** -11, 2.0 ** -14 + 2 ** -25,
            1e-8, 0.1, -7.5]
    t = torch.tensor(vals, dtype=torch.float32)
    nans = torch.tensor([0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FFFFFFF, 0x7FC12345, 0x7F80FFFF],
                        dtype=torch.int64).to(torch.int32)
    return torch.cat([t, nans.view(torch.float32)])


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(_INT[t.element_size()])


@contextmanager
def torch_path():
    old = os.environ.get("WEIGHTSYNC_DELTA_TRITON")
    os.environ["WEIGHTSYNC_DELTA_TRITON"] = "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("WEIGHTSYNC_DELTA_TRITON", None)
        else:
            os.environ["WEIGHTSYNC_DELTA_TRITON"] = old


def _case(master: torch.dtype, seed: int, block: int, *, all_change: bool = False):
    """(old, new) piece values (fp32 -> master) of one group."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    sizes = [block * 2 + 17, 1, 0, 31, block, 3 * block + 33, 1000]
    new = [torch.randn(n, generator=g) * 3 for n in sizes]
    edges = edge_values()
    e = edges.numel()
    new[0][:e] = edges
    new[0][e: 2 * e] = edges
    old = [t.clone() for t in new]
    for t in old:
        k = torch.rand(t.numel(), generator=g) < 0.03
        t[k] = t[k] * 1.5 + 1.0
    old[0][:e] = edges  # unchanged, NaNs included (same bits)
    old[0][e: 2 * e] = torch.flip(edges, (0,))
    if all_change:
        old = [t + 1.0 for t in new]
    return [t.to(master) for t in old], [t.to(master) for t in new]


def _run(path: str, old: list[torch.Tensor], new: list[torch.Tensor], wire: torch.dtype, device: str):
    """One Snapshots through an anchor of ``old`` and a diff of ``new``: (changes, snapshot bits, stats)."""
    from weightsync.sources.core.layouts.pieces import Piece
    from weightsync.sources.delta.diff import Snapshots

    snaps = Snapshots("device")
    pieces = [Piece(f"t{i}", (0,), t.to(device)) for i, t in enumerate(old)]
    snaps.diff_group(0, [(p, wire) for p in pieces], everything=True)
    snaps.commit_group()
    pieces = [Piece(f"t{i}", (0,), t.to(device)) for i, t in enumerate(new)]
    k0 = snaps.kernel_buckets
    if path == "torch":
        with torch_path():
            found = snaps.diff_group(0, [(p, wire) for p in pieces], everything=False)
    else:
        found = snaps.diff_group(0, [(p, wire) for p in pieces], everything=False)
    out = [(None if ch.pos is None else ch.pos.to("cpu", torch.int64), _bits(ch.values).cpu(), ch.has_nan())
           for ch in found]
    snaps.commit_group()
    (_, flat), = snaps._groups.values()  # noqa: SLF001 - the test reads the one bucket's snapshot
    return out, _bits(flat).cpu(), snaps.kernel_buckets - k0


def _oracle(old: list[torch.Tensor], new: list[torch.Tensor], wire: torch.dtype, device: str):
    """Per piece: (positions whose wire bits differ, their new bits, any NaN among them); the new bits."""
    out, allbits = [], []
    for a, b in zip(old, new):
        wa, wb = _bits(a.to(device).to(wire)).cpu(), _bits(b.to(device).to(wire)).cpu()
        pos = (wa != wb).nonzero().view(-1)
        vals = wb[pos]
        out.append((pos, vals, bool(torch.isnan(vals.view(wire)).any())))
        allbits.append(wb)
    return out, torch.cat(allbits)


def _compare(got, want) -> list[str]:
    bad = []
    for i, ((gp, gv, gn), (wp, wv, wn)) in enumerate(zip(got, want)):
        if gp is None or not torch.equal(gp, wp):
            bad.append(f"piece {i}: positions {None if gp is None else gp.numel()} vs {wp.numel()}")
        elif not torch.equal(gv, wv):
            j = (gv != wv).nonzero().view(-1)[:3].tolist()
            bad.append(f"piece {i}: values differ at {j}: {gv[j].tolist()} vs {wv[j].tolist()}")
        elif gn != wn:
            bad.append(f"piece {i}: NaN flag {gn} vs {wn}")
    return bad


def check(device: str, *, kernels: bool) -> list[tuple[str, bool, Any]]:
    """Rows ``(label, ok, detail)``. ``kernels``: also run the kernel path (CUDA, or Triton's
    interpreter with ``TRITON_INTERPRET=1`` set before Triton was imported)."""
    rows: list[tuple[str, bool, Any]] = []
    block = 4096
    if kernels:
        from weightsync.sources.delta import diff_triton as kern

        block = kern.BLOCK
    for mi, master in enumerate(MASTERS):
        for wi, wire in enumerate(WIRES):
            old, new = _case(master, 10 * mi + wi, block)
            want, want_snap = _oracle(old, new, wire, device)
            n_changed = sum(w[0].numel() for w in want)
            paths = ["torch"] + (["kernel"] if kernels else [])
            for path in paths:
                got, snap, kb = _run(path, old, new, wire, device)
                bad = _compare(got, want)
                if not torch.equal(snap, want_snap):
                    bad.append(f"snapshot after commit: {(snap != want_snap).sum().item()} elements differ")
                if (path == "kernel") != (kb > 0):
                    bad.append(f"kernel_buckets={kb} on the {path} path")
                rows.append((f"{path} path {master} -> {wire}: changed positions, values (bitwise, NaN "
                             f"included), NaN flags and committed snapshot == torch's cast + integer compare",
                             not bad, bad[:3] or f"{n_changed} changed"))
    if kernels:
        for master, wire in ((torch.float32, torch.bfloat16), (torch.bfloat16, torch.float16)):
            old, new = _case(master, 99, block, all_change=True)
            want, want_snap = _oracle(old, new, wire, device)
            got, snap, kb = _run("kernel", old, new, wire, device)
            bad = _compare(got, want) + ([] if torch.equal(snap, want_snap) else ["snapshot differs"])
            rows.append((f"kernel {master} -> {wire}, every element changed (capacity guess overflows: "
                         "a second launch)", not bad and kb > 0, bad[:3] or f"{sum(w[0].numel() for w in want)}"))
        rows.append(_tiny_capacity(device, block))
    return rows


def _tiny_capacity(device: str, block: int) -> tuple[str, bool, Any]:
    from weightsync.sources.delta import diff_triton as kern

    old, new = _case(torch.float32, 7, block)
    wire = torch.bfloat16
    want, want_snap = _oracle(old, new, wire, device)
    snap = torch.cat([t.to(device).to(wire) for t in old])
    cur = [t.to(device) for t in new]
    r = kern.diff(cur, snap, wire, kern.Layout([t.numel() for t in cur], torch.device(device)), capacity=7)
    got = [(p.to("cpu", torch.int64), _bits(v).cpu(), n)
           for p, v, n in zip(r.pos.split(r.counts), r.values.split(r.counts), r.nan)]
    bad = _compare(got, want) + ([] if torch.equal(_bits(snap).cpu(), want_snap) else ["snapshot differs"])
    return ("diff_triton.diff with capacity 7: the second launch appends the rest in order",
            not bad and r.launches == 2, bad[:3] or f"{r.launches} launches, {sum(r.counts)} changed")
