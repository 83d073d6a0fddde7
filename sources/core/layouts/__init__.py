"""Where values sit: Megatron's TP layout kinds versus Hugging Face tensors (``tp``: pure tensor
functions, one class per layout kind every family uses) and the pieces protocol (``pieces``: a
rank's boxes of the checkpoint tensors, what a stream transform reads where the shard lives).
May import ``core.ground`` only."""
