"""Hugging Face knowledge: checkpoint names of a (wrapped) module (``naming``), transformers' save-time
conversions (``conversions``), routed experts -- their checkpoint names and shapes, derived from
transformers (``expert_spec``), and their streaming in the two wire layouts vLLM loads (``experts``)
-- and tensors a vLLM loader writes into (``receiver_writes``). May import ``core.ground`` only."""
