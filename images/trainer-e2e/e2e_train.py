"""The e2e trainer: stream the cached table with DataCacheDataset, print what this rank saw.

Runs under torchrun on each TrainJob node; ``DataCacheDataset()`` finds the job's cache from
``TRAIN_JOB_NAME`` and its shard from ``RANK``/``WORLD_SIZE``. The one line the kind suite reads:

    E2E_RESULT rank=R world=W rows=N unique=U id_sum=S id_sq_sum=Q endpoint=E

where E is the endpoint it resolved (``grpc+tls://`` where the namespace has the TLS Secret).
"""

from __future__ import annotations

import os
import sys


def main() -> int:
    from kubeflow_data_cache.dataset import DataCacheDataset

    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rows = id_sum = id_sq_sum = 0
    seen: set[int] = set()
    dataset = DataCacheDataset(columns=["id"])
    for batch in dataset:
        ids = batch["id"].tolist()
        rows += len(ids)
        id_sum += sum(ids)
        id_sq_sum += sum(i * i for i in ids)
        seen.update(ids)
    print(
        f"E2E_RESULT rank={rank} world={world} rows={rows} unique={len(seen)} id_sum={id_sum} id_sq_sum={id_sq_sum} "
        f"endpoint={dataset.endpoint}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
