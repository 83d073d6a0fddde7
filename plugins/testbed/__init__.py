"""Scaffolding for the demo, the CLI, the tests and the benchmarks -- not for a training job.

* ``presets``        -- the tiny models (and configs) the CLI and demo build, and ``UserError``;
* ``megatron/``      -- building a megatron-core ``GPTModel`` on CPU from a Hugging Face config and
  loading Hugging Face weights into it (the CLI's ``--layout megatron``, the Megatron tests);
* ``vllm_server``    -- a real vLLM server started for the demo and the tests (``demo --server vllm``);
* ``fp8_model``      -- a model holding an FP8 checkpoint's tensors, for FP8 demo syncs.

The bottom layer of ``weightsync.plugins``: imports ``weightsync.sources`` (public names and
``toolkit``) only.
"""
