"""How ``serve`` and ``route`` answer a request that fails: OpenAI's error
shape (:class:`~.protocol.APIError`) for every refusal, and nothing for a
client that has left.

* An :class:`~.protocol.APIError` becomes its status and body; 503 adds
  ``Retry-After``, and 408 (a body that never came whole) closes the connection.
* A ``ConnectionResetError`` while the body was read means the client left:
  there is no one to answer, and the log gets no traceback (status 499, nginx's
  "Client Closed Request", for the access log).
* ``serve`` also answers 400 for a ``ValueError`` or ``TypeError`` the engine
  raises on what the request checks let through; ``route`` does not (the
  backend checks its requests), so an error of its own stays a 500.
"""
from __future__ import annotations

from aiohttp import web

from .protocol import APIError


def error_response(e: APIError) -> web.Response:
    """``e`` in OpenAI's shape (the module doc)."""
    resp = web.json_response(e.body(), status=e.status, headers={"Retry-After": "1"} if e.status == 503 else None)
    if e.status == 408:
        resp.force_close()
    return resp


def error_middleware(refused: tuple[type[Exception], ...] = ()):
    """The middleware that answers failures as the module doc says; ``refused``:
    the exceptions a handler's callee raises for a bad request (answered 400)."""
    @web.middleware
    async def errors(request, handler):
        try:
            return await handler(request)
        except APIError as e:
            return error_response(e)
        except ConnectionResetError:
            return web.Response(status=499, reason="Client Closed Request")
        except refused as e:
            return error_response(APIError(str(e)))
    return errors
