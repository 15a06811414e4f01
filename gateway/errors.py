"""Every error the gateway can hand a client, written in the envelope of the API it was asked
(OpenAI's by default).

Hierarchy::

    GatewayError                      status, type, code, param; to_json(envelope) -> body
    ├── BadRequest           400      invalid_request_error (malformed JSON, wrong types...)
    ├── Unauthorized         401      invalid_api_key
    ├── Forbidden            403      permission denied (admin API, forced tier)
    ├── NotFound             404      model_not_found, unknown route
    ├── MethodNotAllowed     405      GET on a POST endpoint
    ├── RequestTimeout       408      the client's own body never arrived
    ├── PayloadTooLarge      413      body over ``server.max_body_bytes``
    ├── ExpectationFailed    417      an ``Expect`` header other than 100-continue
    ├── HeadersTooLarge      431      a header line too long, too many headers
    ├── RateLimited          429      rate_limit_exceeded / insufficient_quota / queue_full (+ Retry-After)
    ├── InternalError        500      a bug: logged with its traceback, never sent
    ├── BadGateway           502      every replica tried failed
    ├── ServiceUnavailable   503      no healthy replica, a limit store down with fail_closed,
    │                                 queue_timeout (every replica stayed busy; + Retry-After)
    └── GatewayTimeout       504      the upstream did not answer in time, deadline_exceeded

Library exceptions (aiohttp, redis, orjson) are translated where they are caught, with
``raise ... from exc``. The wire format is the API's: an error is written by the envelope of
the dialect that was asked (``dialects.envelopes``: OpenAI's by default, Anthropic's on
``/v1/messages``).
"""

from __future__ import annotations

from aiohttp import web

from dialects.envelopes import OPENAI, AnthropicErrors, OpenAIErrors

Envelope = OpenAIErrors | AnthropicErrors


class GatewayError(Exception):
    """An error with an HTTP status, written as a body in an API's error envelope."""

    status = 500
    type = "server_error"
    code: str | None = None

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        self.param = param
        self.headers = headers or {}

    def to_json(self, envelope: Envelope = OPENAI) -> bytes:
        """The error's body in ``envelope`` (OpenAI's: ``{"error": {"message", "type", "param", "code"}}``)."""
        return envelope.body(self.status, self.message, self.type, self.code, self.param)


def error_response(err: GatewayError, headers: dict[str, str], envelope: Envelope = OPENAI) -> web.Response:
    """The HTTP response for ``err``, with the caller's headers (request id...)."""
    return web.Response(
        status=err.status,
        body=err.to_json(envelope),
        content_type="application/json",
        headers={**headers, **err.headers},
    )


class BadRequest(GatewayError):
    status = 400
    type = "invalid_request_error"


class Unauthorized(GatewayError):
    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"


class Forbidden(GatewayError):
    status = 403
    type = "invalid_request_error"
    code = "permission_denied"


class NotFound(GatewayError):
    status = 404
    type = "invalid_request_error"
    code = "not_found"


class MethodNotAllowed(GatewayError):
    status = 405
    type = "invalid_request_error"
    code = "method_not_allowed"


class Conflict(GatewayError):
    status = 409
    type = "invalid_request_error"
    code = "conflict"


class RequestTimeout(GatewayError):
    status = 408
    type = "invalid_request_error"
    code = "request_timeout"


class PayloadTooLarge(GatewayError):
    status = 413
    type = "invalid_request_error"
    code = "request_too_large"


class ExpectationFailed(GatewayError):
    status = 417
    type = "invalid_request_error"
    code = "expectation_failed"


class HeadersTooLarge(GatewayError):
    status = 431
    type = "invalid_request_error"
    code = "headers_too_large"


class RateLimited(GatewayError):
    status = 429
    type = "rate_limit_error"
    code = "rate_limit_exceeded"


class InternalError(GatewayError):
    status = 500
    type = "server_error"
    code = "internal_error"


class BadGateway(GatewayError):
    status = 502
    type = "server_error"
    code = "upstream_error"


class ServiceUnavailable(GatewayError):
    status = 503
    type = "server_error"
    code = "service_unavailable"


class GatewayTimeout(GatewayError):
    status = 504
    type = "server_error"
    code = "upstream_timeout"
