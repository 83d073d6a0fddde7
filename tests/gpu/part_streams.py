"""GPU evidence part: the stream ordering of FSDPSource's overlapped gathers (issue 19).

``gather.BatchedGather`` with a side stream is what ``FSDPSource(overlap=True)`` runs on CUDA: the
next group is packed and gathered on the side stream while the consumer reads the current group on
its own stream. Three dependencies keep the bytes right; this part sets up a pass in which each one,
if missing, would hand the consumer wrong bytes:

* the side stream waits for the **default stream**, where the "optimizer" has just updated the shards
  (``add_(1)`` queued behind a long ``torch.cuda._sleep``, the host never waiting): without it the
  gather packs the previous values;
* the consumer's stream waits for the gather's **event** before unpacking: without it the unpack
  reads the gathered buffer before the (equally delayed) all-gather wrote it;
* the gathered buffer is ``record_stream``-ed on the consumer's stream, which is itself kept behind
  (a ``_sleep`` before each tensor), while the host frees the buffer and posts the next gathers.

The pass drives ``BatchedGather`` in ``GatherPipeline``'s order (post group k+1, then yield group
k's tensors) on a one-rank process group (NCCL on the GPU: the all-gather is a real NCCL kernel on
its own stream); the consumer resumes the iterator inside ``torch.cuda.stream(consumer)`` -- another
stream than the one the source posted from, as vLLM's packed NCCL producer does. Three passes; every
tensor must equal the shards' values after that pass's update, bit for bit. Two controls rerun a
pass with one dependency removed on purpose (a subclass) and must see wrong bytes -- proof that the
scenario can fail. ``--dry-run``: the same on CPU with gloo (no streams: the checks of values run,
the controls are skipped).

    python tests/gpu/part_streams.py [--dry-run] [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from facts import Facts, log  # noqa: E402

SHARDS = 8  # tensors: three groups of two, then two groups of one
ROWS, COLS = 2048, 2048  # 16 MiB fp32 each
DELAY_CYCLES = 200_000_000  # ~0.1 s of GPU time ahead of each update / each consumer read


def _init(device: str) -> None:
    import datetime

    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group(
            "nccl" if device == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1,
            timeout=datetime.timedelta(seconds=120),
        )


def _gathers(shards, device, stats, stream, cls):
    import torch
    import torch.distributed as dist

    from weightsync.sources.fsdp.gather import BatchedGather, GatherShard

    out = []
    # Two tensors per group, the last two alone: a one-tensor group hands its gathered buffer over
    # as the tensor (``BatchedGather._adopt``), which the consumer then reads on its own stream.
    groups = [(g, g + 1) for g in range(0, len(shards) - 2, 2)] + [(len(shards) - 2,), (len(shards) - 1,)]
    for idx in groups:
        pieces = [GatherShard(f"shard.{i}", shards[i], tuple(shards[i].shape), torch.float32) for i in idx]
        out.append(cls(pieces, group=dist.group.WORLD, n=1, index=0, device=device, stats=stats,
                       timeout_s=60, stream=stream))
    return out


def _pass(shards, device, consumer, cls, delay: bool):
    """One overlapped pass in the pipeline's order; returns the consumer's copies (name -> tensor)."""
    import torch

    from weightsync.sources import PassStats
    from weightsync.sources.fsdp.gather import side_stream

    stats = PassStats().start()
    gathers = _gathers(shards, device, stats, side_stream(device), cls)

    def source():
        gathers[0].post()
        for k, g in enumerate(gathers):
            if k + 1 < len(gathers):
                gathers[k + 1].post()  # ahead, before this group's tensors are yielded
            yield from g

    got = {}
    it = source()
    while True:
        if consumer is not None:
            with torch.cuda.stream(consumer):
                if delay:
                    torch.cuda._sleep(DELAY_CYCLES // 4)  # keep the consumer's stream behind
                item = next(it, None)
                if item is not None:
                    got[item[0]] = item[1].clone()  # read on the consumer's stream
        else:
            item = next(it, None)
            if item is not None:
                got[item[0]] = item[1].clone()
        if item is None:
            break
    if device.type == "cuda":
        torch.cuda.synchronize()
    return got, stats


def _bad(got, shards) -> list[str]:
    import torch

    return [n for n, t in got.items() if not torch.equal(t, shards[int(n.split(".")[1])])]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    facts = Facts("streams", dry_run=args.dry_run)
    try:
        import torch

        from weightsync.sources.fsdp.gather import BatchedGather

        cuda = torch.cuda.is_available() and not args.dry_run
        if not cuda and not args.dry_run:
            facts.skip("streams", "no CUDA device")
            return facts.finish(args.json)
        device = torch.device("cuda", 0) if cuda else torch.device("cpu")
        _init(device.type)
        base = (torch.arange(ROWS * COLS, dtype=torch.float32) % 65521).view(ROWS, COLS)
        shards = [(base + 100_000 * i).to(device) for i in range(SHARDS)]
        consumer = torch.cuda.Stream(device) if cuda else None

        def update() -> None:
            """The optimizer: on the default stream, behind a long kernel; the host does not wait."""
            if cuda:
                with torch.cuda.stream(torch.cuda.default_stream(device)):
                    torch.cuda._sleep(DELAY_CYCLES)
                    for s in shards:
                        s.add_(1.0)
            else:
                for s in shards:
                    s.add_(1.0)

        _pass(shards, device, consumer, BatchedGather, delay=False)  # warm: allocator blocks, NCCL init
        for p in range(3):
            update()
            got, stats = _pass(shards, device, consumer, BatchedGather, delay=True)
            bad = _bad(got, shards)
            facts.check(f"pass {p + 1}: every tensor equals the shards after the update, read on another "
                        f"stream ({len(got)} tensors, {stats.collectives} all-gathers, posted one group ahead)",
                        len(got) == SHARDS and not bad, f"wrong: {bad}")
        if not cuda:
            facts.skip("controls", "no CUDA streams on the dry run")
            return facts.finish(args.json)

        class NoDefaultWait(BatchedGather):
            """Control: the side stream does not wait for the default stream."""

            def post(self):
                real = torch.cuda.default_stream
                torch.cuda.default_stream = lambda device=None: self.stream  # waits for itself: no-op
                try:
                    return super().post()
                finally:
                    torch.cuda.default_stream = real

        class NoEventWait(BatchedGather):
            """Control: the consumer's stream does not wait for the gather's event."""

            def post(self):
                out = super().post()
                self._event = None
                self._posted_on = None
                return out

        for cls, what in ((NoDefaultWait, "the side stream's wait for the default stream"),
                          (NoEventWait, "the consumer stream's wait for the gather's event")):
            update()
            got, _ = _pass(shards, device, consumer, cls, delay=False)
            bad = _bad(got, shards)
            facts.check(f"control: without {what} the consumer reads wrong bytes (the scenario can fail)",
                        len(bad) > 0, f"{len(bad)} of {len(got)} tensors wrong")
            torch.cuda.synchronize()
        log("[streams] done")
    except Exception as e:  # noqa: BLE001
        facts.error("streams", e)
    return facts.finish(args.json)


if __name__ == "__main__":
    sys.exit(main())
