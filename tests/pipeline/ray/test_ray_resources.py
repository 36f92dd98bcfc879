"""plan_resources: how many Ray workers, and what each reserves (no Ray instance needed)."""

from __future__ import annotations

import pytest

pytest.importorskip("ray.exceptions")  # (a bare "ray" would find tests/pipeline/ray here)

from pipeline.config import JobError, RayConfig  # noqa: E402
from pipeline.ray_runner import Resources, plan_resources  # noqa: E402


def test_cpu_cluster_one_worker_with_every_cpu_of_a_node_by_default() -> None:
    assert plan_resources(RayConfig(), "auto", {"CPU": 8.0}, 8.0) == Resources(1, 8.0, 0.0)
    assert plan_resources(RayConfig(), "auto", {"CPU": 32.0}, 16.0) == Resources(1, 16.0, 0.0)


def test_cpu_workers_share_the_cpus() -> None:
    assert plan_resources(RayConfig(num_workers=2), "cpu", {"CPU": 2.0}, 2.0) == Resources(
        2, 1.0, 0.0)
    assert plan_resources(RayConfig(num_workers=3), "auto", {"CPU": 8.0}, 8.0) == Resources(
        3, 2.0, 0.0)


def test_gpu_cluster_one_worker_per_gpu_by_default() -> None:
    cluster = {"CPU": 32.0, "GPU": 4.0}
    assert plan_resources(RayConfig(), "auto", cluster, 16.0) == Resources(4, 1.0, 1.0)
    assert plan_resources(RayConfig(gpus_per_worker=0.5), "auto", cluster, 16.0) == Resources(
        8, 1.0, 0.5)
    assert plan_resources(RayConfig(num_workers=2), "cuda", cluster, 16.0) == Resources(
        2, 1.0, 1.0)
    assert plan_resources(RayConfig(), "cpu", cluster, 16.0) == Resources(1, 16.0, 0.0)


def test_more_than_the_cluster_has_is_refused() -> None:
    with pytest.raises(JobError) as err:
        plan_resources(RayConfig(num_workers=3), "auto", {"CPU": 2.0}, 2.0)
    assert str(err.value) == "--num-workers 3 with 1 CPU each needs 3 CPUs; the Ray cluster has 2"
    with pytest.raises(JobError) as err:
        plan_resources(RayConfig(gpus_per_worker=1), "auto", {"CPU": 8.0}, 8.0)
    assert str(err.value) == "--num-workers 1 with 1 GPU each needs 1 GPU; the Ray cluster has 0"


def test_bad_options_are_refused() -> None:
    with pytest.raises(JobError, match=r"^--num-workers must be >= 1, got 0$"):
        RayConfig(num_workers=0)
    with pytest.raises(JobError, match=r"^--gpus-per-worker must be >= 0, got -1$"):
        RayConfig(gpus_per_worker=-1)
