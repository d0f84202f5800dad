"""Mixtures of experts, for any model: the top-k router (``routing``), and the experts with
their expert-parallel dispatch and combine over an ep group (``moe``)."""

from ..exports import lazy_names

__getattr__, __dir__, __all__ = lazy_names(__name__, {
    ".routing": ("Routing", "TopKRouter", "load_balancing_loss", "route"),
    ".moe": ("ExpertDispatch", "Experts", "MoE"),
})
