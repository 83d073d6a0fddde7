"""Scaffolding for the demo, the CLI, the tests and the benchmarks -- not for a training job.

* ``presets``        -- the tiny models (and configs) the CLI and demo build, and ``UserError``;
* ``megatron/``      -- building a megatron-core ``GPTModel`` on CPU from a Hugging Face config and
  loading Hugging Face weights into it (the CLI's ``--layout megatron``, the Megatron tests and
  benches), one job per module: config mapping, CPU-construction patches, substitute modules, layer
  specs, the build, the weight loading;
* ``vllm_server``    -- a real vLLM server started for the demo and the tests (``demo --server vllm``);
* ``fp8_model``      -- a model holding an FP8 checkpoint's tensors, for FP8 demo syncs.

The bottom layer of ``weightsync.plugins``: imports ``weightsync.sources`` (public names and
``toolkit``) only, plus the libraries it drives (transformers, megatron-core, vLLM's server process),
each imported where it is used; every other plugins package may import it, and in practice only
``cli`` and ``planner`` (the presets) do.
"""
