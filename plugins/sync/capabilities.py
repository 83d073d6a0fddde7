"""What ``WeightSync`` asks of a trainer engine beyond vLLM's ``TrainerWeightTransferEngine``: every
capability flag and optional hook the driver reads, declared here and read only through the
accessors below.

vLLM's trainer engines share one interface (``trainer_init``, ``send_weights``, ``shutdown``) but not
one behaviour: some send sparse patches, some cannot retarget to a draft model, some leave their
non-senders blocked in engine collectives. The driver must know which, before the first byte, to
pick a send phase and to know whether a failed sender may finish a pass alone. vLLM's own engines are
known by their ``backend`` name (the ``*_BACKENDS`` sets); any other engine declares itself with the
flags below -- class attributes, so they hold before an engine is built and cost nothing to read.

Flags on the **init info class** (read before ``trainer_init``):

* ``weightsync_sparse`` (``SPARSE``): the engine sends patches, not dense tensors: ``WeightSync``
  feeds it delta rounds (a ``DeltaSource``) and passes the ``DeltaSource`` as its ``source`` (vLLM's
  ``sparse_nccl`` takes none). Set by ``LoopbackSparseTrainerInitInfo``.
* ``weightsync_whole_patches`` (``WHOLE_PATCHES``): the engine takes a whole tensor as a patch
  (``indices=None``), so a round is ``iter_deltas(whole_when_cheaper=True)`` instead of
  ``iter_patches()``. Set by ``LoopbackSparseTrainerInitInfo``.
* ``weightsync_draftless`` (``DRAFTLESS``): the engine cannot update a draft model (vLLM's
  ``supports_draft_weight_update = False``): ``WeightSync(draft=...)`` refuses it.

Flag on the **engine** (class or instance attribute, read after ``trainer_init``):

* ``weightsync_finishable_pass`` (``FINISHABLE_PASS``): non-senders do nothing in ``send_weights``
  but iterate the source, and the sender lets a failure propagate out of it, so a sender whose
  consumer failed mid-pass may finish the pass alone (its peers are blocked in the source's gathers,
  not in engine collectives). Declared ``False`` it overrides ``FINISHABLE_PASS_BACKENDS``.

Optional **round hooks** of a sparse engine (``RoundHooks``), called on every rank:
``start_round()`` before a delta round's first chunk, ``verify_round()`` after its last chunk and
before the commit (a collective: the sparse loopback compares the receiver with a dense pass).

Who sets a flag: the engine's author, as a ``ClassVar`` (or with ``declare``). Who reads one: the
driver, through ``is_sparse_backend``, ``declares_sparse``, ``takes_whole_patches``, ``is_draftless``,
``finishable_pass``, ``start_round`` and ``verify_round``; nothing else probes these names.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeVar, runtime_checkable

__all__ = [
    "SPARSE",
    "WHOLE_PATCHES",
    "DRAFTLESS",
    "FINISHABLE_PASS",
    "FINISHABLE_PASS_BACKENDS",
    "DRAFTLESS_BACKENDS",
    "SPARSE_BACKENDS",
    "RoundHooks",
    "declare",
    "is_sparse_backend",
    "declares_sparse",
    "takes_whole_patches",
    "is_draftless",
    "finishable_pass",
    "start_round",
    "verify_round",
    "blocking_turns",
    "BLOCKING_TURN_BACKENDS",
]

#: init info flag: the engine sends sparse patches (delta rounds).
SPARSE = "weightsync_sparse"
#: init info flag: the engine takes whole-tensor patches (``indices=None``).
WHOLE_PATCHES = "weightsync_whole_patches"
#: init info flag: the engine cannot update a draft model.
DRAFTLESS = "weightsync_draftless"
#: engine flag: a failed sender may finish the source's pass alone.
FINISHABLE_PASS = "weightsync_finishable_pass"

#: vLLM's backends that send sparse patches.
SPARSE_BACKENDS = frozenset({"sparse_nccl"})
#: vLLM's backends whose non-sender ranks do nothing during ``send_weights`` but iterate the source,
#: and whose sender lets a failure propagate out of ``send_weights``. vLLM's IPC engine is not one:
#: its ranks meet in per-chunk handle all-gathers and barriers.
FINISHABLE_PASS_BACKENDS = frozenset({"nccl"})
#: vLLM's backends whose workers wait inside a device collective for every tensor the update info
#: declared (NCCL has no timeout): a broadcaster that stops early leaves them blocked for good, so its
#: turn is completed with zeros (``dense_pass``). IPC is not one: its worker only opens handles.
BLOCKING_TURN_BACKENDS = frozenset({"nccl"})
#: vLLM's backends whose worker engine declares ``supports_draft_weight_update = False`` (vLLM 0.33
#: and 0.34: ``nccl_m2n``, ``sharded_rdt``; 0.34: ``sparse_nccl``).
DRAFTLESS_BACKENDS = frozenset({"sparse_nccl", "nccl_m2n", "sharded_rdt"})

_FLAGS = {"sparse": SPARSE, "whole_patches": WHOLE_PATCHES, "draftless": DRAFTLESS,
          "finishable_pass": FINISHABLE_PASS}

T = TypeVar("T", bound=type)


@runtime_checkable
class RoundHooks(Protocol):
    """The optional hooks of a sparse engine; an engine may have either, both or neither."""

    def start_round(self) -> None:
        """Every rank, before a delta round's first chunk (e.g. reset per-round counters)."""

    def verify_round(self) -> None:
        """Every rank (a collective), after a round's last chunk and before the commit; raises if
        the receiver does not hold what the round should have given it."""


def declare(**flags: bool) -> Callable[[T], T]:
    """Class decorator: set capability flags by their keyword (``sparse``, ``whole_patches``,
    ``draftless``, ``finishable_pass``) as class attributes under the names this module declares."""
    unknown = sorted(set(flags) - set(_FLAGS))
    if unknown:
        raise TypeError(f"capabilities.declare: unknown flag(s) {unknown}; known: {sorted(_FLAGS)}")

    def apply(cls: T) -> T:
        for key, value in flags.items():
            setattr(cls, _FLAGS[key], bool(value))
        return cls

    return apply


def _class_flag(init_info: Any, name: str) -> bool:
    return bool(getattr(type(init_info), name, False))


def is_sparse_backend(init_info: Any) -> bool:
    """Whether ``init_info``'s engine sends patches (vLLM ``sparse_nccl``, or an init info class
    declaring ``weightsync_sparse``, as ``LoopbackSparseTrainerInitInfo`` does)."""
    return getattr(init_info, "backend", None) in SPARSE_BACKENDS or _class_flag(init_info, SPARSE)


def declares_sparse(init_info: Any) -> bool:
    """Whether ``init_info``'s class itself declares ``weightsync_sparse`` (an engine of ours, which
    takes the ``DeltaSource`` as its source; vLLM's ``sparse_nccl`` refuses any source)."""
    return _class_flag(init_info, SPARSE)


def takes_whole_patches(init_info: Any) -> bool:
    """Whether ``init_info``'s engine takes whole-tensor patches (``weightsync_whole_patches``)."""
    return _class_flag(init_info, WHOLE_PATCHES)


def is_draftless(init_info: Any) -> bool:
    """Whether ``init_info``'s engine cannot update a draft model (``DRAFTLESS_BACKENDS`` or
    ``weightsync_draftless``)."""
    return getattr(init_info, "backend", None) in DRAFTLESS_BACKENDS or _class_flag(init_info, DRAFTLESS)


def finishable_pass(engine: Any, backend: str) -> bool:
    """Whether a sender of ``engine`` whose consumer failed may finish the source's pass alone: the
    engine's ``weightsync_finishable_pass`` if it has one, else ``backend in FINISHABLE_PASS_BACKENDS``."""
    return bool(getattr(engine, FINISHABLE_PASS, backend in FINISHABLE_PASS_BACKENDS))


def blocking_turns(backend: str) -> bool:
    """Whether a broadcaster of ``backend`` must always send every tensor it declared
    (``BLOCKING_TURN_BACKENDS``)."""
    return backend in BLOCKING_TURN_BACKENDS


def start_round(engine: Any) -> None:
    """Call the engine's ``start_round()`` if it has one (``RoundHooks``)."""
    hook = getattr(engine, "start_round", None)
    if callable(hook):
        hook()


def verify_round(engine: Any) -> None:
    """Call the engine's ``verify_round()`` if it has one (``RoundHooks``)."""
    hook = getattr(engine, "verify_round", None)
    if callable(hook):
        hook()
