"""YaRN's magnitude scale, which both a family's declaration (DeepSeek's softmax scale, at
conversion) and the rotary tables (``rope``) read: here, beside neither, so that the families'
modules import nothing that imports the config."""

from __future__ import annotations

import math


def yarn_mscale(factor: float, m: float = 1.0) -> float:
    """YaRN's scale of a context grown ``factor`` times: 0.1 m ln(factor) + 1 (1 when it did
    not grow); DeepSeek's softmax scale takes its square too (``deepseek_v2``)."""
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0
