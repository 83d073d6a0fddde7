"""Shared plumbing for the examples: where the weights go.

* CPU (default): rank 0 starts weightsync's loopback receiver in a child process -- a CPU stand-in
  for a vLLM server with the same dev-mode HTTP routes -- and every rank uses the ``loopback``
  backend (gloo).
* GPU: point ``--vllm-url`` at a real server started with::

      VLLM_SERVER_DEV_MODE=1 vllm serve <model> --weight-transfer-config '{"backend": "nccl"}'

  and every rank uses vLLM's NCCL backend (``--master-port`` must be free on rank 0's host, which
  the vLLM workers must reach at ``--master-address``).
"""

from __future__ import annotations

import argparse
import functools
import os
import socket
from typing import Any, Callable

# torch, torch.distributed and weightsync are imported where used: an example checks its command
# line before paying for them (examples/megatron_loop.py's layout check answers in well under 1 s)


def add_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--vllm-url", action="append", default=None,
                   help="vLLM server(s) in dev mode; repeat for several instances. Default: a CPU loopback receiver")
    p.add_argument("--api-key", default=os.environ.get("VLLM_API_KEY"))
    p.add_argument("--master-address", default="127.0.0.1")
    p.add_argument("--master-port", type=int, default=0, help="0: a free port")
    p.add_argument("--every", type=int, default=1, help="sync every N optimizer steps")
    p.add_argument("--steps", type=int, default=4)
    return p


#: One bound for both: ``WeightSync(timeout_s=SYNC_TIMEOUT_S)`` bounds weightsync's own waits inside a
#: sync, and the trainer's process group gets the same timeout for its own collectives between syncs
#: (gloo's default is 30 minutes): a rank that stops then ends the job within about this long instead
#: of leaving its peers waiting (README, "A rank that dies or stops").
SYNC_TIMEOUT_S = float(os.environ.get("WEIGHTSYNC_TIMEOUT_S", "300"))


def init_process_group() -> tuple[int, int]:
    """gloo on CPU, nccl with GPUs; from torchrun's environment (or a 1-rank group); its timeout is
    ``SYNC_TIMEOUT_S``."""
    import datetime

    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        timeout = datetime.timedelta(seconds=SYNC_TIMEOUT_S)
        if "RANK" not in os.environ:  # plain `python example.py`: one rank, an in-process store
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        else:
            dist.init_process_group(backend, timeout=timeout)
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    return dist.get_rank(), dist.get_world_size()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _share(obj: Any) -> Any:
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class Target:
    """The receiving side: client, trainer init info, and (CPU) the receiver process to stop."""

    def __init__(self, args: argparse.Namespace, rank: int, receiver_model: Callable[[], Any] | None,
                 *, sparse: bool = False) -> None:
        """``sparse``: a delta sync's engine (vLLM ``sparse_nccl`` / weightsync ``loopback_sparse``)."""
        from weightsync.plugins.sync import VLLMHTTPClient

        self.handle = None
        port = args.master_port
        if args.vllm_url:
            url = args.vllm_url
        else:
            from weightsync.plugins.loopback.receiver import start_receiver_process

            url = None
            if rank == 0:
                _, self.handle = start_receiver_process(receiver_model)
                url = [self.handle.url]
        # loopback: port 0 lets the sender bind a free port itself; vLLM's NCCL needs a concrete one
        url, port = _share((url, port or (free_port() if rank == 0 and args.vllm_url else 0)))
        self.client = VLLMHTTPClient(url, api_key=args.api_key)
        if sparse and not args.vllm_url:
            # the loopback receiver's own client: loopback_sparse checks every round against it
            from weightsync.plugins.loopback.receiver import ReceiverClient

            self.client = ReceiverClient(url[0])
        if args.vllm_url:
            from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

            from vllm.distributed.weight_transfer.sparse_nccl_engine import SparseNCCLTrainerInitInfo

            world = _share(self.client.nccl_world_size() if rank == 0 else None)
            info_cls = SparseNCCLTrainerInitInfo if sparse else NCCLTrainerInitInfo
            self.init_info = info_cls(args.master_address, port, world, rank=rank)
        elif sparse:
            from weightsync.plugins.loopback import LoopbackSparseTrainerInitInfo

            self.init_info = LoopbackSparseTrainerInitInfo(args.master_address, port, 2, rank=rank)
        else:
            from weightsync.plugins.loopback import LoopbackTrainerInitInfo

            self.init_info = LoopbackTrainerInitInfo(args.master_address, port, 2, rank=rank)

    def close(self) -> None:
        if self.handle is not None:
            self.handle.stop()


def tiny_llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                       tie_word_embeddings=False)


def build_model(config: Any, seed: int = 0):
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)


def receiver_model(config: Any, dtype: Any = None) -> Callable[[], Any]:
    """A picklable factory for the loopback receiver's model (different seed: all weights must come
    from the sync), in the wire ``dtype`` if given."""
    if dtype is not None:
        return functools.partial(_built_in, config, 1, dtype)
    return functools.partial(build_model, config, 1)


def _built_in(config: Any, seed: int, dtype: Any):
    return build_model(config, seed).to(dtype)
