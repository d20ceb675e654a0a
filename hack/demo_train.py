"""The demo's training job (run by hack/demo.py under torchrun): DDP over gloo, fed by the cache.

Each rank streams its shard of every shuffled epoch with DataCacheDataset, trains a tiny model
on the numeric features, and counts how often it saw every row id; the counts of all ranks are
summed, so rank 0 can check that the epoch delivered every row exactly once.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from kubeflow_data_cache.dataset import DataCacheDataset
from kubeflow_data_cache.processes import end_with_parent

COLUMNS = ["id", "feature_a", "feature_b", "label"]
NUM_CLASSES = 10  # sample.py: label = id % 10
PROGRESS_EVERY_BATCHES = 50


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--endpoint", default=os.environ.get("DATA_CACHE_ENDPOINT"), help="the cache's grpc:// address")
    p.add_argument("--rows", type=int, required=True, help="rows in the table (to check exactly-once)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--workers", type=int, default=0, help="DataLoader workers per rank (0: read in the rank)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--even-split",
        choices=["drop", "pad"],
        help="even split: the same batches on every rank, each shard dropping or repeating up to a row, so an epoch "
        "is checked for what that promises instead of exactly once",
    )
    return p.parse_args(argv)


def batch_bytes(batch: dict[str, torch.Tensor]) -> int:
    return sum(t.element_size() * t.numel() for t in batch.values())


class DataWait:
    """The seconds a training loop spends waiting for its next batch: the time a GPU would sit
    idle for want of data, which is what the cache is there to remove."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def timed(self, batches: Iterable[dict[str, torch.Tensor]]) -> Iterator[dict[str, torch.Tensor]]:
        batches = iter(batches)
        while True:
            asked = time.perf_counter()
            batch = next(batches, None)
            self.seconds += time.perf_counter() - asked
            if batch is None:
                return
            yield batch


def run_epoch(
    model, optimizer, loader, rows: int, epoch: int, rank: int
) -> tuple[torch.Tensor, int, int, float, float]:
    """Train one epoch; return this rank's per-id counts, batches, tensor bytes received,
    seconds, and seconds spent waiting for data.

    The model (labels are ``id % 10``, out of a linear model's reach) only makes the step real:
    the demo measures and checks the data path, not the fit.
    """
    seen = []
    nbytes = 0
    wait = DataWait()
    start = time.perf_counter()
    # Join lets a rank with fewer batches finish without hanging the others' all-reduce
    # (with even=None shards may differ by a row, so batch counts may differ by one).
    with Join([model]):
        for step, batch in enumerate(wait.timed(loader), 1):
            seen.append(batch["id"])
            nbytes += batch_bytes(batch)
            x = torch.stack([batch["feature_a"], batch["feature_b"].float()], dim=1)
            loss = F.cross_entropy(model(x), batch["label"].long())
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if rank == 0 and step % PROGRESS_EVERY_BATCHES == 0:
                done = sum(len(s) for s in seen)
                print(f"  epoch {epoch}: rank 0 at batch {step} ({done:,} rows)", flush=True)
    seconds = time.perf_counter() - start
    ids = torch.cat(seen) if seen else torch.empty(0, dtype=torch.int64)
    # One slot per row id, and a last one for ids outside [0, rows): every rank's tensor has the
    # same length, so a wrong id is counted as one instead of failing the all-reduce.
    outside = (ids < 0) | (ids >= rows)
    counts = torch.bincount(ids[~outside], minlength=rows).to(torch.int32)
    counts = torch.cat([counts, outside.sum().to(torch.int32).reshape(1)])
    return counts, len(seen), nbytes, seconds, wait.seconds


def epoch_verdict(counts: torch.Tensor, rows: int, shards: int, even: str | None) -> tuple[bool, str, str]:
    """Whether an epoch delivered what the split promises, its name, and what went wrong if not.

    ``counts`` holds how often each row id was seen, then the ids outside [0, rows). Without
    ``even`` every row comes once; "drop" cuts each shard to rows // shards (the rows past that,
    none twice), "pad" fills each to the ceiling (every row at least once, the rest repeats).
    """
    seen, outside = counts[:-1], int(counts[-1])
    missing, repeated = int((seen == 0).sum()), int((seen > 1).sum())
    extra = int(seen.sum()) - rows + missing  # reads beyond each row's first
    if even == "drop":
        promise, ok = "at most once", repeated == 0 and missing == rows - shards * (rows // shards)
    elif even == "pad":
        promise, ok = "at least once", missing == 0 and extra == shards * -(-rows // shards) - rows
    else:
        promise, ok = "exactly once", missing == 0 and repeated == 0
    ok = ok and outside == 0
    why = f"{missing} row(s) never seen, {repeated} seen more than once, {outside} id(s) outside 0..{rows - 1}"
    return ok, promise, why


def main(argv: list[str] | None = None) -> int:
    # End with torchrun, however it ends: SIGKILLed, or interrupted again while it stops us (the
    # demo's death sends it a SIGTERM per thread the demo had), it leaves its ranks running.
    end_with_parent()
    args = parse_args(argv)
    if not args.endpoint:
        print("demo_train: pass --endpoint or set DATA_CACHE_ENDPOINT", file=sys.stderr)
        return 2
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    model = DistributedDataParallel(torch.nn.Linear(2, NUM_CLASSES))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    dataset = DataCacheDataset(
        args.endpoint, batch_size=args.batch_size, columns=COLUMNS, shuffle=True, seed=args.seed, even=args.even_split
    )
    # Persistent workers keep their connections to the cache from epoch to epoch; set_epoch
    # still reaches them (the dataset's epoch is shared with its workers).
    loader = DataLoader(dataset, batch_size=None, num_workers=args.workers, persistent_workers=args.workers > 0)
    if rank == 0:
        readers = world * max(1, args.workers)
        how = f"x {args.workers} loader workers" if args.workers else "(each reading in its own process)"
        print(f"training on {world} ranks {how} = {readers} shards", flush=True)

    ok, total_rows, total_bytes, total_seconds, total_waited = True, 0, 0, 0.0, 0.0
    for epoch in range(args.epochs):
        dataset.set_epoch(epoch)
        counts, batches, nbytes, seconds, waited = run_epoch(model, optimizer, loader, args.rows, epoch, rank)
        dist.all_reduce(counts)  # per row id: how many ranks' batches held it, summed
        sent = torch.tensor([nbytes], dtype=torch.int64)
        dist.all_reduce(sent)
        slowest = torch.tensor([seconds, waited], dtype=torch.float64)  # each on the slowest rank
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        shards = world * max(1, args.workers)
        delivered, promise, why = epoch_verdict(counts, args.rows, shards, args.even_split)
        # Under an even split every rank reads as many batches: fewest and most, over the ranks.
        spread = torch.tensor([batches, -batches], dtype=torch.int64)
        dist.all_reduce(spread, op=dist.ReduceOp.MAX)
        level = not args.even_split or int(spread[0]) == -int(spread[1])
        ok = ok and delivered and level
        rows, nbytes, (seconds, waited) = int(counts.sum()), int(sent), slowest.tolist()
        total_rows, total_bytes = total_rows + rows, total_bytes + nbytes
        total_seconds, total_waited = total_seconds + seconds, total_waited + waited
        if rank == 0:
            # The rates are the training loop's (data, step and all-reduce together); the wait
            # is the part of it spent on the data, the first epoch's including the loader
            # workers' start.
            print(
                f"epoch {epoch}: {rows:,} rows in {seconds:.2f}s ({rows / seconds:,.0f} rows/s, "
                f"{nbytes / seconds / 1e6:.1f} MB/s through the training loop; {waited:.2f}s of it waiting "
                f"for data), {promise}: {'yes' if delivered else 'NO'}",
                flush=True,
            )
            if not delivered:
                print(f"  {why}", flush=True)
            if not level:
                print(f"  ranks read {-int(spread[1])} to {int(spread[0])} batches, not the same", flush=True)
    if rank == 0:
        print(
            f"summary: {total_rows:,} rows over {args.epochs} epochs, {total_rows / total_seconds:,.0f} rows/s and "
            f"{total_bytes / total_seconds / 1e6:.1f} MB/s through the training loop, "
            f"{100 * total_waited / total_seconds:.0f}% of its time waiting for data, "
            f"{'exactly once' if not args.even_split else 'as the even split promises'}: {'yes' if ok else 'NO'}",
            flush=True,
        )
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
