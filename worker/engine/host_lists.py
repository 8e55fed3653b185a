"""Python lists of per-row values -> tensors on the engine's device, through numpy.

Every step turns lists that grow with the batch (token ids, positions, pool rows, block tables,
row indices) into tensors. `torch.tensor` on a list of Python numbers costs about 0.4
µs an element on the host; numpy's conversion about 0.05 (98 µs vs 14 µs for the three 256-row
lists of one decode step, bench/RESULTS.md session 12): at a few hundred rows per step that is
host time every step pays, which a GPU step cannot hide.
"""

from __future__ import annotations

import numpy as np
import torch


def long_tensor(values, device) -> torch.Tensor:
    return torch.from_numpy(np.array(values, dtype=np.int64)).to(device, non_blocking=True)
