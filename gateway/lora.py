"""Loading a LoRA adapter on a replica when a request names one that no replica serves.

vLLM loads an adapter at run time through ``POST /v1/load_lora_adapter`` with
``{"lora_name", "lora_path"}`` when it was started with ``--enable-lora`` and
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``
(https://docs.vllm.ai/en/latest/features/lora.html#dynamically-serving-lora-adapters).
When a request names a configured adapter with a ``path`` and no routable replica of its
base model lists it, the gateway loads it on the least loaded routable one
(``routing.adapters.load_target``) before the request is queued; the request then goes
there like any other for that adapter.

One load per adapter at a time: concurrent requests wait for the load in flight, which no
one client leaving can cancel (it is shielded). Every load is bounded by
``upstream.adapter_load_timeout_s``. A load that failed is remembered for
``FAILED_LOAD_HOLD_S``: the requests of that window get its error at once, instead of each
sending the replicas a load of its own.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence

import orjson

from gateway.errors import GatewayError, NotFound, ServiceUnavailable
from gateway.upstream import UpstreamClient, UpstreamError
from replicas.replica import Replica
from routing.adapters import AdapterCatalog, AdapterSpec, load_target, serves

log = logging.getLogger("fleetgate.lora")

LOAD_PATH = "/v1/load_lora_adapter"
# How long a failed load's error answers the adapter's requests before another load is tried.
FAILED_LOAD_HOLD_S = 5.0
# vLLM's answer to a load of an adapter it already has (another gateway pod loaded it, or a
# listing has not shown it yet): as good as a load.
_ALREADY_LOADED = "has already been loaded"
# Enough of a replica's refusal to say why, in the client's error and the log.
_MESSAGE_CHARS = 300
# A load's answer is a line of text or a small JSON error: anything past this is not read.
_MAX_ANSWER_BYTES = 64 * 1024


class AdapterLoader:
    """The known adapters (``catalog``), and their loading on replicas (``ensure``)."""

    def __init__(
        self,
        catalog: AdapterCatalog,
        pools: Mapping[str, Sequence[Replica]],
        client: Callable[[], UpstreamClient],
        *,
        timeout_s: float,
        clock: Callable[[], float],
    ) -> None:
        self.catalog = catalog
        self._pools = pools
        self._client = client
        self._timeout_s = timeout_s
        self._clock = clock
        self._loading: dict[str, asyncio.Task[GatewayError | None]] = {}
        self._failed: dict[str, tuple[float, GatewayError]] = {}

    @property
    def loads(self) -> bool:
        """Whether any adapter can be loaded at all (one is configured with a path)."""
        return any(spec.path is not None for spec in self.catalog.configured.values())

    async def ensure(self, adapter: str, base: str) -> GatewayError | None:
        """None once a routable replica of ``base`` serves ``adapter``, or when no load can
        help (nothing to load it from, no routable replica: the proxy then answers 503);
        else the error that ends the request: the load failed or timed out."""
        replicas = self._pools[base]
        now = self._clock()
        if serves(replicas, adapter, now):
            return None
        spec = self.catalog.spec(adapter)
        if spec is None or spec.path is None:
            return None
        failed = self._failed.get(adapter)
        if failed is not None and now < failed[0]:
            return failed[1]
        task = self._loading.get(adapter)
        if task is None:
            task = asyncio.create_task(self._load(spec, replicas), name=f"load-adapter:{adapter}")
            self._loading[adapter] = task
            task.add_done_callback(lambda done: self._forget(adapter, done))
        return await asyncio.shield(task)

    def _forget(self, adapter: str, task: asyncio.Task[GatewayError | None]) -> None:
        if self._loading.get(adapter) is task:
            del self._loading[adapter]

    async def _load(self, spec: AdapterSpec, replicas: Sequence[Replica]) -> GatewayError | None:
        started = self._clock()
        target = load_target(replicas, started)
        if target is None:
            return None
        assert spec.path is not None
        body = orjson.dumps({"lora_name": spec.name, "lora_path": spec.path})
        headers = {"Content-Type": "application/json", **target.upstream_headers}
        try:
            status, _, answer, _ = await self._client().fetch(
                "POST",
                target.base_url + LOAD_PATH,
                body,
                headers,
                timeout_s=self._timeout_s,
                max_bytes=_MAX_ANSWER_BYTES,
            )
        except TimeoutError:
            err: GatewayError = _unavailable(
                spec.name, f"{target.id} did not load it within {self._timeout_s:g} s (upstream.adapter_load_timeout_s)"
            )
        except UpstreamError as exc:
            err = _unavailable(spec.name, f"{target.id} could not be reached ({type(exc).__name__})")
        else:
            message = _message(answer)
            if status == 200 or (status == 400 and _ALREADY_LOADED in message):
                target.adapters = target.adapters | {spec.name}
                log.info(
                    "adapter loaded",
                    extra={"adapter": spec.name, "replica": target.id, "load_s": round(self._clock() - started, 3)},
                )
                return None
            err = _refused(spec.name, target, status, answer, message)
        self._failed[spec.name] = (self._clock() + FAILED_LOAD_HOLD_S, err)
        log.warning("adapter load failed", extra={"adapter": spec.name, "replica": target.id, "error": err.message})
        return err


def _message(answer: bytes) -> str:
    """The replica's words: vLLM's error message, else its text."""
    try:
        parsed = orjson.loads(answer)
    except orjson.JSONDecodeError:
        return answer[:_MESSAGE_CHARS].decode(errors="replace")
    if isinstance(parsed, dict) and isinstance(parsed.get("error"), dict):
        return str(parsed["error"].get("message", ""))[:_MESSAGE_CHARS]
    if isinstance(parsed, dict) and "detail" in parsed:
        return str(parsed["detail"])[:_MESSAGE_CHARS]
    return str(parsed)[:_MESSAGE_CHARS]


def _refused(name: str, target: Replica, status: int, answer: bytes, message: str) -> GatewayError:
    """A refused load as the client's error.

    vLLM answers 404 in OpenAI's error envelope when nothing loadable is at the path: the
    adapter cannot exist until the configuration changes, a 404 like an unknown model's. A
    404 without that envelope is the route itself missing: the replica was started without
    runtime LoRA loading, which is the fleet's to fix, so a 503.
    """
    try:
        enveloped = isinstance(orjson.loads(answer).get("error"), dict)
    except (orjson.JSONDecodeError, AttributeError):
        enveloped = False
    if status == 404 and enveloped:
        return NotFound(f"The adapter '{name}' could not be loaded: {message}", code="adapter_not_found", param="model")
    if status == 404:
        why = f"{target.id} does not load adapters at run time (start it with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)"
        return _unavailable(name, why)
    return _unavailable(name, f"{target.id} answered {status}: {message}")


def _unavailable(name: str, why: str) -> ServiceUnavailable:
    return ServiceUnavailable(
        f"The adapter '{name}' could not be loaded: {why}.",
        code="adapter_load_failed",
        headers={"Retry-After": str(int(FAILED_LOAD_HOLD_S))},
    )
