"""How long and how large one conversation's chat template may render: the
``HPCPAR_TEMPLATE_*`` variables, declared here and read through ``parallel.environment``.
Standard library only, so the jobs' settings declare them without loading jinja2."""

from __future__ import annotations

from ..parallel.environment import Range, declare, environment_number

declare({
    "HPCPAR_TEMPLATE_SECONDS": (Range(0, note=(
        "seconds a chat template may render one conversation for; 0: no limit")), 5.0),
    "HPCPAR_TEMPLATE_MB": (Range(0, note=(
        "MB of text or of any value a chat template may build for one conversation; 0: no "
        "limit")), 4.0),
})


def template_limits() -> tuple[float, int]:
    """The seconds and characters one conversation's rendering may take (0: no limit)."""
    return (environment_number("HPCPAR_TEMPLATE_SECONDS"),
            int(environment_number("HPCPAR_TEMPLATE_MB") * 1e6))
