"""The delta diff on edge values (``tests/delta_edges.py``): the torch path of
``Snapshots.diff_group`` equals a naive oracle (torch's cast, integer compare, ``nonzero``) for every
master / wire dtype pair, and the fused kernel (``diff_triton``, under Triton's CPU interpreter)
equals both, bit for bit, NaN patterns included.

The kernel test runs in a fresh interpreter with ``TRITON_INTERPRET=1`` (Triton decides interpreted
vs compiled when first imported); it is skipped, saying so, where Triton is not installed.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def test_torch_path_equals_the_oracle_on_edge_values():
    from delta_edges import check

    rows = check("cpu", kernels=False)
    assert len(rows) == 9
    bad = [(label, detail) for label, ok, detail in rows if not ok]
    assert not bad, bad


def test_kernel_equals_the_torch_path_on_edge_values():
    pytest.importorskip("triton", reason="Triton is not installed: the fused delta kernel is not tested on CPU")
    code = ("import sys; from delta_edges import check; rows = check('cpu', kernels=True); "
            "[print(('ok ' if ok else 'BAD ') + label, detail) for label, ok, detail in rows]; "
            "sys.exit(0 if all(ok for _, ok, _ in rows) and len(rows) == 21 else 1)")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env.pop("WEIGHTSYNC_DELTA_TRITON", None)
    proc = subprocess.run([sys.executable, "-c", code], cwd=os.path.dirname(__file__), env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
