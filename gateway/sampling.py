"""Which traces the gateway records spans for: OpenTelemetry's standard samplers.

Read from ``OTEL_TRACES_SAMPLER`` and ``OTEL_TRACES_SAMPLER_ARG``
(https://opentelemetry.io/docs/specs/otel/configuration/sdk-environment-variables/#general-sdk-configuration):

- ``always_on``, ``always_off``: every trace, or none;
- ``traceidratio``: the share ``OTEL_TRACES_SAMPLER_ARG`` (0 to 1, default 1) of traces,
  decided on the trace id alone, so every service with the same ratio keeps the same traces;
- ``parentbased_always_on`` (the default), ``parentbased_always_off``,
  ``parentbased_traceidratio``: a request that arrives in a trace follows its caller's
  sampled flag; only a trace the gateway starts is decided by the named sampler.

The ratio test is the one OpenTelemetry's SDKs use
(https://opentelemetry.io/docs/specs/otel/trace/sdk/#traceidratiobased): the trace id's low
64 bits, read as an integer, below ``round(ratio * 2**64)``. Unknown or out-of-range values
are logged and replaced by the defaults, as the specification asks of an SDK: a typo in a
tracing variable never stops the gateway.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

log = logging.getLogger("fleetgate.spans")

DEFAULT = "parentbased_always_on"
# The low 64 bits of a trace id: the part the ratio test reads.
_LOW_BITS = 2**64
_ROOT_RULES = {"always_on", "always_off", "traceidratio"}
NAMES = frozenset(_ROOT_RULES | {f"parentbased_{rule}" for rule in _ROOT_RULES})


@dataclass(frozen=True, slots=True)
class Sampler:
    """The sampling decision for one request: pure, from its parent's flag and trace id."""

    # A trace id's low 64 bits below this are sampled (0: none; 2**64: all).
    bound: int
    # Follow the caller's sampled flag when the request arrives in a trace.
    parent_based: bool
    name: str = DEFAULT

    @classmethod
    def named(cls, name: str, ratio: float = 1.0) -> Sampler:
        """One of ``NAMES``; ``ratio`` applies to the ``traceidratio`` ones."""
        if name not in NAMES:
            raise ValueError(f"unknown sampler {name!r}")
        rule = name.removeprefix("parentbased_")
        share = {"always_on": 1.0, "always_off": 0.0}.get(rule, ratio)
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"sampling ratio {share} is not between 0 and 1")
        return cls(round(share * _LOW_BITS), name != rule, name)

    @classmethod
    def from_environment(cls, environ: Mapping[str, str]) -> Sampler:
        """``OTEL_TRACES_SAMPLER`` and its argument; the defaults, logged, for bad values."""
        name = (environ.get("OTEL_TRACES_SAMPLER") or DEFAULT).strip().lower()
        if name not in NAMES:
            log.warning("unknown OTEL_TRACES_SAMPLER; using the default", extra={"sampler": name, "default": DEFAULT})
            name = DEFAULT
        raw = (environ.get("OTEL_TRACES_SAMPLER_ARG") or "").strip()
        ratio = 1.0
        if raw and name.endswith("traceidratio"):
            try:
                ratio = float(raw)
            except ValueError:
                ratio = -1.0
            if not 0.0 <= ratio <= 1.0:
                log.warning("OTEL_TRACES_SAMPLER_ARG is not a ratio in [0, 1]; using 1", extra={"value": raw})
                ratio = 1.0
        return cls.named(name, ratio)

    def sample(self, trace_id: str, parent_sampled: bool | None) -> bool:
        """Whether to record this request's spans; ``parent_sampled`` is None for a new trace."""
        if self.parent_based and parent_sampled is not None:
            return parent_sampled
        if self.bound == _LOW_BITS:  # every trace id passes: none to read
            return True
        return int(trace_id[16:], 16) < self.bound
