"""The warm start's cache: keyed by its whole recipe, and a file of another recipe is refused at load."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from areal_metrics.areal_train import warmstart
from areal_metrics.areal_train.warmstart_cache import WarmStartSpec, path_for

TINY = WarmStartSpec(d_model=32, layers=1, heads=2, steps=10, batch=8)


@pytest.mark.parametrize("change", [{"steps": 11}, {"lr": 1e-3}, {"batch": 16}, {"seed": 1}, {"scratch_share": 0.5},
                                    {"retry_share": 0.2}, {"d_model": 64}])
def test_every_number_of_the_recipe_is_in_the_key(change) -> None:
    assert dataclasses.replace(TINY, **change).key() != TINY.key()


def test_the_thread_count_is_not() -> None:
    assert dataclasses.replace(TINY, threads=4).key() == TINY.key()


def test_load_refuses_a_file_of_another_recipe(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("AREAL_CACHE_DIR", str(tmp_path))
    policy = warmstart.load(TINY)
    assert policy.n_parameters() > 0
    saved = torch.load(path_for(TINY), weights_only=True)
    assert saved["key"] == TINY.key() and saved["spec"]["scratch_share"] == TINY.scratch_share
    saved["key"] = "0123456789abcdef"  # e.g. a file copied from another recipe under this name
    torch.save(saved, path_for(TINY))
    with pytest.raises(RuntimeError, match="a warm start of recipe 0123456789abcdef where"):
        warmstart.load(TINY)
