"""One torch thread for a test module's tiny matmuls: on a shared 2-core machine one thread is several times faster
(the engine sets the same for tiny models on the CPU), and the reference computes under the same rule.

A module opts in by importing the fixture: `from tests.support.threads import one_thread  # noqa: F401` (it is
module-scoped and autouse, so importing it is enough).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
