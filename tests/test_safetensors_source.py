"""``SafetensorsSource`` on 2 gloo ranks: checkpoint folders written by transformers' ``save_pretrained``
(one file, and sharded with a small ``max_shard_size``) of the tiny presets, plus corrupted copies.

Oracles nobody here wrote:
* safetensors' own ``safe_open``: names, dtypes, shapes, the on-disk order (``offset_keys``) and
  the bytes of every tensor;
* transformers' ``from_pretrained(path)``: the loopback receiver's parameters (vLLM's own
  ``compute_tensor_digests`` on both sides) and logits after a 2-rank sync;
* vLLM's NCCL trainer engine: the sender's ``_checked_iter`` and a real non-sender engine;
* the kernel's page cache (``mincore``): a data page nobody read, through ``read()`` or ``mmap``,
  is not resident, so "metadata reads no tensor data" is observed, not assumed. The positive
  control (after a pass every page is resident) shows the measurement can fail.

One world runs every check (starting one costs seconds); the parent asserts.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import mmap
import os
import shutil
import struct
from typing import Any

import pytest
import torch

from fsdp_worlds import Untouchable, drive_vllm_nccl, pack, unpack
from worlds import CONTEXT, errors_of, run_world

from weightsync.plugins.loopback.receiver import ReceiverClient, start_receiver_process
from weightsync.plugins.testbed.presets import build_model, load_config

pytestmark = pytest.mark.slow

BIG = 16 * 1024 * 1024 * 4  # bytes of the sparse checkpoint's big tensor (64 MiB, never written)
IDS = [[3, 17, 101, 5, 250, 42, 7, 9], [1, 2, 3, 4, 5, 6, 7, 8]]


# ---- folders (parent) -------------------------------------------------------------------------


def _save(model: torch.nn.Module, folder: str, **kw: Any) -> str:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model.save_pretrained(folder, **kw)
    return folder


def _header(path: str) -> tuple[dict, bytes]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        return header, f.read()


def _write(path: str, header: dict | str, data: bytes) -> None:
    raw = (header if isinstance(header, str) else json.dumps(header)).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + data)


def _copy(src: str, dst: str) -> str:
    shutil.copytree(src, dst)
    return dst


def _shards(folder: str) -> list[str]:
    """The checkpoint's files as the index (or the single file) names them, by file name."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if not os.path.exists(index):
        return [os.path.join(folder, "model.safetensors")]
    with open(index) as f:
        return [os.path.join(folder, n) for n in sorted(set(json.load(f)["weight_map"].values()))]


def _edit_index(folder: str, fn) -> None:
    path = os.path.join(folder, "model.safetensors.index.json")
    with open(path) as f:
        index = json.load(f)
    fn(index)
    with open(path, "w") as f:
        json.dump(index, f)


def _sparse(folder: str) -> str:
    """A checkpoint whose 64 MiB data region is a hole (never written, so never in the page cache),
    and whose offset order (z_big, then a_small) is not its name order."""
    os.makedirs(folder)
    header = {
        "a_small": {"dtype": "F32", "shape": [4], "data_offsets": [BIG, BIG + 16]},
        "z_big": {"dtype": "F32", "shape": [16, 1024 * 1024], "data_offsets": [0, BIG]},
    }
    path = os.path.join(folder, "model.safetensors")
    _write(path, header, b"")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) + BIG + 16)
    return folder


def _bad_folders(root: str, good: dict[str, str]) -> dict[str, tuple[str, list[str]]]:
    """Corrupted checkpoints: ``{case: (folder, words its error must contain on every rank)}``."""
    from safetensors.torch import save_file

    bad: dict[str, tuple[str, list[str]]] = {}
    sharded, single = good["sharded"], good["single"]
    shards = _shards(sharded)
    bad["missing"] = (os.path.join(root, "no-such-folder"), ["no-such-folder", "no such checkpoint folder"])
    os.makedirs(os.path.join(root, "empty"))
    bad["empty"] = (os.path.join(root, "empty"), ["empty", "is empty"])

    # Truncated: the last shard lost 100 bytes; its last tensor (by offset) no longer fits.
    d = _copy(sharded, os.path.join(root, "truncated"))
    last = _shards(d)[-1]
    header, _ = _header(last)
    tail = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][1])
    with open(last, "r+b") as f:
        f.truncate(os.path.getsize(last) - 100)
    bad["truncated"] = (d, [os.path.basename(last), tail, "truncated"])

    # Over-long: bytes after the last tensor (safetensors refuses the file).
    d = _copy(single, os.path.join(root, "trailing"))
    with open(os.path.join(d, "model.safetensors"), "ab") as f:
        f.write(b"\0" * 16)
    bad["trailing"] = (d, ["model.safetensors", "bytes after the last tensor"])

    # The index maps a tensor to shard 1 whose header does not have it (it lives in shard 2).
    d = _copy(sharded, os.path.join(root, "index-wrong-file"))
    h2, _ = _header(shards[1])
    moved = sorted(k for k in h2 if k != "__metadata__")[0]
    _edit_index(d, lambda ix: ix["weight_map"].__setitem__(moved, os.path.basename(shards[0])))
    bad["index_wrong_file"] = (d, [moved, os.path.basename(shards[0]), "has no such tensor",
                                   os.path.basename(shards[1])])

    # A tensor in a shard's header that the index does not list.
    d = _copy(sharded, os.path.join(root, "not-in-index"))
    _edit_index(d, lambda ix: ix["weight_map"].pop(moved))
    bad["not_in_index"] = (d, [moved, os.path.basename(shards[1]), "missing from the index"])

    # The index names a shard that is not there.
    d = _copy(sharded, os.path.join(root, "shard-gone"))
    os.remove(os.path.join(d, os.path.basename(shards[1])))
    bad["shard_gone"] = (d, [os.path.basename(shards[1]), moved, "does not exist"])

    # A dtype torch cannot hold (safetensors' 6-bit float).
    d = _copy(single, os.path.join(root, "dtype"))
    path = os.path.join(d, "model.safetensors")
    header, data = _header(path)
    victim = "model.norm.weight"
    header[victim]["dtype"] = "F6_E2M3"
    _write(path, header, data)
    bad["dtype"] = (d, [victim, "unsupported dtype 'F6_E2M3'", "model.safetensors"])

    # The same name twice in one header (plain JSON would silently keep the last).
    d = _copy(single, os.path.join(root, "dup-header"))
    path = os.path.join(d, "model.safetensors")
    header, data = _header(path)
    entry = json.dumps(header[victim])
    raw = json.dumps(header)[:-1] + f', "{victim}": {entry}}}'
    _write(path, raw, data)
    bad["dup_header"] = (d, [victim, "appears twice", "model.safetensors"])

    # Two tensors claim the same bytes.
    d = _copy(single, os.path.join(root, "overlap"))
    path = os.path.join(d, "model.safetensors")
    header, data = _header(path)
    a, b = "model.layers.0.input_layernorm.weight", "model.layers.0.post_attention_layernorm.weight"
    header[b]["data_offsets"] = header[a]["data_offsets"]
    _write(path, header, data)
    bad["overlap"] = (d, [a, b, "overlap"])

    # One name in two shards.
    d = os.path.join(root, "dup-shards")
    os.makedirs(d)
    save_file({"x": torch.ones(2)}, os.path.join(d, "model-00001-of-00002.safetensors"))
    save_file({"x": torch.ones(2), "y": torch.ones(2)}, os.path.join(d, "model-00002-of-00002.safetensors"))
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": 24}, "weight_map": {"x": "model-00001-of-00002.safetensors",
                                                                 "y": "model-00002-of-00002.safetensors"}}, f)
    bad["dup_shards"] = (d, ["'x'", "model-00002-of-00002.safetensors", "duplicate name across shards"])

    # Both layouts at once: which one is the checkpoint is ambiguous.
    d = _copy(single, os.path.join(root, "both"))
    shutil.copy(os.path.join(sharded, "model.safetensors.index.json"), d)
    bad["both"] = (d, ["model.safetensors and model.safetensors.index.json"])

    # Not a checkpoint: only an adapter file.
    d = os.path.join(root, "adapter-only")
    os.makedirs(d)
    save_file({"w": torch.ones(1)}, os.path.join(d, "adapter_model.safetensors"))
    bad["neither"] = (d, ["adapter_model.safetensors", "neither model.safetensors"])

    # Not JSON after the length field.
    d = os.path.join(root, "garbage")
    os.makedirs(d)
    with open(os.path.join(d, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", 8) + b"\xff" * 8)
    bad["garbage"] = (d, ["model.safetensors", "not JSON"])
    return bad


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Any]:
    root = str(tmp_path_factory.mktemp("ckpt"))
    good = {
        "single": _save(build_model(load_config("tiny-llama"), seed=0), os.path.join(root, "single")),
        "sharded": _save(build_model(load_config("tiny-qwen3"), seed=0), os.path.join(root, "sharded"),
                         max_shard_size="100KB"),
        "moe": _save(build_model(load_config("tiny-qwen3-moe"), seed=0), os.path.join(root, "moe"),
                     max_shard_size="200KB"),
    }
    # The index's total_size is informational (hub checkpoints get it wrong): off by 4, still loads.
    good["total_size_off"] = _copy(good["sharded"], os.path.join(root, "total-size-off"))
    _edit_index(good["total_size_off"], lambda ix: ix["metadata"].__setitem__("total_size", 4))
    return {"good": good, "bad": _bad_folders(root, good), "sparse": _sparse(os.path.join(root, "sparse"))}


def _receiver_model() -> torch.nn.Module:
    return build_model(load_config("tiny-qwen3"), seed=1)  # not the checkpoint's seed-0 weights


@pytest.fixture(scope="module")
def world(folders) -> dict[str, Any]:
    client, handle = start_receiver_process(functools.partial(_receiver_model), mp_context=CONTEXT)
    with handle:
        before, _ = client.logits(IDS)
        res = unpack(run_world(_world, 2, timeout=400, folders=folders, url=handle.url, port=0))
        after, after_sha = client.logits(IDS)
        digests = client.weight_digests()
        calls = client.calls()
    return {"ranks": res, "before": before, "after": after, "after_sha": after_sha,
            "digests": digests, "calls": calls}


# ---- the world ---------------------------------------------------------------------------------


def _digest(t: torch.Tensor) -> str:
    raw = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode() + raw).hexdigest()


def _resident(path: str, begin: int, end: int) -> float:
    """Fraction of the pages of ``path``'s bytes [begin, end) in the page cache (``mincore`` on a
    fresh mapping, which itself faults nothing in)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    start = begin // mmap.PAGESIZE * mmap.PAGESIZE
    length = end - start
    pages = -(-length // mmap.PAGESIZE)
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, start)
        if addr is None or addr == ctypes.c_void_p(-1).value:
            raise OSError(ctypes.get_errno(), "mmap")
        vec = ctypes.create_string_buffer(pages)
        rc = libc.mincore(ctypes.c_void_p(addr), length, vec)
        libc.munmap(ctypes.c_void_p(addr), length)
        if rc != 0:
            raise OSError(ctypes.get_errno(), "mincore")
    finally:
        os.close(fd)
    return sum(b & 1 for b in vec.raw) / pages


def _meta(src) -> list[tuple]:
    return [(m.name, str(m.dtype), tuple(m.shape), m.owners) for m in src.metadata]


def _world(rank: int, world_size: int, *, folders: dict, url: str, port: int) -> bytes:
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from weightsync.plugins.loopback import LoopbackTrainerInitInfo
    from weightsync.sources import SafetensorsSource, checked

    good, bad = folders["good"], folders["bad"]
    facts: dict[str, Any] = {}

    # 1) metadata without reading data: the sparse checkpoint's data pages stay out of the page
    #    cache through both ranks' construction; one pass brings them all in (the control).
    sparse_file = os.path.join(folders["sparse"], "model.safetensors")
    with open(sparse_file, "rb") as f:
        data_start = 8 + struct.unpack("<Q", f.read(8))[0]
    window = (data_start, data_start + BIG)
    src = SafetensorsSource(folders["sparse"])
    facts["sparse_meta"] = _meta(src)
    if rank == 0:
        facts["resident_after_metadata"] = _resident(sparse_file, *window)
    got = [(n, tuple(t.shape), float(t.abs().sum())) for n, t in src.iter_full()]
    facts["sparse_stream"] = got
    if rank == 0:
        facts["resident_after_pass"] = _resident(sparse_file, *window)

    # 2) the good folders: metadata on every rank, the stream on rank 0 (bytes as digests), bf16.
    for key, folder in good.items():
        f: dict[str, Any] = {}
        src = SafetensorsSource(folder)
        f["meta"] = _meta(src)
        f["stream"] = [(n, _digest(t)) for n, t in src.iter_full()]
        f["stats"] = src.last_pass.as_dict()
        f["second_pass_equal"] = [(n, _digest(t)) for n, t in src.iter_full()] == f["stream"]
        bf = SafetensorsSource(folder, dtype=torch.bfloat16)
        f["bf16_meta"] = _meta(bf)
        f["bf16_stream"] = [(n, _digest(t)) for n, t in bf.iter_full()]
        f["checked"] = errors_of(lambda: list(checked(bf).iter_full()))
        f["checked_count"] = sum(1 for _ in checked(SafetensorsSource(folder)).iter_full())
        facts[key] = f

    # 3) only rank 0 touches the disk: rank 1 passes a path that does not exist and gets the same
    #    metadata; the other way round every rank raises, naming rank 0.
    src = SafetensorsSource(good["single"] if rank == 0 else "/no/such/checkpoint/on/rank1")
    facts["path_rank0_only"] = _meta(src)
    facts["path_missing_on_rank0"] = errors_of(
        SafetensorsSource, "/no/such/checkpoint/on/rank0" if rank == 0 else good["single"]
    )

    # 4) vLLM's NCCL trainer engine: rank 0 runs the sender's own check over the stream; rank 1
    #    is a real non-sender engine that drains iter_full() (nothing to yield, nothing to send).
    src = SafetensorsSource(good["sharded"])
    drive_vllm_nccl(src, rank, facts)

    # 5) bad folders and bad arguments: every rank raises CheckpointError, none hangs.
    facts["bad"] = {case: errors_of(SafetensorsSource, folder) for case, (folder, _) in bad.items()}
    facts["bad_dtype"] = errors_of(SafetensorsSource, good["single"], dtype=torch.int8)
    facts["bad_dtype_rank1_only"] = errors_of(
        SafetensorsSource, good["single"], dtype=torch.int8 if rank == 1 else None
    )
    facts["bad_path_type_rank1_only"] = errors_of(SafetensorsSource, good["single"] if rank == 0 else None)
    facts["bad_device"] = errors_of(SafetensorsSource, good["single"], device="gpu7")
    facts["dtype_disagree"] = errors_of(
        SafetensorsSource, good["single"], dtype=torch.bfloat16 if rank == 0 else torch.float16
    )
    facts["good_after_bad"] = len(SafetensorsSource(good["sharded"]).metadata)

    # 6) a 2-rank sync through the loopback backend (vLLM's trainer factory, 4-phase protocol).
    src = SafetensorsSource(good["sharded"])
    info = LoopbackTrainerInitInfo("127.0.0.1", port, 2, rank=rank, timeout_s=60)
    client = ReceiverClient(url) if rank == 0 else Untouchable()
    engine = WeightTransferTrainerFactory.trainer_init(info, client=client, source=src)
    engine.send_weights(weight_version="from-checkpoint")
    facts["loopback_tensors"] = src.last_pass.tensors
    if rank == 0:
        facts["loopback_sent"] = engine.last_send.tensors
    return pack(facts)


# ---- the parent's oracles ------------------------------------------------------------------------


def _oracle(folder: str, dtype: torch.dtype | None = None) -> tuple[list[tuple], list[tuple]]:
    """(metadata rows, [(name, digest)]) from safetensors' safe_open: files in name order, each
    in on-disk order (``offset_keys``)."""
    from safetensors import safe_open

    rows, stream = [], []
    for path in _shards(folder):
        with safe_open(path, "pt") as f:
            for k in f.offset_keys():
                t = f.get_tensor(k)
                router = k.endswith("mlp.gate.weight")  # routers keep their dtype (wire.DEFAULT_KEEP_FP32)
                wire = dtype if dtype is not None and t.is_floating_point() and not router else t.dtype
                rows.append((k, str(wire), tuple(t.shape), (0,)))
                stream.append((k, _digest(t.to(wire))))
    return rows, stream


def test_metadata_is_the_files_names_dtypes_shapes_in_on_disk_order(folders, world):
    r0, r1 = world["ranks"][0], world["ranks"][1]
    for key, folder in folders["good"].items():
        rows, _ = _oracle(folder)
        assert r0[key]["meta"] == rows, key
        assert r1[key]["meta"] == rows, key  # rank 1 never opened the folder: rank 0's list
    # Sharded folders really are sharded, and the order is file by file, not weight_map's.
    assert len(_shards(folders["good"]["sharded"])) >= 3 and len(_shards(folders["good"]["moe"])) >= 3
    with open(os.path.join(folders["good"]["sharded"], "model.safetensors.index.json")) as f:
        assert list(json.load(f)["weight_map"]) != [row[0] for row in r0["sharded"]["meta"]]


def test_metadata_reads_no_tensor_data(world):
    r0, r1 = world["ranks"][0], world["ranks"][1]
    want = [("z_big", "torch.float32", (16, 1024 * 1024), (0,)), ("a_small", "torch.float32", (4,), (0,))]
    assert r0["sparse_meta"] == r1["sparse_meta"] == want  # on-disk order, not name order
    # Both ranks built the source and no data page was read. The tolerance (1% = 164 of 16384
    # pages) covers the header's page and any kernel readahead around it; reading even the small
    # tensor at the end pulls 8 MiB (12.5%) in with readahead here, a pass 100%.
    assert r0["resident_after_metadata"] <= 0.01, r0["resident_after_metadata"]
    # The control: one pass reads every page, and the measurement sees it.
    assert r0["resident_after_pass"] == 1.0
    assert [n for n, _, _ in r0["sparse_stream"]] == ["z_big", "a_small"] and r1["sparse_stream"] == []


def test_stream_is_the_files_bytes_on_rank0_only(folders, world):
    r0, r1 = world["ranks"][0], world["ranks"][1]
    for key, folder in folders["good"].items():
        _, stream = _oracle(folder)
        assert r0[key]["stream"] == stream, key
        assert r0[key]["second_pass_equal"], key
        assert r1[key]["stream"] == [], key  # owners=(0,): every other rank yields nothing
        assert r0[key]["stats"]["tensors"] == len(stream) and r0[key]["stats"]["collectives"] == 0
        assert r0[key]["checked"] is None and r1[key]["checked"] is None, key
        assert (r0[key]["checked_count"], r1[key]["checked_count"]) == (len(stream), 0)


def test_bfloat16_casts_floating_tensors_and_keeps_routers(folders, world):
    r0, r1 = world["ranks"][0], world["ranks"][1]
    for key, folder in folders["good"].items():
        rows, stream = _oracle(folder, torch.bfloat16)
        assert r0[key]["bf16_meta"] == r1[key]["bf16_meta"] == rows, key
        assert r0[key]["bf16_stream"] == stream, key
    moe = {n: d for n, d, _, _ in r0["moe"]["bf16_meta"]}
    gates = [n for n in moe if n.endswith("mlp.gate.weight")]
    assert gates and all(moe[n] == "torch.float32" for n in gates)  # routers keep fp32
    assert sum(d == "torch.bfloat16" for d in moe.values()) == len(moe) - len(gates)


def test_path_is_read_on_rank0_only(folders, world):
    r0, r1 = world["ranks"][0], world["ranks"][1]
    rows, _ = _oracle(folders["good"]["single"])
    assert r0["path_rank0_only"] == r1["path_rank0_only"] == rows
    for r, res in world["ranks"].items():
        err = res["path_missing_on_rank0"]
        assert err.startswith(f"CheckpointError: rank {r}: ") and "/no/such/checkpoint/on/rank0" in err, err
        assert ("this rank" if r == 0 else "rank 0 could not") in err


def test_vllm_nccl_engine_sender_check_and_non_sender(folders, world):
    r0, r1 = world["ranks"][0], world["ranks"][1]
    _, stream = _oracle(folders["good"]["sharded"])
    assert [(n, _digest(t)) for n, t in r0["nccl_sender"].items()] == stream
    assert r1["nccl_is_sender"] is False and r1["nccl_nonsender_tensors"] == 0
    assert r1["nccl_nonsender_collectives"] == 0


def test_bad_folders_raise_checkpoint_error_on_every_rank(folders, world):
    for case, (_, words) in folders["bad"].items():
        for r, res in world["ranks"].items():
            err = res["bad"][case]
            assert err is not None and err.startswith(f"CheckpointError: rank {r}: "), (case, r, err)
            missing = [w for w in words if w not in err]
            assert not missing, (case, r, missing, err)
    for r, res in world["ranks"].items():
        assert "dtype= must be a floating-point dtype" in res["bad_dtype"], res["bad_dtype"]
        err = res["bad_dtype_rank1_only"]
        assert err.startswith(f"CheckpointError: rank {r}: ") and "int8" in err, err
        assert ("this rank" if r == 1 else "rank 1 could not") in err
        err = res["bad_path_type_rank1_only"]
        assert err.startswith(f"CheckpointError: rank {r}: ") and "path= must be a str" in err, err
        assert "device='gpu7' is not a torch device" in res["bad_device"], res["bad_device"]
        err = res["dtype_disagree"]
        assert err.startswith(f"CheckpointError: rank {r}: ranks pass different dtype=") and "float16" in err, err
        assert res["good_after_bad"] == len(_oracle(folders["good"]["sharded"])[0])


def test_loopback_round_trip_equals_from_pretrained(folders, world):
    from transformers import AutoModelForCausalLM
    from vllm.model_executor.model_loader.weight_checksum import compute_tensor_digests

    folder = folders["good"]["sharded"]
    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the receiver's threads: same kernels, same bits
    try:
        with torch.no_grad():
            want = model(input_ids=torch.tensor(IDS)).logits.float()
    finally:
        torch.set_num_threads(threads)
    assert not torch.equal(world["before"], want)  # the receiver started with other weights
    assert torch.equal(world["after"], want), float((world["after"] - want).abs().max())
    assert world["digests"] == compute_tensor_digests(model)  # vLLM's digests, every parameter
    r0, r1 = world["ranks"][0], world["ranks"][1]
    n = len(_oracle(folder)[0])
    assert r0["loopback_sent"] == r0["loopback_tensors"] == n and r1["loopback_tensors"] == 0
    finishes = [c["body"] for c in world["calls"] if c["path"] == "/finish_weight_update"]
    assert finishes == [{"weight_version": "from-checkpoint"}]
