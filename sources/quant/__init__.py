"""Quantized streams: ``FP8Source`` wraps any ``WeightSource`` and sends block-FP8 weights with their
``weight_scale_inv``, in the format vLLM loads for an FP8 checkpoint (``config``: which tensors,
which block, which scale format; ``fp8``: the numerics, bitwise vLLM's or transformers' quantizer;
``fp8_triton``: the same numerics as CUDA kernels; ``source``: the stream transform).
A stream transform over any source: may import ``core`` and ``checkpoint.format`` (an FP8 checkpoint's
config), never a source package."""
