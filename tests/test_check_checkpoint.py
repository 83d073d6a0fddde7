"""``weightsync check --checkpoint PATH``: exit codes and output.

The folders are written here by transformers' ``save_pretrained`` (and, for the edited one,
safetensors' ``save_file``); what each run must report -- tensor counts, which tensors differ and the
first of them in the source's order -- is computed here from those files with ``safe_open``, not
from weightsync. The checks run the CLI's rank code on forked ranks with torchrun's environment
(``worlds.run_cli``: 2 ranks for the passing folder, 1 for the failing ones); the usage errors run the
console script as a user does.
"""

from __future__ import annotations

import os
import re

import pytest
import torch

from test_demo_cli import _run
from worlds import run_cli

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    from safetensors.torch import save_file
    from transformers.utils import logging as hf_logging

    from weightsync.plugins.testbed.presets import build_model, load_config

    hf_logging.disable_progress_bar()
    root = tmp_path_factory.mktemp("check-ckpt")
    config = load_config("tiny-llama")
    out = {k: str(root / k) for k in ("bf16", "seed3", "edited", "no-config")}
    # What check builds (seed 0), cast to bf16 and sharded: PASS with --dtype bfloat16.
    build_model(config, seed=0).to(torch.bfloat16).save_pretrained(out["bf16"], max_shard_size="100KB")
    # Same config, other weights: names, dtypes, shapes equal; bytes differ.
    build_model(config, seed=3).save_pretrained(out["seed3"])
    # seed 0 with model.norm.weight dropped, an extra tensor and lm_head in bf16.
    model = build_model(config, seed=0)
    model.save_pretrained(out["edited"])
    sd = {k: v.contiguous() for k, v in model.state_dict().items() if k != "model.norm.weight"}
    sd["lm_head.weight"] = sd["lm_head.weight"].to(torch.bfloat16)
    sd["model.extra.weight"] = torch.zeros(3)
    save_file(sd, os.path.join(out["edited"], "model.safetensors"), metadata={"format": "pt"})
    os.makedirs(out["no-config"])
    save_file({"w": torch.zeros(1)}, os.path.join(out["no-config"], "model.safetensors"))
    return out


def _tensors(folder: str) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    out = {}
    for f in sorted(os.listdir(folder)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(folder, f), "pt") as h:
                out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


def _differences(out: str) -> list[str]:
    """The lines listed under ``first differences``."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("  first differences ("))
    block = []
    for line in lines[start + 1:]:
        if not line.startswith("    "):
            break
        block.append(line.strip())
    return block


def test_two_ranks_bf16_sharded_folder_passes(folders):
    files = _tensors(folders["bf16"])
    assert len([f for f in os.listdir(folders["bf16"]) if f.endswith(".safetensors")]) >= 3
    r = run_cli("check", "--checkpoint", folders["bf16"], "--dtype", "bfloat16", "--nproc", "2", nproc=2)
    out = r.stdout
    assert r.returncode == 0, (out, r.stderr[-3000:])
    assert out.strip().endswith("PASS") and "layout fsdp x2" in out
    assert f"weightsync check: {folders['bf16']} (llama, 2 layers)" in out  # config from the folder
    n = len(files)
    assert f"checkpoint {folders['bf16']}: {n} tensors" in out
    assert f"bytes: {n} of {n} tensors compared equal the checkpoint's" in out
    assert "Traceback" not in r.stderr


def test_other_weights_pass_and_differing_bytes_are_listed(folders, capsys):
    """A folder of other weights (seed 3): check loads the trainer model from the folder itself
    (issue 45), so it PASSes. The byte comparison's listing, which a wrong sync would show, is
    checked on rank 0's own pieces: the seed-0 tensors compared with that folder."""
    import argparse

    from weightsync.plugins.cli.check import _Folder, _report
    from weightsync.plugins.testbed.presets import build_model, load_config
    from weightsync.sources.toolkit import read_checkpoint

    ours = build_model(load_config("tiny-llama"), seed=0).state_dict()  # other weights than the folder's
    theirs = _tensors(folders["seed3"])
    differ = [k for k, v in ours.items() if not torch.equal(v, theirs[k])]
    assert 0 < len(differ) < len(ours)  # norms are ones in both: they must not be listed
    r = run_cli("check", "--checkpoint", folders["seed3"])
    assert r.returncode == 0 and r.stdout.strip().endswith("PASS"), (r.stdout, r.stderr[-3000:])
    assert f"bytes: {len(ours)} of {len(ours)} tensors compared equal" in r.stdout

    class Meta:  # what the source's metadata holds per tensor
        def __init__(self, name, t):
            self.name, self.dtype, self.shape, self.owners = name, t.dtype, tuple(t.shape), None

    folder = _Folder(read_checkpoint(folders["seed3"]))
    for name, t in ours.items():
        folder.compare(name, t)
    meta = [Meta(n, t) for n, t in ours.items()]
    args = argparse.Namespace(config=folders["seed3"], model=None, layout="fsdp", show=0)
    code = _report(args, load_config("tiny-llama"), None, meta, folder.index, [(0, len(meta), len(meta), [])], 1,
                   None, checkpoint=folders["seed3"], content=folder.bytes_differ)
    out = capsys.readouterr().out
    assert code == 1 and out.strip().endswith("FAIL")
    assert f"bytes: {len(ours) - len(differ)} of {len(ours)} tensors compared equal" in out
    assert f"first differences ({len(differ)} in all, metadata order):" in out
    pattern = r"(\S+): bytes differ in (\d+) of (\d+) elements; .*"
    listed = [re.fullmatch(pattern, x).groups() for x in _differences(out)]
    assert [n for n, _, _ in listed] == differ[:10]
    assert all(int(a) == int(b) == ours[n].numel() for n, a, b in listed)


def test_a_wire_dtype_the_folder_was_not_saved_in_gets_a_hint(folders):
    """Issue 56: ``--dtype bfloat16`` against an fp32 folder lists every floating tensor as a dtype
    difference and no byte can compare equal; the report says why, in the flags the user typed."""
    r = run_cli("check", "--checkpoint", folders["seed3"], "--dtype", "bfloat16")
    out = r.stdout
    assert r.returncode == 1, (out, r.stderr[-3000:])
    assert "hint: the folder holds float32 tensors and --dtype bfloat16 sends bfloat16: drop --dtype" in out, out


def test_missing_extra_and_dtype_differences_are_listed(folders):
    r = run_cli("check", "--checkpoint", folders["edited"])
    out = r.stdout
    assert r.returncode == 1, (out, r.stderr[-3000:])
    assert _differences(out) == [
        "model.norm.weight: sent (float32 (64,)), not in the checkpoint",
        "lm_head.weight: sent float32 (256, 64), checkpoint bfloat16 (256, 64)",
        "model.extra.weight: in the checkpoint (float32 (3,)), not sent",
    ], out
    assert "first differences (3 in all" in out and out.strip().endswith("FAIL")


@pytest.mark.parametrize(
    "args, words",
    [
        (["check", "--checkpoint", "/no/such/folder"], "--checkpoint /no/such/folder: no such folder"),
        (["check", "--checkpoint", "NOCONFIG"], "no config.json in it; pass --model or --config"),
        # issue 56: a file named instead of its folder; a folder holding no checkpoint, refused at
        # once (it took 10.9 s of building a model to say so)
        (["check", "--checkpoint", "FILE"], "is a file: pass the folder that holds it (--checkpoint SEED3)"),
        (["check", "--checkpoint", "DOCS", "--model", "tiny-qwen3"], "no *.safetensors file in the folder"),
    ],
)
def test_checkpoint_usage_errors_exit_2(folders, args, words):
    from pathlib import Path

    docs = str(Path(__file__).resolve().parents[1] / "docs")
    names = {"NOCONFIG": folders["no-config"], "FILE": os.path.join(folders["seed3"], "model.safetensors"),
             "DOCS": docs}
    args = [names.get(a, a) for a in args]
    words = words.replace("SEED3", folders["seed3"])
    r = _run(*args, timeout=120)
    assert r.returncode == 2, (r.stdout, r.stderr)
    err = [line for line in r.stderr.splitlines() if line.startswith("weightsync")]
    assert len(err) == 1 and words in err[0], r.stderr


@pytest.mark.parametrize("mtp", [False, True])
def test_check_mtp_load_has_no_transformers_load_report(tmp_path, mtp):
    """Issue 56: ``check --mtp`` loads a folder holding MTP layers, which transformers drops (no
    transformers model holds them) and reports in a LOAD REPORT of UNEXPECTED rows that reads as an
    error. Where weightsync expects that drop (``--mtp``) the report is not shown; elsewhere it is."""
    import argparse

    from safetensors.torch import load_file, save_file

    from weightsync.plugins.cli.check import trainer_model
    from weightsync.plugins.testbed.presets import build_model, load_config

    config = load_config("tiny-deepseek-v3")
    build_model(config, seed=0).save_pretrained(str(tmp_path))
    file = tmp_path / "model.safetensors"
    tensors = load_file(str(file))
    n = config.num_hidden_layers
    tensors[f"model.layers.{n}.eh_proj.weight"] = torch.zeros(config.hidden_size, 2 * config.hidden_size)
    tensors[f"model.layers.{n}.enorm.weight"] = torch.ones(config.hidden_size)
    save_file(tensors, str(file), metadata={"format": "pt"})
    args = argparse.Namespace(checkpoint=str(tmp_path), quantize=None, names_only=False, mtp=mtp,
                              config=str(tmp_path), model=None)
    # What transformers logs, read at its logger: its own handler may hold a stream an earlier test
    # captured, and an earlier test may have lowered its verbosity (the control needs the default)
    import logging

    seen: list[str] = []
    hook = logging.Handler(logging.DEBUG)
    hook.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    lg = logging.getLogger("transformers")
    level = lg.level
    lg.setLevel(logging.WARNING)
    lg.addHandler(hook)
    try:
        trainer_model(args, config)
    finally:
        lg.removeHandler(hook)
        lg.setLevel(level)
    assert any("LOAD REPORT" in m for m in seen) is not mtp, [m[:200] for m in seen]
