"""The byte-bounded cache the app's sessions share."""
import threading
import time

import numpy as np
import pytest
import torch

from vit_explorer.serving.cache import ByteBoundedCache, nbytes


def test_nbytes_counts_tensors_arrays_and_containers():
    assert nbytes(torch.zeros(10, 10)) == 400
    assert nbytes(np.zeros(5, dtype=np.float64)) == 40
    assert nbytes({"a": torch.zeros(100, dtype=torch.uint8)}) >= 100


def test_least_recently_used_values_go_first_when_the_bytes_run_out():
    cache = ByteBoundedCache(max_bytes=1000)
    for key in "abc":
        cache.get_or_compute(key, lambda: torch.zeros(75))  # 300 bytes each
    cache.get_or_compute("a", lambda: pytest.fail("a is cached"))  # a is now the most recent
    cache.get_or_compute("d", lambda: torch.zeros(75))
    assert "b" not in cache and all(key in cache for key in "acd")
    assert cache.total_bytes == 900


def test_get_reads_without_computing_and_counts_as_a_use():
    cache = ByteBoundedCache(max_bytes=1000)
    assert cache.get("a") is None and cache.get("a", 0) == 0 and "a" not in cache
    for key in "ab":
        cache.get_or_compute(key, lambda: torch.zeros(100))  # 400 bytes each
    assert cache.get("a").numel() == 100  # a is now the most recent
    cache.get_or_compute("c", lambda: torch.zeros(100))
    assert "b" not in cache and "a" in cache


def test_a_value_larger_than_the_budget_is_returned_but_not_kept():
    cache = ByteBoundedCache(max_bytes=100)
    cache.get_or_compute("small", lambda: torch.zeros(10))
    assert cache.get_or_compute("big", lambda: torch.zeros(1000)).numel() == 1000
    assert "big" not in cache and "small" in cache


def test_a_value_that_shares_storage_counts_only_what_it_holds_of_its_own():
    cache = ByteBoundedCache(max_bytes=1000)
    base = torch.zeros(200)  # 800 bytes
    cache.get_or_compute("base", lambda: base)
    view = cache.get_or_compute("view", lambda: (base, torch.zeros(10)), size=lambda value: nbytes(value[1]))
    assert view[0] is base and "base" in cache and cache.total_bytes == 840


def test_many_threads_asking_for_one_key_compute_it_once():
    cache, calls, results = ByteBoundedCache(max_bytes=10**6), [], []

    def slow():
        calls.append(1)
        time.sleep(0.2)
        return torch.ones(3)

    threads = [threading.Thread(target=lambda: results.append(cache.get_or_compute("k", slow))) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == 1 and len(results) == 6 and all(r is results[0] for r in results)


def test_a_failed_computation_is_not_kept_and_can_be_tried_again():
    cache = ByteBoundedCache(max_bytes=10**6)
    with pytest.raises(RuntimeError):
        cache.get_or_compute("k", lambda: (_ for _ in ()).throw(RuntimeError("boom")))
    assert "k" not in cache
    assert cache.get_or_compute("k", lambda: 5) == 5


def test_a_folder_is_trimmed_to_its_quota_oldest_first_never_the_new_upload(tmp_path):
    import os

    from vit_explorer.serving.cache import trim_to_quota

    for age, name in enumerate(["newest", "middle", "oldest"]):
        (tmp_path / name).write_bytes(b"x" * 400)
        os.utime(tmp_path / name, (1000 - age, 1000 - age))
    folder = tmp_path / "checkpoint"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"x" * 300)
    os.utime(folder, (10, 10))  # older than all, but it is the upload being kept
    removed = trim_to_quota(tmp_path, max_bytes=800, keep={folder})
    assert [path.name for path in removed] == ["oldest", "middle"]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["checkpoint", "newest"]


def test_a_model_counts_its_parameters_and_buffers():
    module = torch.nn.Linear(10, 20)
    module.register_buffer("scale", torch.zeros(5))
    assert nbytes(module) == (10 * 20 + 20 + 5) * 4
