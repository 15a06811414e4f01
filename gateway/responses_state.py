"""Stored Responses: the gateway keeps them, so any replica and any gateway pod can continue a
conversation (``/v1/responses`` with ``previous_response_id``) and serve ``GET``/``DELETE``.

``ResponseState`` is the Responses path's ``recall`` stage and owns all of it: the recall,
the keeping of the answer, the answer's rewrite, the cancel of a stream under way, and the
retrieval endpoints.

vLLM keeps a response only with ``VLLM_ENABLE_RESPONSES_API_STORE=1``, in one process's
memory, without eviction; a fleet behind a gateway cannot rely on it. So:

- before a request is classified, routed and admitted, the stage expands its
  ``previous_response_id`` into the full input (the stored turn's input, its output, then
  the new input): the replica sees a plain request, the prefix it shares with the last turn
  keeps the conversation on the replica that holds its KV blocks, and limits count the whole
  prompt. An id the tenant cannot read is a 404; a store that cannot answer is a 503, never
  a silently shorter context;
- when the client asked to store (``store``, true by default as in OpenAI's API), the final
  answer is kept (``keep``, by the stage's ``Tap``) *before* the client sees its end, so the
  next turn, sent the moment this one ends, finds it on any pod. A store that fails then
  follows the tenant's ``limits.on_store_failure``: ``fail_open`` answers all the same (not
  kept), ``fail_closed`` answers 503 (a stream ends with an error event instead of its last
  event);
- records are the tenant's alone (``conversations``): another tenant's id reads as unknown.

What is kept, per response: the whole input it was given (expanded) and the response object
(output and usage), for ``responses.ttl_s``, within ``responses.max_bytes_per_tenant``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import orjson
from aiohttp import web

from conversations.config import ResponsesSettings
from conversations.store import RecordTooLarge, ResponseStore, StoreUnavailableError
from dialects.responses import echo_previous, input_items
from gateway.errors import BadRequest, GatewayError, NotFound, ServiceUnavailable
from gateway.exchange import Exchange, Tap
from gateway.metrics import GatewayMetrics
from gateway.request import parse_call
from gateway.settings import TenantSettings

log = logging.getLogger("fleetgate.responses")


class ResponseState:
    """The gateway's side of stored responses: the ``recall`` stage (expand, keep, rewrite,
    cancel) and the retrieval endpoints."""

    name = "recall"

    def __init__(self, store: ResponseStore, settings: ResponsesSettings, metrics: GatewayMetrics) -> None:
        self.store = store
        self.settings = settings
        self.metrics = metrics
        # Streams under way in this process, by (tenant, response id): the response as its
        # first event announced it, and what stops it.
        self._running: dict[tuple[str, str], tuple[dict[str, Any], Callable[[], None]]] = {}

    async def __aenter__(self) -> ResponseState:
        await self.store.__aenter__()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.store.close()

    # -- the request path -------------------------------------------------------------------

    async def __call__(self, ex: Exchange, request: web.Request) -> None:
        """The stage: ``ex.call`` with its ``previous_response_id`` expanded, and
        ``ex.chain`` the conversation's id (its first response's; None for a first turn), a
        session key for routing. The tap it installs keeps the answer (unless the client
        asked not to store it), puts the previous id back in it, and makes a stream
        cancellable while it runs."""
        tenant = ex.tenant
        assert tenant is not None
        call = ex.call
        body = call.body
        previous = body.get("previous_response_id")
        items = input_items(body)
        if previous is not None:
            record = await self._read(tenant.id, previous, "previous_response_id")
            history = [*record.get("input", ()), *_output_items(record.get("response"))]
            items = [*history, *items]
            ex.call = parse_call(call.dialect, orjson.dumps({**body, "input": items}))
            kept = record.get("chain")  # records kept before chains were: the previous id
            ex.chain = kept if isinstance(kept, str) else previous
        keep = body.get("store") is not False
        if keep or previous is not None or call.stream:
            tap = _ResponseTap(self, tenant, items, previous, ex.chain, keep)
            ex.taps = (*ex.taps, tap)
            if call.stream:
                ex.release(tap.forget)

    async def keep(
        self,
        tenant: TenantSettings,
        items: list[Any],
        previous: str | None,
        chain: str | None,
        final: dict[str, Any] | None,
    ) -> GatewayError | None:
        response_id = final.get("id") if final is not None else None
        if final is None or not isinstance(response_id, str):
            self._count("put", "no_answer")
            return None
        stored = {**final, "store": True, "previous_response_id": previous}
        record = orjson.dumps({"input": items, "response": stored, "chain": chain or response_id})
        if len(record) > self.settings.max_record_bytes:
            self._count("put", "too_large")
            log.warning("a response too large to store was not kept", extra={"tenant": tenant.id, "bytes": len(record)})
            return None
        try:
            await self.store.put(
                tenant.id, response_id, record, self.settings.ttl_s, self.settings.max_bytes_per_tenant
            )
        except RecordTooLarge:
            self._count("put", "too_large")
            return None
        except StoreUnavailableError as exc:
            self._count("put", "unavailable")
            if tenant.limits.on_store_failure == "fail_closed":
                return ServiceUnavailable(
                    f"The response could not be stored ({exc.reason}); it is not returned (fail_closed).",
                    code="response_store_unavailable",
                )
            log.warning("a response could not be stored (fail_open)", extra={"tenant": tenant.id})
            return None
        self._count("put", "ok")
        return None

    def track(self, tenant_id: str, response: dict[str, Any], stop: Callable[[], None]) -> tuple[str, str] | None:
        """A stream of ``tenant_id``'s made cancellable once its id is known; the key that
        forgets it again (``untrack``)."""
        response_id = response.get("id")
        if not isinstance(response_id, str):
            return None
        key = (tenant_id, response_id)
        self._running[key] = (response, stop)
        return key

    def untrack(self, key: tuple[str, str]) -> None:
        self._running.pop(key, None)

    # -- the retrieval endpoints ------------------------------------------------------------

    async def retrieve(self, tenant: TenantSettings, response_id: str) -> web.Response:
        """``GET /v1/responses/{id}``: the stored response object."""
        record = await self._read(tenant.id, response_id)
        return web.json_response(record.get("response"), dumps=_dumps)

    async def input_items(self, tenant: TenantSettings, response_id: str) -> web.Response:
        """``GET /v1/responses/{id}/input_items``: the input it was given, expanded, in a list."""
        record = await self._read(tenant.id, response_id)
        items = [
            {**item, "id": item.get("id") or f"{response_id}_in_{i}"} if isinstance(item, dict) else item
            for i, item in enumerate(record.get("input", ()))
        ]
        page = {
            "object": "list",
            "data": items,
            "first_id": items[0]["id"] if items else None,
            "last_id": items[-1]["id"] if items else None,
            "has_more": False,
        }
        return web.json_response(page, dumps=_dumps)

    async def delete(self, tenant: TenantSettings, response_id: str) -> web.Response:
        """``DELETE /v1/responses/{id}``."""
        try:
            deleted = await self.store.delete(tenant.id, response_id)
        except StoreUnavailableError as exc:
            self._count("delete", "unavailable")
            raise _unavailable(exc) from exc
        self._count("delete", "ok" if deleted else "not_found")
        if not deleted:
            raise _not_found(response_id)
        return web.json_response({"id": response_id, "object": "response", "deleted": True}, dumps=_dumps)

    async def cancel(self, tenant: TenantSettings, response_id: str) -> web.Response:
        """``POST /v1/responses/{id}/cancel``: a stream under way in this process stops (its
        client's stream ends with a ``response_cancelled`` error event) and the response is
        answered with status ``cancelled``; a finished one cannot be cancelled (400), an
        unknown one, or another tenant's, is a 404."""
        running = self._running.get((tenant.id, response_id))
        if running is not None:
            response, stop = running
            stop()
            return web.json_response({**response, "status": "cancelled"}, dumps=_dumps)
        await self._read(tenant.id, response_id)
        raise BadRequest(
            "This response has finished: only a response still being generated can be cancelled.",
            code="response_not_cancellable",
        )

    async def _read(self, tenant: str, response_id: str, param: str | None = None) -> dict[str, Any]:
        try:
            raw = await self.store.get(tenant, response_id)
        except StoreUnavailableError as exc:
            self._count("get", "unavailable")
            raise _unavailable(exc) from exc
        if raw is None:
            self._count("get", "not_found")
            raise _not_found(response_id, param)
        self._count("get", "ok")
        record = orjson.loads(raw)
        assert isinstance(record, dict)
        return record

    def _count(self, op: str, outcome: str) -> None:
        self.metrics.responses_store.labels(op, outcome).inc()


class _ResponseTap(Tap):
    """One Responses request's answer on its way out: kept before its end reaches the client
    (when asked), its ``previous_response_id`` put back, its stream cancellable meanwhile."""

    __slots__ = ("_chain", "_items", "_keep", "_previous", "_rewrite", "_state", "_tenant", "_tracked")

    def __init__(
        self,
        state: ResponseState,
        tenant: TenantSettings,
        items: list[Any],
        previous: str | None,
        chain: str | None,
        keep: bool,
    ) -> None:
        self._state = state
        self._tenant = tenant
        self._items = items
        self._previous = previous
        self._chain = chain
        self._keep = keep
        self._rewrite = echo_previous(previous) if previous is not None else None
        self._tracked: tuple[str, str] | None = None

    def started(self, answer: dict[str, Any], stop: Callable[[], None]) -> None:
        self._tracked = self._state.track(self._tenant.id, answer, stop)

    def forget(self, _: BaseException | None) -> None:
        if self._tracked is not None:
            self._state.untrack(self._tracked)
            self._tracked = None

    async def ending(self, final: dict[str, Any] | None) -> GatewayError | None:
        if not self._keep:
            return None
        self._keep = False  # once, whoever asks (a replay, then never the proxy)
        return await self._state.keep(self._tenant, self._items, self._previous, self._chain, final)

    def events(self, out: bytes) -> bytes:
        return self._rewrite(out) if self._rewrite is not None else out

    def body(self, body: bytes) -> bytes:
        return self._rewrite(body) if self._rewrite is not None else body


def _output_items(response: Any) -> list[Any]:
    """A stored response's output, as input items for the next turn."""
    output = response.get("output") if isinstance(response, dict) else None
    return [item for item in output if isinstance(item, dict)] if isinstance(output, list) else []


def _not_found(response_id: str, param: str | None = None) -> NotFound:
    what = "Previous response" if param else "Response"
    return NotFound(f"{what} with id '{response_id}' not found.", code="response_not_found", param=param)


def _unavailable(exc: StoreUnavailableError) -> ServiceUnavailable:
    return ServiceUnavailable(
        f"The response store cannot be reached ({exc.reason}); the stored conversation cannot be read.",
        code="response_store_unavailable",
        headers={"Retry-After": "1"},
    )


def _dumps(value: Any) -> str:
    return orjson.dumps(value).decode()
