"""A Megatron-core training loop with ``MegatronWeightSync`` called right after the optimizer step.

GPU (TP x PP [x VPP] as you train; vLLM over NCCL)::

    VLLM_SERVER_DEV_MODE=1 vllm serve <hf model> --weight-transfer-config '{"backend": "nccl"}' &
    torchrun --nproc-per-node 8 examples/megatron_loop.py --tp 2 --pp 2 --vpp 2 \
        --vllm-url http://127.0.0.1:8000 --master-address <this host's IP>

CPU (loopback receiver)::

    torchrun --nproc-per-node 2 examples/megatron_loop.py --pp 2 --vpp 2 --steps 3

megatron-core's GPTModel builds on CPU but does not run forward there, so on CPU the "optimizer
step" is a small in-place parameter update (what the hook sees is the same: new weights after
``optimizer.step()``); on GPU it is a real forward/backward/step.

The layout is checked first, on the command line and torchrun's ``WORLD_SIZE`` alone: a world size
that ``--tp x --pp`` does not divide, or layers / heads the parallel sizes do not divide, end in one
line and exit code 2 before torch is imported, a process group formed or a receiver started.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from common import add_args

#: The example's model (``tiny_llama_config`` with ``LAYERS`` layers): what the layout must divide.
LAYERS, HEADS, KV_HEADS = 4, 4, 2


def layout_problem(tp: int, pp: int, vpp: int | None, world: int) -> str | None:
    """What megatron-core would refuse about this layout (after ~40 s of imports, model builds and a
    traceback per rank), said up front; None when it fits."""
    for flag, value in (("--tp", tp), ("--pp", pp), ("--vpp", vpp)):
        if value is not None and value < 1:
            return f"{flag} {value}: must be >= 1"
    if world % (tp * pp):
        return (f"--tp {tp} x --pp {pp} = {tp * pp} ranks per model replica does not divide the world size "
                f"{world} (torchrun --nproc-per-node): use a multiple of {tp * pp} ranks, or smaller --tp / --pp")
    if HEADS % tp or KV_HEADS % tp:
        return f"--tp {tp} does not divide the model's {HEADS} attention heads / {KV_HEADS} KV heads"
    chunks = pp * (vpp or 1)
    if LAYERS % chunks:
        return (f"--pp {pp}" + (f" x --vpp {vpp}" if vpp else "") + f" = {chunks} model chunks do not divide "
                f"the model's {LAYERS} layers")
    return None


def build_chunks(hf, tp: int, pp: int, vpp: int | None):
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    ps.initialize_model_parallel(tp, pp, virtual_pipeline_model_parallel_size=vpp)
    cfg = TransformerConfig(
        num_layers=hf.num_hidden_layers, hidden_size=hf.hidden_size, num_attention_heads=hf.num_attention_heads,
        num_query_groups=hf.num_key_value_heads, ffn_hidden_size=hf.intermediate_size, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, normalization="RMSNorm", layernorm_epsilon=hf.rms_norm_eps,
        add_bias_linear=False, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp, use_cpu_initialization=not torch.cuda.is_available(),
        params_dtype=torch.float32, pipeline_dtype=torch.float32,
    )
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    chunks = []
    for v in range(vpp or 1):
        vp = v if vpp else None
        chunks.append(GPTModel(
            cfg, spec, vocab_size=hf.vocab_size, max_sequence_length=hf.max_position_embeddings,
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
            share_embeddings_and_output_weights=False, position_embedding_type="rope",
            rotary_base=int(hf.rope_parameters["rope_theta"]) if getattr(hf, "rope_parameters", None) else 10000,
            vp_stage=vp,
        ))
    return chunks


def main() -> None:
    p = add_args(argparse.ArgumentParser(description=__doc__))
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--vpp", type=int, default=None)
    args = p.parse_args()
    problem = layout_problem(args.tp, args.pp, args.vpp, int(os.environ.get("WORLD_SIZE", "1")))
    if problem:
        if os.environ.get("RANK", "0") == "0":  # one line, not one per rank
            print(f"megatron_loop.py: {problem}", file=sys.stderr)
        sys.exit(2)

    import torch

    from common import SYNC_TIMEOUT_S, Target, init_process_group, receiver_model, tiny_llama_config
    from weightsync.plugins.hooks.megatron import MegatronWeightSync
    from weightsync.sources import configure_logging

    configure_logging(logging.INFO)
    rank, _ = init_process_group()
    hf = tiny_llama_config()
    hf.num_hidden_layers = LAYERS
    assert (hf.num_attention_heads, hf.num_key_value_heads) == (HEADS, KV_HEADS)
    target = Target(args, rank, receiver_model(hf))
    try:
        model = build_chunks(hf, args.tp, args.pp, args.vpp)  # this rank's VPP chunk list
        optim = torch.optim.SGD([p for m in model for p in m.parameters()], lr=1e-2)
        hook = MegatronWeightSync(model, target.init_info, target.client, hf_config=hf, every=args.every,
                                  pause="abort", timeout_s=SYNC_TIMEOUT_S)
        hook.sync_now(0)  # cold sync
        for iteration in range(1, args.steps + 1):
            for m in model:  # stand-in for forward_backward_func on CPU: a gradient to step on
                for prm in m.parameters():
                    prm.grad = torch.randn_like(prm) * 0.1
            optim.step()
            optim.zero_grad()
            hook(iteration, update_successful=True)  # every rank, right after the step (report logged)
        hook.shutdown()
        if rank == 0:
            print(f"vLLM weight_version: {target.client.weight_info()}")
    finally:
        target.close()


if __name__ == "__main__":
    main()
