"""Hugging Face knowledge: checkpoint names of a (wrapped) module (``naming``), transformers' save-time
conversions (``conversions``), routed-expert layouts (``experts``), tensors a vLLM loader writes into
(``receiver_writes``). May import ``core.ground`` only."""
