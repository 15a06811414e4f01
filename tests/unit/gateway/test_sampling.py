"""OpenTelemetry's standard samplers, and the sampled flag the gateway passes on."""

from __future__ import annotations

import logging
import random

import pytest

from gateway.sampling import Sampler
from gateway.tracing import start_trace

# Trace ids whose low 64 bits are 2**63 - 1 and 2**63: just below and at half of 2**64.
BELOW_HALF = "4bf92f3577b34da6" + "7fffffffffffffff"
AT_HALF = "4bf92f3577b34da6" + "8000000000000000"
CLIENT = "00f067aa0ba902b7"


@pytest.mark.parametrize(
    ("name", "parent", "expected"),
    [
        ("always_on", False, True),  # not parent-based: the caller's flag does not count
        ("always_off", True, False),
        ("parentbased_always_on", False, False),
        ("parentbased_always_on", True, True),
        ("parentbased_always_on", None, True),  # a new trace: the named sampler decides
        ("parentbased_always_off", True, True),
        ("parentbased_always_off", None, False),
        ("parentbased_traceidratio", True, True),
        ("parentbased_traceidratio", False, False),
    ],
)
def test_each_sampler_and_the_parents_flag(name: str, parent: bool | None, expected: bool) -> None:
    assert Sampler.named(name, 0.5).sample(AT_HALF, parent) is expected


def test_the_ratio_reads_the_trace_ids_low_64_bits() -> None:
    half = Sampler.named("traceidratio", 0.5)
    # round(0.5 * 2**64) = 2**63: ids below it are sampled, from it on they are not.
    assert half.sample(BELOW_HALF, None) and not half.sample(AT_HALF, None)
    assert half.sample(BELOW_HALF, False)  # not parent-based: the ratio applies to every request
    assert not Sampler.named("traceidratio", 0.0).sample("0" * 31 + "1", None)
    assert Sampler.named("traceidratio", 1.0).sample("f" * 32, None)
    # Over many random ids, about the ratio: 10,000 draws, 0.1 expected, 4 standard errors 0.012.
    rng = random.Random(3)
    tenth = Sampler.named("parentbased_traceidratio", 0.1)
    share = sum(tenth.sample(f"{rng.getrandbits(128):032x}", None) for _ in range(10_000)) / 10_000
    assert abs(share - 0.1) < 0.012


def test_from_the_environment_with_the_specifications_defaults(caplog: pytest.LogCaptureFixture) -> None:
    assert Sampler.from_environment({}) == Sampler.named("parentbased_always_on")
    ratio = Sampler.from_environment({"OTEL_TRACES_SAMPLER": "TraceIdRatio ", "OTEL_TRACES_SAMPLER_ARG": "0.25"})
    assert ratio == Sampler(2**62, False, "traceidratio")
    # The argument only applies to the ratio samplers; without one the ratio is 1.
    assert Sampler.from_environment({"OTEL_TRACES_SAMPLER": "always_off", "OTEL_TRACES_SAMPLER_ARG": "0.5"}).bound == 0
    assert Sampler.from_environment({"OTEL_TRACES_SAMPLER": "traceidratio"}).bound == 2**64
    with caplog.at_level(logging.WARNING, "fleetgate.spans"):
        unknown = Sampler.from_environment({"OTEL_TRACES_SAMPLER": "jaeger_remote"})
        too_big = Sampler.from_environment(
            {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "1.5"}
        )
        nonsense = Sampler.from_environment({"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "x"})
    assert unknown == Sampler.named("parentbased_always_on")
    assert too_big == Sampler.named("parentbased_traceidratio", 1.0)
    assert nonsense == Sampler.named("traceidratio", 1.0)
    assert len(caplog.records) == 3
    with pytest.raises(ValueError, match="unknown sampler"):
        Sampler.named("sometimes")


@pytest.mark.parametrize(
    ("sampler", "flags", "sent"),
    [
        ("parentbased_always_on", "00", "00"),  # the caller did not sample: neither does the gateway
        ("parentbased_always_on", "01", "01"),
        ("always_on", "00", "01"),
        ("always_off", "01", "00"),
        ("always_off", "03", "02"),  # only the sampled bit changes; the others pass on
        ("parentbased_always_off", "02", "02"),
    ],
)
def test_the_sampled_flag_sent_upstream_is_the_gateways_decision(sampler: str, flags: str, sent: str) -> None:
    trace = start_trace(f"00-{AT_HALF}-{CLIENT}-{flags}", None, random.Random(1), Sampler.named(sampler))
    assert (trace.trace_id, trace.parent_id) == (AT_HALF, CLIENT)
    assert trace.flags == sent and trace.sampled is (int(sent, 16) & 1 == 1)
    assert trace.upstream_headers()["traceparent"] == f"00-{AT_HALF}-{trace.span_id}-{sent}"


def test_a_new_trace_is_sampled_as_the_sampler_says_and_tracing_off_passes_flags_on() -> None:
    rng = random.Random(5)
    assert start_trace(None, None, rng, Sampler.named("parentbased_always_off")).flags == "00"
    assert start_trace(None, None, rng, Sampler.named("parentbased_always_on")).flags == "01"
    # Tracing off (no sampler): the caller's flags pass on as they came, a new trace is not sampled.
    assert start_trace(f"00-{AT_HALF}-{CLIENT}-03", None, rng, None).flags == "03"
    assert start_trace(None, None, rng, None).flags == "00"
