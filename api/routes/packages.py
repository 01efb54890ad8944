"""`/v1/packages`: upload a working directory (a zip), look one up by its digest.

Two steps, as Ray Jobs and container registries do it: the code is uploaded once and stored
by its content (`POST /v1/packages`, the zip as the raw body, `Content-Type:
application/zip`), then any number of job specs name it (`workload.package: "sha256:..."`).
`elastrain submit --working-dir DIR` does both, and skips the upload when
`GET /v1/packages/{digest}` says the service has that content already.
"""

from __future__ import annotations

import contextlib
import os
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Path, Request, status
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from api.deps import CurrentPrincipal, SettingsDep
from api.schemas import PackageFileOut, PackageOut
from contracts.packages import DIGEST_RE, Manifest, PackageRefused
from service import packages

router = APIRouter(prefix="/v1/packages", tags=["packages"])

ZIP_TYPES = ("application/zip", "application/x-zip-compressed")
Digest = Annotated[
    str,
    Path(
        pattern=DIGEST_RE.pattern,
        description="'sha256:' followed by 64 lowercase hex digits.",
        max_length=71,
    ),
]


def _out(manifest: Manifest) -> PackageOut:
    return PackageOut(
        digest=manifest.digest,
        file_count=len(manifest.files),
        size_bytes=manifest.size_bytes,
        files=[PackageFileOut(path=f.path, size=f.size) for f in manifest.files],
    )


@router.post(
    "",
    response_model=PackageOut,
    status_code=status.HTTP_201_CREATED,
    summary="Upload a working directory as a zip (201 stored, 200 already there)",
    responses={
        200: {"description": "The same content was stored already"},
        413: {"description": "Larger than ELASTRAIN_MAX_PACKAGE_BYTES"},
        415: {"description": "Not application/zip"},
        422: {"description": "Not a zip, or an unsafe or oversized member; `detail` says which"},
    },
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {"application/zip": {"schema": {"type": "string", "format": "binary"}}},
        }
    },
)
async def upload_package(request: Request, _: CurrentPrincipal, settings: SettingsDep) -> Response:
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type not in ZIP_TYPES:
        raise HTTPException(
            status.HTTP_415_UNSUPPORTED_MEDIA_TYPE,
            f"send the working directory as a zip with Content-Type: application/zip "
            f"(got {content_type[:60] or 'none'!r})",
        )
    storage = settings.storage_path
    archive = packages.incoming_path(storage, ".zip")
    try:
        # Spooled to disk under the storage root as it arrives (the request guard counts
        # the bytes and stops at the limit), then checked and unpacked off the event loop.
        with open(archive, "wb") as out:
            async for chunk in request.stream():
                out.write(chunk)
        manifest, created = await run_in_threadpool(
            packages.store_archive, archive, storage, settings.package_limits
        )
    except PackageRefused as exc:
        raise HTTPException(422, f"package: {exc}") from exc
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(archive)
    code = status.HTTP_201_CREATED if created else status.HTTP_200_OK
    return Response(
        _out(manifest).model_dump_json(),
        status_code=code,
        media_type="application/json",
        headers={"Location": f"/v1/packages/{manifest.digest}"},
    )


_NOT_FOUND: dict[int | str, dict[str, Any]] = {404: {"description": "No package has that digest"}}


@router.get(
    "/{digest}",
    response_model=PackageOut,
    summary="A stored working directory: its files and sizes",
    responses=_NOT_FOUND,
)
def get_package(digest: Digest, _: CurrentPrincipal, settings: SettingsDep) -> PackageOut:
    manifest = packages.load_manifest(settings.storage_path, digest)
    if manifest is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no package {digest}")
    return _out(manifest)
