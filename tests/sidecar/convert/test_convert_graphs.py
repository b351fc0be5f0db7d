"""``GraphLaunches.prepare``'s early decline on the CPU: it reads the ids before any check, so input that is
not an id array must still reach the checks and be refused with their ValueError. The launches themselves
need Triton and a GPU (``test_convert_graphs_gpu.py``); here the object is made without its kernel set-up."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest
import torch

from sidecar.convert import PlaneSet
from sidecar.convert.graphs import GraphLaunches


def _graphs_without_kernels() -> GraphLaunches:
    """Only what ``prepare`` reads before its checks: the planes, the keys' graphs (none held) and stats."""
    planes = [torch.zeros(8, 2 * 16 * 64, dtype=torch.bfloat16) for _ in range(2)]
    graphs = GraphLaunches.__new__(GraphLaunches)  # __init__ imports the Triton kernels
    graphs.planes = PlaneSet(planes, [t.clone() for t in planes], num_heads=2, block_size=16, head_size=64)
    graphs.per_key = 8
    graphs._graphs = OrderedDict()
    graphs.stats = {"declined": 0}
    return graphs


@pytest.mark.parametrize(
    ("ids", "match"),
    [(None, "must be a numpy array"), (3, "must be a numpy array"), ([1, 2], "must be a numpy array"),
     (np.array([[1, 2]]), "must be 1-D")],
)
def test_ids_that_are_not_an_id_array_are_refused_by_the_checks(ids, match):
    with pytest.raises(ValueError, match=match):
        _graphs_without_kernels().prepare(ids, torch.zeros(2, 2, 16), (0, 2))
