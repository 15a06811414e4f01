"""Stored OpenAI Responses: what ``store: true`` keeps, per tenant, for ``/v1/responses``.

A stored record (the response and the full input that produced it, as JSON the gateway
makes) is what ``GET``/``DELETE /v1/responses/{id}`` read and what ``previous_response_id``
expands into, so any replica can continue a conversation and any gateway pod can serve it.
``store`` is the interface, ``memory_store`` the embedded default, ``redis_store`` the one
every gateway pod shares; ``factory`` picks one from ``redis_url``.
"""
