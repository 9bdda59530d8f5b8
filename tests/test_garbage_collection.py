"""recipe/garbage_collection.py: the collector frozen at the start of training, collections at step boundaries only
when asked, and its state put back however training ends."""

import gc
import weakref
from types import SimpleNamespace

import pytest

from recipe.garbage_collection import GarbageCollection


@pytest.fixture(autouse=True)
def collector_restored():
    """Every test leaves the process's collector as it found it, whatever it asserts."""
    enabled = gc.isenabled()
    yield
    gc.unfreeze()
    (gc.enable if enabled else gc.disable)()


class Cycle:
    """An object in a reference cycle: only the cyclic collector frees it."""

    def __init__(self):
        self.me = self


def _micro_batches(callback, trainer, steps: int, per_step: int = 2):
    """on_train_batch_end as Lightning calls it: per_step micro-batches per optimizer step, global_step counting the
    steps done."""
    for step in range(steps):
        for i in range(per_step):
            trainer.global_step = step + (i == per_step - 1)  # the optimizer step ends with the last micro-batch
            callback.on_train_batch_end(trainer, None, None, None, i)


def test_training_start_freezes_what_exists_and_keeps_collection_automatic():
    cb, trainer = GarbageCollection(), SimpleNamespace(global_step=0)
    before = Cycle()
    cb.on_train_start(trainer, None)
    assert gc.get_freeze_count() > 0 and gc.isenabled()
    ref = weakref.ref(before)
    del before
    gc.collect()
    assert ref() is not None  # frozen: not even a full collection walks it
    cb.on_train_end(trainer, None)
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert ref() is None


def test_every_n_steps_collects_only_at_those_step_boundaries(monkeypatch):
    calls = []
    monkeypatch.setattr(gc, "collect", lambda generation=2: calls.append(generation) or 0)
    cb, trainer = GarbageCollection(every_n_steps=2, generation=1), SimpleNamespace(global_step=0)
    cb.on_train_start(trainer, None)
    assert not gc.isenabled()
    calls.clear()  # on_train_start's own full collection
    _micro_batches(cb, trainer, steps=5)  # micro-batches end at global_step 0, 1, 1, 2, 2, 3, 3, 4, 4, 5
    assert calls == [1, 1, 1]  # once each at steps 0, 2 and 4, not once per micro-batch
    cb.on_train_end(trainer, None)
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_a_cycle_made_during_training_is_freed_at_the_next_collecting_step():
    cb, trainer = GarbageCollection(every_n_steps=1, generation=1), SimpleNamespace(global_step=0)
    cb.on_train_start(trainer, None)
    made = Cycle()
    ref = weakref.ref(made)
    del made
    assert ref() is not None  # automatic collection is off
    _micro_batches(cb, trainer, steps=2)
    assert ref() is None
    cb.on_train_end(trainer, None)


def test_a_failed_run_puts_the_collector_back_and_a_disabled_one_stays_disabled():
    cb, trainer = GarbageCollection(every_n_steps=3), SimpleNamespace(global_step=0)
    cb.on_train_start(trainer, None)
    cb.on_exception(trainer, None, RuntimeError("a failed step"))
    assert gc.isenabled() and gc.get_freeze_count() == 0
    cb.on_train_end(trainer, None)  # a second restore changes nothing
    assert gc.isenabled()

    gc.disable()
    cb.on_train_start(trainer, None)
    cb.on_train_end(trainer, None)
    assert not gc.isenabled()  # the user's choice before training, not ours


@pytest.mark.parametrize("kwargs, match", [({"every_n_steps": 0}, "every_n_steps=0"),
                                           ({"every_n_steps": 2.5}, "every_n_steps=2.5"),
                                           ({"generation": 3}, "generation=3")])
def test_bad_settings_are_refused_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GarbageCollection(**kwargs)


@pytest.mark.slow
def test_a_training_run_with_step_collections_ends_with_the_collector_back(data_cache, tmp_path):
    import train as train_mod
    from run_overrides import compose_train, tiny_run_overrides

    cfg = compose_train(*tiny_run_overrides(data_cache, tmp_path, "callbacks.gc.every_n_steps=2"))
    assert gc.isenabled()
    train_mod.train(cfg)
    assert gc.isenabled() and gc.get_freeze_count() == 0
