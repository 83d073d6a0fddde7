"""Where values sit: Megatron's TP layout kinds versus Hugging Face tensors (``tp``: one class per
layout kind every family uses), the row arithmetic they stand on (``rows``: pure functions -- TP
row chunks, fused splits, the vocabulary's padding) and the pieces protocol (``pieces``: a rank's
boxes of the checkpoint tensors, what a stream transform reads where the shard lives).
May import ``core.ground`` only."""
