"""A shuffled epoch read again without set_epoch is warned about, once per dataset.

Forgetting ``set_epoch`` trains every epoch on the first one's order and nothing fails, so the
dataset says so: in the training process, and in DataLoader workers (persistent or not).
"""

from __future__ import annotations

import functools
import warnings

import pytest
from torch.utils.data import DataLoader

from kubeflow_data_cache.dataset import DataCacheDataset, RepeatedEpochWarning

WORKERS = {"num_workers": 2, "multiprocessing_context": "forkserver", "timeout": 60}


@pytest.fixture(scope="module")
def cache(small_cache):
    return small_cache


def _epoch(ds) -> list[int]:
    return [int(i) for batch in ds for i in batch["id"]]


def _repeat_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, RepeatedEpochWarning)]


def test_reading_a_shuffled_epoch_twice_warns_once_naming_set_epoch(cache):
    ds = DataCacheDataset(cache.endpoint, batch_size=1000, columns=["id"], shuffle=True, seed=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = _epoch(ds)
        assert _repeat_warnings(caught) == []
        second = _epoch(ds)
        third = _epoch(ds)
    assert first == second == third  # what the warning is about: the same order every epoch
    messages = _repeat_warnings(caught)
    assert len(messages) == 1, messages
    assert "reading epoch 0 again" in messages[0] and "set_epoch(epoch)" in messages[0]
    # Points at the training loop, not into the package.
    assert [w.filename for w in caught if issubclass(w.category, RepeatedEpochWarning)] == [__file__]


def test_no_warning_with_set_epoch_in_order_or_after_an_abandoned_read(cache):
    shuffled = DataCacheDataset(cache.endpoint, batch_size=1000, columns=["id"], shuffle=True)
    in_order = DataCacheDataset(cache.endpoint, batch_size=1000, columns=["id"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for epoch in range(3):
            shuffled.set_epoch(epoch)
            _epoch(shuffled)
            _epoch(in_order)  # the same order each time is what an in-order read is
        shuffled.set_epoch(3)
        for _ in range(2):  # stopped early (a max_steps loop): reading it again is no repeat
            partial = iter(shuffled)
            next(partial)
            partial.close()
        _epoch(shuffled)
    assert _repeat_warnings(caught) == []


def _record_warnings(path: str, worker_id: int) -> None:
    """worker_init_fn: each warning a worker shows, appended to ``path`` (a worker's stderr is
    the forkserver's, captured by whichever test started it)."""

    def show(message, category, filename, lineno, file=None, line=None):
        with open(path, "a") as out:
            out.write(f"{category.__name__}: {message}\n")

    warnings.showwarning = show


@pytest.mark.parametrize("persistent", [False, True], ids=["new-workers-each-epoch", "persistent-workers"])
def test_dataloader_workers_warn_once_over_all_workers_and_epochs(cache, tmp_path, persistent):
    shown = tmp_path / "warnings.txt"
    shown.touch()

    def loader(ds):
        init = functools.partial(_record_warnings, str(shown))
        return DataLoader(ds, batch_size=None, persistent_workers=persistent, worker_init_fn=init, **WORKERS)

    def count() -> int:
        # One line per warning shown; the message itself names the class again (how to filter
        # it), so counting the name would count each warning twice.
        return sum(line.startswith("RepeatedEpochWarning: ") for line in shown.read_text().splitlines())

    ds = DataCacheDataset(cache.endpoint, batch_size=1000, columns=["id"], shuffle=True, seed=2)
    forgetful = loader(ds)
    counts = []
    for _ in range(4):  # set_epoch forgotten
        _epoch(forgetful)
        counts.append(count())
    # Workers check one shared flag: the first repeated epoch warns (each of its 2 workers may
    # race to it), later ones never.
    assert counts[0] == 0 and 1 <= counts[1] <= 2 and counts[2] == counts[3] == counts[1], counts
    assert "set_epoch(epoch)" in shown.read_text()

    shown.write_text("")
    ds = DataCacheDataset(cache.endpoint, batch_size=1000, columns=["id"], shuffle=True, seed=2)
    careful = loader(ds)
    for epoch in range(3):
        ds.set_epoch(epoch)
        _epoch(careful)
    assert count() == 0
