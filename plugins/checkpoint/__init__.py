"""The checkpoint writer: ``save_safetensors(source, path)`` writes a Hugging Face safetensors folder
straight from any ``WeightSource``, the files ``save_pretrained`` writes, all or nothing.

* ``writer`` -- ``save_safetensors``: the collective pass, the writer rank, the cross-rank outcome;
* ``plan`` -- every file, header and byte offset, planned from the metadata before any byte moves;
  the one safetensors header serialiser (``serialise_header``);
* ``files`` -- the staging folder renamed into place at the end (``StagedFolder``, ``replace_folder``);
* ``queue`` -- the writer thread: host copies and ``pwrite`` overlap the source's next gathers;
* ``delta`` -- ``save_delta`` / ``apply_delta``: one ``DeltaSource`` round as a sparse patch file, and a
  chain of them applied to a folder (it becomes the folder ``save_safetensors`` would write now).

May import: ``weightsync.sources`` (public names and ``toolkit``: the failure board, bounded waits,
``multi_rank``, the safetensors format), vLLM's ``WeightSource`` / ``ParamMeta`` types, transformers
(the save layout), and the plugins' layers below it (``sync | lora_adapter``, ``testbed``) -- in
practice none of them; never ``cli`` above it, nor ``hooks``, ``loopback``, ``planner`` beside it.
"""

from __future__ import annotations

from .delta import VERSION_KEY, DeltaFileReport, apply_delta, read_delta_header, save_delta
from .writer import DEFAULT_MAX_SHARD_BYTES, DEFAULT_WRITE_QUEUE_BYTES, SaveReport, save_safetensors

__all__ = [
    "DEFAULT_MAX_SHARD_BYTES",
    "DEFAULT_WRITE_QUEUE_BYTES",
    "SaveReport",
    "save_safetensors",
    "VERSION_KEY",
    "DeltaFileReport",
    "save_delta",
    "apply_delta",
    "read_delta_header",
]
