"""The Batch API's HTTP routes: `/v1/files` (upload a JSONL of requests, read, list, delete) and
`/v1/batches` (create, poll, list, cancel), in OpenAI's shapes (openai-python `types/batch.py`,
`types/file_object.py`). The handlers only translate; the files and batches live in Redis
(gateway.batch.files, .store) and any replica's runner duty runs a batch (gateway.batch.runner).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict
from redis.exceptions import RedisError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.batch.files import ENDPOINTS, MAX_REPORTED, PURPOSES, LineErrors, owner_of, parse_lines
from gateway.batch.store import FINAL
from gateway.openai.errors import APIError
from gateway.openai.front import HttpFront
from gateway.openai.schema import json_object, validated
from shared.errors import ErrorCode

MULTIPART_SLACK = 64 * 1024      # the form's boundaries and fields around the file's bytes


class BatchBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    input_file_id: str
    endpoint: str
    completion_window: Literal["24h"]
    metadata: dict[str, str] | None = None
    output_expires_after: dict | None = None      # accepted; outputs live BATCH_FILE_TTL_S here


def _not_found(kind: str, object_id: str) -> APIError:
    return APIError(404, f"No such {kind} object: {object_id}", code="not_found", param="id")


async def _owner(request: Request) -> tuple[HttpFront, str]:
    front = HttpFront.of(request)
    return front, owner_of(front.identify(request))


def _handled(handler):
    """APIError -> its response; Redis away -> 503 backend_unavailable (OpenAI's shape both)."""
    async def route(request: Request) -> Response:
        try:
            return await handler(request)
        except APIError as exc:
            return exc.response()
        except (RedisError, OSError):
            return APIError.from_code(ErrorCode.BACKEND_UNAVAILABLE, "the backend (Redis) is unavailable").response()
    return route


def _limit(request: Request, default: int, most: int) -> int:
    raw = request.query_params.get("limit", str(default))
    if not raw.isdigit() or not 1 <= int(raw) <= most:
        raise APIError(400, f"'limit' must be 1 to {most}", param="limit")
    return int(raw)


def _listing(data: list[dict], more: bool) -> JSONResponse:
    return JSONResponse({"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                         "last_id": data[-1]["id"] if data else None, "has_more": more})


# ---- files -------------------------------------------------------------------------------------

@_handled
async def upload_file(request: Request) -> Response:
    front, owner = await _owner(request)
    front.check_open()
    most = front.settings.batch_file_max_bytes
    too_large = APIError(413, f"the file exceeds the limit of {most} bytes (BATCH_FILE_MAX_BYTES)",
                         code="file_too_large", param="file")
    if int(request.headers.get("content-length") or 0) > most + MULTIPART_SLACK:
        raise too_large
    try:
        form = await request.form(max_files=1, max_fields=8)
    except Exception as exc:            # not multipart, or a malformed form (Starlette raises several kinds)
        raise APIError(400, f"expected a multipart/form-data body with 'file' and 'purpose': {exc}") from None
    try:
        purpose, upload = form.get("purpose"), form.get("file")
        if purpose != "batch":
            raise APIError(400, f"'purpose' must be \"batch\" (the only purpose this server accepts), not {purpose!r}",
                           param="purpose", code="unsupported_parameter")
        if upload is None or isinstance(upload, str):
            raise APIError(400, "'file' must be an uploaded file", param="file")
        data = await upload.read(most + 1)
        filename = upload.filename or "batch.jsonl"
    finally:
        await form.close()
    if len(data) > most:
        raise too_large
    try:
        parse_lines(data, front.settings.batch_max_lines)
    except LineErrors as exc:
        named = exc.errors[:MAX_REPORTED]
        more = f" (and {len(exc.errors) - len(named)} more)" if len(exc.errors) > len(named) else ""
        error = APIError(400, "; ".join(e["message"] for e in named) + more, param="file", code="invalid_batch_file")
        return JSONResponse({"error": {**error.body()["error"], "lines": exc.errors}}, status_code=400)
    return JSONResponse(await front.files.create(owner, filename=filename, purpose=purpose, data=data))


@_handled
async def list_files(request: Request) -> Response:
    front, owner = await _owner(request)
    purpose = request.query_params.get("purpose")
    if purpose is not None and purpose not in PURPOSES:
        raise APIError(400, f"'purpose' must be one of {', '.join(PURPOSES)}", param="purpose")
    data, more = await front.files.list(owner, after=request.query_params.get("after"),
                                        limit=_limit(request, 100, 10_000), purpose=purpose)
    return _listing(data, more)


@_handled
async def get_file(request: Request) -> Response:
    front, owner = await _owner(request)
    file_id = request.path_params["id"]
    meta = await front.files.get(owner, file_id)
    if meta is None:
        raise _not_found("File", file_id)
    return JSONResponse(meta)


@_handled
async def file_content(request: Request) -> Response:
    front, owner = await _owner(request)
    file_id = request.path_params["id"]
    data = await front.files.content(owner, file_id)
    if data is None:
        raise _not_found("File", file_id)
    return Response(data, media_type="application/jsonl")


@_handled
async def delete_file(request: Request) -> Response:
    front, owner = await _owner(request)
    file_id = request.path_params["id"]
    if not await front.files.delete(owner, file_id):
        raise _not_found("File", file_id)
    return JSONResponse({"id": file_id, "object": "file", "deleted": True})


# ---- batches -----------------------------------------------------------------------------------

@_handled
async def create_batch(request: Request) -> Response:
    front, owner = await _owner(request)
    front.check_open()
    body = validated(BatchBody, json_object(await request.body()))
    if body.endpoint not in ENDPOINTS:
        raise APIError(400, f"'endpoint' must be one of {', '.join(ENDPOINTS)}", param="endpoint")
    if body.metadata is not None and len(body.metadata) > 16:
        raise APIError(400, "'metadata' holds at most 16 pairs", param="metadata")
    meta = await front.files.get(owner, body.input_file_id)
    if meta is None:
        raise _not_found("File", body.input_file_id)
    if meta["purpose"] != "batch":
        raise APIError(400, f"file {body.input_file_id} has purpose {meta['purpose']!r}, not \"batch\"",
                       param="input_file_id")
    return JSONResponse(await front.batches.create(owner, input_file_id=body.input_file_id, endpoint=body.endpoint,
                                                   completion_window=body.completion_window,
                                                   metadata=body.metadata))


@_handled
async def get_batch(request: Request) -> Response:
    front, owner = await _owner(request)
    batch_id = request.path_params["id"]
    batch = await front.batches.get(owner, batch_id)
    if batch is None:
        raise _not_found("Batch", batch_id)
    return JSONResponse(batch)


@_handled
async def list_batches(request: Request) -> Response:
    front, owner = await _owner(request)
    data, more = await front.batches.list(owner, after=request.query_params.get("after"),
                                          limit=_limit(request, 20, 100))
    return _listing(data, more)


@_handled
async def cancel_batch(request: Request) -> Response:
    """validating / in_progress -> cancelling; the runner cancels what is in flight, then -> cancelled."""
    front, owner = await _owner(request)
    batch_id = request.path_params["id"]
    batch = await front.batches.get(owner, batch_id)
    if batch is None:
        raise _not_found("Batch", batch_id)
    if batch["status"] in (*FINAL, "finalizing"):
        raise APIError(409, f"Cannot cancel a batch with status '{batch['status']}'.", code="batch_not_cancellable")
    await front.batches.move(batch_id, "cancelling", when=("validating", "in_progress"))
    return JSONResponse(await front.batches.get(owner, batch_id))


ROUTES = [
    Route("/v1/files", upload_file, methods=["POST"]),
    Route("/v1/files", list_files, methods=["GET"]),
    Route("/v1/files/{id}", get_file, methods=["GET"]),
    Route("/v1/files/{id}", delete_file, methods=["DELETE"]),
    Route("/v1/files/{id}/content", file_content, methods=["GET"]),
    Route("/v1/batches", create_batch, methods=["POST"]),
    Route("/v1/batches", list_batches, methods=["GET"]),
    Route("/v1/batches/{id}", get_batch, methods=["GET"]),
    Route("/v1/batches/{id}/cancel", cancel_batch, methods=["POST"]),
]
