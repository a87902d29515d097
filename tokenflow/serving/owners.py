"""Whose stream each engine request is: the API key that sent it, kept while it is in flight, so
that /v1/tokenflow/streams shows a tenant its own streams only (streams.py).

The engine knows nothing of keys: `Responder` claims each engine request for its key as it
submits it, and forgets it once the request is released (finished, aborted, refused or moved
to another replica).  A stream the engine still lists after that (an abort on its way) is then
nobody's: hidden from every tenant, never shown to the wrong one.
"""

from __future__ import annotations


class StreamOwners:
    """The bearer token of each engine request in flight (one event loop: no lock needed);
    requests sent without a token (an open server) are not kept."""

    def __init__(self) -> None:
        self._key_by_request_id: dict[str, str] = {}

    def claim(self, request_id: str, api_key: str | None) -> None:
        """Record that `api_key` sent engine request `request_id` (nothing for no key)."""
        if api_key is not None:
            self._key_by_request_id[request_id] = api_key

    def forget(self, request_id: str) -> None:
        """The request is released: it is nobody's any more (idempotent)."""
        self._key_by_request_id.pop(request_id, None)

    def is_owned_by(self, request_id: str, api_key: str | None) -> bool:
        """Whether `api_key` sent engine request `request_id`, still in flight (never for no
        key: a request sent without one is nobody's)."""
        return api_key is not None and self._key_by_request_id.get(request_id) == api_key

    @property
    def num_claimed(self) -> int:
        """Engine requests in flight with a key."""
        return len(self._key_by_request_id)
