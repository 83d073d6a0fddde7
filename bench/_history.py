"""Regression guard for benchmark ratios: every ratio a bench prints is compared with the previous
recorded run of the same bench, shape and ratio, and ``REGRESSION`` is printed when it got worse by
more than the run-to-run noise.

Storage: ``bench/results/history.jsonl``, one JSON object per line, oldest first::

    {"bench": "bench_megatron", "shape": "qwen3-1.7b tp1 bf16", "ratio": "export/copy median",
     "value": 1.582, "noise": 0.012, "better": "lower", "commit": "093820e", "when": "2026-12-04",
     "note": "..."}

``noise`` is the relative run-to-run spread the run measured for that ratio (``ratio_noise``), or
null for figures seeded from the markdown results (``seed_from_markdown``, run once: the history
starts with every ratio in ``bench/results/gpu-*.md`` and the CPU figures of ``docs/evidence.md``).

Threshold (relative): ``max(FLOOR, noise of this run, noise recorded with the last run)``. A ratio
is a regression when it is worse than the last one by more than that: ``now > last * (1 + t)`` for
"lower is better". ``FLOOR`` is 5%: GPU runs of unchanged code moved export/ModuleSource by +-3.5%
(2.16-2.31 over four runs) and FSDPSource/ModuleSource(plain) by +-4% (1.02-1.09 on reruns), and
CPU overlap ratios by +-0.01-0.02 on x0.6 (three runs); a 5% floor is above all of those.

``WS_BENCH_HISTORY=path`` reads and records another file (a scratch run that must not touch the
committed history).

Recording: a bench run with ``--record`` appends its lines here, and also to ``$OUT/bench-history.jsonl``
when ``OUT`` is set (the GPU run: the device machine's tree is thrown away, ``$OUT`` comes back;
append that file to this one when committing the run's results).
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
from collections.abc import Sequence

__all__ = ["HISTORY", "FLOOR", "Guard", "rel_spread", "ratio_noise", "last", "seed_from_markdown"]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HISTORY = os.environ.get("WS_BENCH_HISTORY") or os.path.join(ROOT, "bench", "results", "history.jsonl")
FLOOR = 0.05


def rel_spread(samples: Sequence[float]) -> float:
    """Relative spread of timings: IQR / median with >= 5 samples, else half the range / median."""
    xs = sorted(samples)
    if len(xs) < 2:
        return 0.0
    med = statistics.median(xs)
    if len(xs) >= 5:
        q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive")
        return (q3 - q1) / med if med else 0.0
    return (xs[-1] - xs[0]) / 2 / med if med else 0.0


def ratio_noise(num: Sequence[float], den: Sequence[float] | None = None) -> float:
    """Relative noise of a ratio of two timed quantities (their relative spreads add); with one
    argument, the spread of per-rep ratios."""
    return rel_spread(num) + (rel_spread(den) if den is not None else 0.0)


def _read(path: str = HISTORY) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def last(bench: str, shape: str, ratio: str, path: str = HISTORY) -> dict | None:
    """The newest recorded line of ``bench`` / ``shape`` / ``ratio``, or None."""
    hits = [e for e in _read(path) if (e["bench"], e["shape"], e["ratio"]) == (bench, shape, ratio)]
    return hits[-1] if hits else None


def _commit() -> str:
    """The commit a record is made at: ``$WEIGHTSYNC_COMMIT`` when set (the GPU machine's copy of the
    tree carries a stale ``.git``, so a device run passes the commit it was started from), else git's."""
    if os.environ.get("WEIGHTSYNC_COMMIT"):
        return os.environ["WEIGHTSYNC_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return out.stdout.strip() + ("+dirty" if dirty else "") if out.returncode == 0 else "?"
    except (OSError, subprocess.SubprocessError):
        return "?"


class Guard:
    """Compares one bench run's ratios with the history; ``check`` prints one line per ratio.

    ``lines`` collects what was printed; ``regressions`` the REGRESSION lines."""

    def __init__(self, bench: str, shape: str, *, record: bool = False, note: str = "", path: str = HISTORY,
                 printer=print) -> None:
        self.bench, self.shape, self.record, self.note, self.path = bench, shape, record, note, path
        self.printer = printer
        self.lines: list[str] = []
        self.regressions: list[str] = []
        self._new: list[dict] = []

    def check(self, ratio: str, value: float, noise: float, *, better: str = "lower") -> str | None:
        """Compare ``value`` (this run) with the last recorded one; returns the REGRESSION line or None."""
        prev = last(self.bench, self.shape, ratio, self.path)
        entry = {"bench": self.bench, "shape": self.shape, "ratio": ratio, "value": round(value, 4),
                 "noise": round(noise, 4), "better": better}
        self._new.append(entry)
        if prev is None:
            line = f"NO-HISTORY {self.bench} {ratio}: now {value:.3f} ({self.shape}; first record)"
            self._say(line)
            return None
        t = max(FLOOR, noise, prev.get("noise") or 0.0)
        lastv = float(prev["value"])
        worse = value > lastv * (1 + t) if better == "lower" else value < lastv * (1 - t)
        where = f"last {lastv:.3f} at {prev.get('commit', '?')} {prev.get('when', '')}".rstrip()
        if worse:
            line = f"REGRESSION {self.bench} {ratio}: now {value:.3f}, {where} (threshold {100 * t:.1f}%, {better} is better)"
            self.regressions.append(line)
        else:
            line = f"ok {self.bench} {ratio}: now {value:.3f}, {where} (threshold {100 * t:.1f}%)"
        self._say(line)
        return line if worse else None

    def _say(self, line: str) -> None:
        self.lines.append(line)
        self.printer(line)

    def finish(self) -> None:
        """Append this run's lines (``--record``) to the history and to ``$OUT/bench-history.jsonl``."""
        if not self.record or not self._new:
            return
        import datetime

        stamp = {"commit": _commit(), "when": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
                 **({"note": self.note} if self.note else {})}
        text = "".join(json.dumps({**e, **stamp}) + "\n" for e in self._new)
        targets = [self.path]
        if os.environ.get("OUT"):
            targets.append(os.path.join(os.environ["OUT"], "bench-history.jsonl"))
        for p in targets:
            os.makedirs(os.path.dirname(os.path.abspath(p)), exist_ok=True)
            with open(p, "a") as f:
                f.write(text)
        self.printer(f"recorded {len(self._new)} ratios of {self.bench} ({self.shape}) in {', '.join(targets)}")


# ---- seeding (run once; kept so the seed can be re-derived) ------------------------------------

GPU_SHAPES = {"bench_megatron": "qwen3-1.7b tp1 bf16", "bench_ipc": "qwen3-1.7b bf16 1gpu"}


def seed_from_markdown(results_dir: str = os.path.join(ROOT, "bench", "results")) -> list[dict]:
    """Every ratio row of the GPU results tables (``| bench_x | ratio ... | v |``), oldest file first,
    then the CPU figures quoted in docs/evidence.md and the commit messages that recorded them."""
    out = []
    for name in sorted(os.listdir(results_dir)):
        if not (name.startswith("gpu-") and name.endswith(".md")):
            continue
        text = open(os.path.join(results_dir, name)).read()
        m = re.search(r"commit ([0-9a-f]{7})|\bon ([0-9a-f]{7})", text[:600])
        commit = (m.group(1) or m.group(2)) if m else "?"
        when = re.search(r"(\d{4}-\d{2}-\d{2})", name).group(1)
        for row in re.finditer(r"^\| (bench_megatron|bench_ipc) \| (ratio [^|]+?|[^|]+? / d2d copy) \| ([0-9.]+) \|", text, re.M):
            bench, ratio, v = row.group(1), row.group(2).strip(), float(row.group(3))
            ratio = ratio.removeprefix("ratio ")
            if ratio.startswith("ModuleSource("):  # vLLM's source over the copy: the baseline, not ours
                continue
            out.append({"bench": bench, "shape": GPU_SHAPES[bench], "ratio": ratio, "value": v, "noise": None,
                        "better": "lower", "commit": commit, "when": when, "note": f"seeded from bench/results/{name}"})
    # bench_gpu_ipc --reps 21 on the H200 after d5665fb (its commit message, docs/evidence.md)
    for ratio, v in (("FSDPSource/ModuleSource(plain) unpacked best", 1.05), ("FSDPSource/ModuleSource(plain) unpacked median", 0.97),
                     ("FSDPSource/ModuleSource(plain) packed best", 1.01), ("FSDPSource/ModuleSource(plain) packed median", 1.04)):
        out.append({"bench": "bench_ipc", "shape": GPU_SHAPES["bench_ipc"], "ratio": ratio, "value": v, "noise": None,
                    "better": "lower", "commit": "d5665fb", "when": "2026-12-04",
                    "note": "seeded: bench_gpu_ipc --reps 21 (commit d5665fb message)"})
    cpu = [
        ("bench_overlap", "hidden1024 layers16 vocab16000 world2 send1", "send overlap on/off", 0.62, "1bf6663",
         "seeded: docs/evidence.md, session 6 (x0.62/0.63/0.63), 2-core CPU"),
        ("bench_overlap_megatron", "TP2 hidden1024 layers16 vocab16000 send1", "export+send overlap on/off", 0.96, "c484d6c",
         "seeded: docs/evidence.md / commit c484d6c, 2-core CPU"),
        ("bench_overlap_megatron", "TP2 hidden1024 layers16 vocab16000 send1", "export overlap on/off", 0.84, "c484d6c",
         "seeded: commit c484d6c, 2-core CPU"),
    ]
    for bench, shape, ratio, v, commit, note in cpu:
        out.append({"bench": bench, "shape": shape, "ratio": ratio, "value": v, "noise": None, "better": "lower",
                    "commit": commit, "when": "2026-12-04", "note": note})
    return out


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="bench history: show it, or seed it from the markdown results")
    ap.add_argument("--seed", action="store_true", help=f"write {HISTORY} from bench/results/*.md (refuses if it exists)")
    args = ap.parse_args()
    if args.seed:
        if os.path.exists(HISTORY):
            raise SystemExit(f"{HISTORY} exists")
        with open(HISTORY, "w") as f:
            for e in seed_from_markdown():
                f.write(json.dumps(e) + "\n")
    for e in _read():
        print(f"{e['bench']:<24} {e['shape']:<42} {e['ratio']:<52} {e['value']:>7} {e.get('commit', '?')} {e.get('when', '')}")
