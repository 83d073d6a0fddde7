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
"""

from __future__ import annotations

import argparse
import logging

import torch

from common import Target, add_args, init_process_group, receiver_model, tiny_llama_config
from weightsync.plugins.hooks.megatron import MegatronWeightSync
from weightsync.sources import configure_logging


def build_chunks(hf, tp: int, pp: int, vpp: int | None):
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
    configure_logging(logging.INFO)
    rank, _ = init_process_group()
    hf = tiny_llama_config()
    hf.num_hidden_layers = 4
    target = Target(args, rank, receiver_model(hf))
    try:
        model = build_chunks(hf, args.tp, args.pp, args.vpp)  # this rank's VPP chunk list
        optim = torch.optim.SGD([p for m in model for p in m.parameters()], lr=1e-2)
        hook = MegatronWeightSync(model, target.init_info, target.client, hf_config=hf, every=args.every,
                                  pause="abort")
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
