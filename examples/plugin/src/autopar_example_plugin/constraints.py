"""A constraint: data parallelism only over a power of two of ranks.

    autopar plan MODEL --cluster 6xA100-80GB --constraint dp-power-of-two
"""

from __future__ import annotations

from autopar.core.constraints import Constraint, SettingView


class DpPowerOfTwo(Constraint):
    def allows(self, setting: SettingView) -> bool:
        return setting.dp & (setting.dp - 1) == 0

    def __str__(self) -> str:
        return "dp-power-of-two"
