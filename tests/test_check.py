"""Single-process checks of the pieces behind "what weightsync checks": the stream check's messages,
integrity checksums against bytes, and the transport preflight against vLLM's own objects in the
states that make a sync silently do nothing (a ``PyNcclCommunicator`` that disabled itself because its
NCCL library lacks symbols, exactly the too-old-NCCL path; an engine built by vLLM's own classes)."""

from __future__ import annotations

import hashlib
import socket
import threading
from functools import cached_property

import pytest
import torch
from vllm.distributed.weight_transfer.base import ParamMeta, Shard, WeightSource

from weightsync.sources import MetadataMismatchError, SilentTransportError, checked
from weightsync.sources.core.check.stream import check_stream, local_shape
from weightsync.sources.core.check.integrity import IntegrityError, checksum, compare_checksums


def _metas():
    return [
        ParamMeta("a.weight", torch.float32, (4, 3)),
        ParamMeta("b.weight", torch.bfloat16, (3,)),
        ParamMeta("c.weight", torch.float32, (3, 3)),
    ]


def _pairs():
    return [
        ("a.weight", torch.zeros(4, 3)),
        ("b.weight", torch.zeros(3, dtype=torch.bfloat16)),
        ("c.weight", torch.zeros(3, 3)),
    ]


@pytest.mark.parametrize(
    "mutate, needles",
    [
        (lambda p: [p[1], p[0], p[2]], ["index 0", "name/order", "'a.weight'", "'b.weight'"]),
        (lambda p: p + [("d.weight", torch.zeros(1))], ["more tensors", "'d.weight'", "(3)"]),
        (lambda p: [p[0], p[2]], ["index 1", "'b.weight'", "'c.weight'"]),
        (lambda p: p[:2], ["stopped after 2", "declares 3", "'c.weight'"]),
        (lambda p: [p[0], ("b.weight", p[1][1].float()), p[2]], ["index 1", "dtype", "bfloat16", "float32"]),
        (lambda p: [p[0], p[1], ("c.weight", torch.zeros(3, 4))], ["index 2", "shape", "(3, 3)", "(3, 4)"]),
    ],
    ids=["order", "extra", "missing", "stops-early", "dtype", "shape"],
)
def test_stream_check_names_rank_index_declared_and_actual(mutate, needles):
    with pytest.raises(MetadataMismatchError) as e:
        list(check_stream(mutate(_pairs()), _metas(), rank=3))
    msg = str(e.value)
    assert msg.startswith("rank 3:")
    for n in needles:
        assert n in msg, (n, msg)


def test_stream_check_requires_contiguity_only_where_the_engine_ships_the_tensor_as_is():
    """``iter_local`` pieces go to vLLM's ``nccl_m2n``, which sends them as they are: a strided view
    is refused there, naming it. Every ``iter_full`` consumer linearizes, so the same stream passes
    unchanged (the very tensor objects) under ``iter_full``."""
    pairs = [_pairs()[0], _pairs()[1], ("c.weight", torch.arange(9.0).reshape(3, 3).t())]
    with pytest.raises(MetadataMismatchError) as e:
        list(check_stream(iter(pairs), _metas(), rank=3, what="iter_local", local_shapes=[(4, 3), (3,), (3, 3)]))
    for needle in ("rank 3:", "iter_local", "non-contiguous", "index 2", "'c.weight'", "strides (1, 3)", "nccl_m2n"):
        assert needle in str(e.value), (needle, str(e.value))
    out = list(check_stream(iter(pairs), _metas(), rank=3))
    assert all(a is b for (_, a), (_, b) in zip(out, pairs)) and len(out) == 3


def test_checked_modulesource_with_a_non_contiguous_param_passes_vllms_nccl_engine(monkeypatch):
    """vLLM's own ``test_nccl_trainer_send_weights_broadcasts_contiguous``, through ``checked()``:
    a ``ModuleSource`` yielding a transposed (non-contiguous) parameter, the unpacked NCCL trainer
    engine with a mocked group; the engine broadcasts a contiguous copy with the view's values."""
    from unittest.mock import MagicMock

    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerWeightTransferEngine

    module = torch.nn.Module()
    view = torch.arange(6, dtype=torch.float32).reshape(2, 3).t()  # non-contiguous
    module.w = torch.nn.Parameter(view, requires_grad=False)
    assert not module.w.is_contiguous()
    source = checked(ModuleSource(module))
    engine = NCCLTrainerWeightTransferEngine(client=MagicMock(), source=source, packed=False)
    engine.model_update_group = MagicMock(rank=0)  # 0.34 sends from the group rank that is `src`
    monkeypatch.setattr(torch.cuda, "current_stream", MagicMock())

    engine.send_weights()

    sent = engine.model_update_group.broadcast.call_args.args[0]
    assert sent.is_contiguous() and torch.equal(sent, view)
    assert source.passes == 1


def test_stream_check_passes_tensors_through_unchanged():
    pairs = _pairs()
    out = list(check_stream(iter(pairs), _metas(), rank=0))
    assert [n for n, _ in out] == [n for n, _ in pairs]
    assert all(a is b for (_, a), (_, b) in zip(out, pairs))  # no copy, no cast


def test_local_shape_matches_torch_chunk_and_dtensor_semantics():
    m = ParamMeta("w", torch.float32, (10, 7), owners=(0, 1, 2, 3), mesh_shape=(2, 2),
                  placements=(Shard(0), Shard(1)))
    full = torch.empty(10, 7)
    for idx, r in enumerate(m.owners):
        i, j = divmod(idx, 2)
        expect = full.chunk(2, 0)[i].chunk(2, 1)[j].shape
        assert local_shape(m, r) == tuple(expect)


class _Tiny(WeightSource):
    def __init__(self, model):
        self.model = model

    @cached_property
    def metadata(self):
        return [ParamMeta(n, p.dtype, tuple(p.shape)) for n, p in self.model.named_parameters()]

    def iter_full(self):
        for n, p in self.model.named_parameters():
            yield n, p.detach()


def test_checked_single_process_records_checksums_equal_to_recomputed_bytes():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)).to(torch.bfloat16)
    src = checked(_Tiny(model), checksums=True)
    assert checked(src) is src
    names = [n for n, _ in src.iter_full()]
    assert names == [n for n, _ in model.named_parameters()]
    # oracle: the same function over an independent copy of the bytes (numpy round trip)
    for n, p in model.named_parameters():
        copy = torch.from_numpy(p.detach().view(torch.int16).numpy().copy()).view(torch.bfloat16)
        assert src.last_checksums[n] == checksum(copy)


def test_checksum_detects_garbage_zeros_and_a_flipped_bit_and_compare_names_the_param():
    t = torch.randn(64, 32, dtype=torch.bfloat16)
    flipped = t.clone()
    flipped.view(torch.int16)[5, 7] ^= 1
    assert checksum(t) == checksum(t.clone())
    assert checksum(t) != checksum(torch.zeros_like(t))
    assert checksum(t) != checksum(flipped)
    sent = {"x": checksum(t), "y": checksum(t[:2].contiguous())}
    with pytest.raises(IntegrityError, match=r"'x'.*sent checksum"):
        compare_checksums(sent, {"x": checksum(flipped), "y": sent["y"]}, rank=0)
    with pytest.raises(IntegrityError, match=r"no checksum for 'y'"):
        compare_checksums(sent, {"x": sent["x"]})
    with pytest.raises(IntegrityError, match=r"never sent, first 'z'"):
        compare_checksums(sent, {**sent, "z": "0"})
    compare_checksums(sent, dict(sent))


# ---- preflight against vLLM's own objects ---------------------------------------------------


def _vllm_disabled_communicators(library_path: str):
    """Two real ``PyNcclCommunicator``s (ranks 0, 1 of a StatelessProcessGroup) built with an NCCL
    library that lacks NCCL's symbols: vLLM's own code disables them (the too-old-NCCL path)."""
    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
    from vllm.distributed.utils import StatelessProcessGroup

    out = {}
    # rank 0's store listens on a socket bound to port 0 before rank 1 hears the port: no race
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]

    def make(r):
        pg = StatelessProcessGroup.create(
            host="127.0.0.1", port=port, rank=r, world_size=2, listen_socket=listener if r == 0 else None
        )
        out[r] = PyNcclCommunicator(pg, device="cpu", library_path=library_path)

    threads = [threading.Thread(target=make, args=(r,), daemon=True) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert set(out) == {0, 1}
    return out


class _Client:
    def init_weight_transfer_engine(self, init_info): ...
    def start_weight_update(self): ...
    def update_weights(self, update_info): ...
    def finish_weight_update(self, weight_version=None): ...


def _vllm_nccl_engine(comm, *, is_sender=True):
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerWeightTransferEngine

    model = torch.nn.Linear(2, 2)
    engine = NCCLTrainerWeightTransferEngine(
        client=_Client(), source=_Tiny(model), is_sender=is_sender, rank=0 if is_sender else 1
    )
    engine.model_update_group = comm
    return engine


def test_preflight_refuses_vllm_nccl_engine_whose_communicator_disabled_itself():
    from weightsync.plugins.sync import check_engine

    comms = _vllm_disabled_communicators("libc.so.6")
    assert comms[0].disabled and not comms[0].available  # vLLM's own verdict, not ours
    with pytest.raises(SilentTransportError) as e:
        check_engine(_vllm_nccl_engine(comms[0]), agree=False)
    msg = str(e.value)
    assert "rank 0" in msg and "disabled" in msg and "ncclCommSuspend" in msg
    assert "report success" in msg


def test_preflight_world_size_and_missing_communicator():
    from weightsync.plugins.sync import PreflightError, check_engine

    comm = _vllm_disabled_communicators("libc.so.6")[0]
    comm.available, comm.disabled = True, False  # as if NCCL had loaded: now sizes matter
    report = check_engine(_vllm_nccl_engine(comm), expected_world_size=2, agree=False)
    assert "nccl: world_size 2 matches the inference side" in report.checks
    with pytest.raises(PreflightError, match=r"world_size 2 but the inference side needs 5"):
        check_engine(_vllm_nccl_engine(comm), expected_world_size=5, agree=False)
    with pytest.raises(SilentTransportError, match=r"no communicator"):
        check_engine(_vllm_nccl_engine(None), agree=False)
    # a non-sender holds none by design and passes
    check_engine(_vllm_nccl_engine(None, is_sender=False), agree=False)


def test_preflight_ipc_needs_cuda_and_calls_engine_hooks():
    from weightsync.plugins.sync import PreflightError, check_engine

    class IPCTrainerWeightTransferEngine:  # vLLM's class cannot be built without CUDA
        is_sender = True
        source = _Tiny(torch.nn.Linear(2, 2))

    if not torch.cuda.is_available():
        with pytest.raises(PreflightError, match=r"rank 0: the IPC engine .* CUDA is not available"):
            check_engine(IPCTrainerWeightTransferEngine(), agree=False)

    calls = []

    class Hooked:
        is_sender = True

        def preflight(self):
            calls.append(1)
            raise SilentTransportError("loopback: receiver group not joined")

    with pytest.raises(SilentTransportError, match="receiver group not joined"):
        check_engine(Hooked(), agree=False)
    assert calls == [1]


def test_check_weights_changed_against_vllm_digest_format():
    from vllm.model_executor.model_loader.weight_checksum import compute_tensor_digests

    from weightsync.plugins.sync import check_weights_changed

    model = torch.nn.Linear(3, 2)
    before = compute_tensor_digests(model)  # what POST /weight_checker {"action":"checksum"} serves
    with pytest.raises(SilentTransportError, match="none of the 2 checksums changed"):
        check_weights_changed(before, compute_tensor_digests(model))
    with torch.no_grad():
        model.weight.add_(1)
    assert check_weights_changed(before, compute_tensor_digests(model)) == ["weight"]
    assert before["bias"] == hashlib.sha256(model.bias.detach().numpy().tobytes()).hexdigest()


class _Listed(WeightSource):
    """Yields a fixed list of pairs against ``_metas()``; ``checks_stream`` as given."""

    def __init__(self, pairs, checks_stream: bool) -> None:
        self._pairs, self.checks_stream, self.passes = pairs, checks_stream, 0

    @cached_property
    def metadata(self):
        return _metas()

    def iter_full(self):
        self.passes += 1
        yield from self._pairs


def test_checked_trusts_only_a_source_that_checks_its_own_stream():
    bad = [_pairs()[1], _pairs()[0], _pairs()[2]]  # out of order
    # a plain source's bad stream is caught by the wrapper, naming the index and both names
    with pytest.raises(MetadataMismatchError, match=r"index 0 .*name/order"):
        list(checked(_Listed(bad, checks_stream=False)).iter_full())
    # a source that declares it checks its stream itself is not checked twice (it would raise itself;
    # here it lies, which is how the skip is observable), and its good stream passes unchanged
    assert [n for n, _ in checked(_Listed(bad, checks_stream=True)).iter_full()] == ["b.weight", "a.weight", "c.weight"]
    good = _pairs()
    out = list(checked(_Listed(good, checks_stream=True)).iter_full())
    assert [(n, t.data_ptr()) for n, t in out] == [(n, t.data_ptr()) for n, t in good]


def test_a_transform_that_declares_nothing_is_checked_whatever_it_wraps():
    """Capabilities are what a source declares itself (``core/protocols.py``), never what a wrapper's
    ``__getattr__`` forwards: a new transform over a source that checks its own stream -- and that
    does not say whether it checks the stream it yields -- gets the wrapper's check. With forwarding it
    inherited ``checks_stream=True`` and its reordered stream went through unchecked."""
    from weightsync.sources.toolkit import checks_stream, is_round_source, senders_of

    class Reorders(WeightSource):
        """A stream transform that forwards unknown attributes and yields its source's pairs reversed."""

        def __init__(self, source) -> None:
            self.source = source

        @cached_property
        def metadata(self):
            return self.source.metadata

        def iter_full(self):
            yield from reversed(list(self.source.iter_full()))

        def __getattr__(self, name):
            if name == "source":
                raise AttributeError(name)
            return getattr(self.source, name)

    inner = _Listed(_pairs(), checks_stream=True)
    inner.senders = "owners"
    inner.iter_patches = inner.iter_deltas = inner.reset = lambda *a, **k: None
    t = Reorders(inner)
    assert t.checks_stream is True and t.senders == "owners"  # what forwarding answers
    assert checks_stream(t) is False and senders_of(t) == "rank0" and not is_round_source(t)
    assert checks_stream(inner) and senders_of(inner) == "owners" and is_round_source(inner)
    with pytest.raises(MetadataMismatchError, match=r"index 0 .*name/order"):
        list(checked(t).iter_full())


def test_the_nccl_report_names_the_library_file_and_the_symbols_it_lacks(monkeypatch):
    """Why vLLM disabled its communicator, as every rank's error says it (``nccl_library_report``): the
    name vLLM loads (``VLLM_NCCL_SO_PATH``), the file it resolves to, and each symbol vLLM's wrapper binds
    that the library lacks -- here a library that is no NCCL at all (libm)."""
    import ctypes.util

    from vllm.distributed.device_communicators.pynccl_wrapper import NCCLLibrary

    from weightsync.plugins.sync.preflight import nccl_library_report

    libm = ctypes.util.find_library("m") or "libm.so.6"
    monkeypatch.setenv("VLLM_NCCL_SO_PATH", libm)  # vllm.envs reads the environment on each access
    msg = nccl_library_report()
    assert f"{libm!r} (/" in msg and "libm" in msg.split("(", 1)[1], msg  # the file it resolved to
    for f in NCCLLibrary.exported_functions:
        assert f.name in msg, (f.name, msg)  # every symbol vLLM binds is missing from libm
    assert "ncclCommSuspend" in msg and "VLLM_NCCL_SO_PATH" in msg
