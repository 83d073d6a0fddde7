"""``FSDPSource``: plain / FSDP2 / HSDP / FSDP+TP transformers models (and PEFT LoRA merged), one
gather per FSDP unit and mesh, checkpoint names from ``core.hf.naming``."""
