"""`/v1/packages`: upload a working directory (a zip), look one up by its digest, share one.

Two steps, as Ray Jobs and container registries do it: the code is uploaded once and stored
by its content (`POST /v1/packages`, the zip as the raw body, `Content-Type:
application/zip`), then any number of job specs name it (`workload.package: "sha256:..."`).
`elastrain submit --working-dir DIR` does both, and skips the upload when
`GET /v1/packages/{digest}` says the service has that content already.

A package is the uploading tenant's: another tenant is told it does not exist (404 here,
422 naming `workload.package` at submit), exactly as for a digest nobody uploaded, unless an
admin shares it (`POST /v1/packages/{digest}/share`). An upload answers 201 when the
package is new *to this tenant*, so whether another tenant stored the same content stays
unknown to it. Uploads count against the tenant's storage quota.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Path, Request, status
from fastapi.responses import Response
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from elastrain.api.deps import AdminPrincipal, CurrentPrincipal, SessionDep, SettingsDep
from elastrain.api.schemas import PackageFileOut, PackageGrantOut, PackageOut, PackageShare
from elastrain.contracts.packages import DIGEST_RE, Manifest, PackageQuotaExceeded, PackageRefused
from elastrain.service import package_access, packages
from elastrain.service.auth import Principal
from elastrain.service.models import PackageGrant

log = logging.getLogger("elastrain.api")
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


def _out(manifest: Manifest, grants: list[PackageGrant] | None = None) -> PackageOut:
    return PackageOut(
        digest=manifest.digest,
        file_count=len(manifest.files),
        size_bytes=manifest.size_bytes,
        files=[PackageFileOut(path=f.path, size=f.size) for f in manifest.files],
        grants=None if grants is None else [_grant_out(g) for g in grants],
    )


def _grant_out(row: PackageGrant) -> PackageGrantOut:
    return PackageGrantOut(
        tenant=row.tenant,
        uploaded=row.uploaded,
        size_bytes=row.size_bytes,
        granted_by=row.granted_by,
        created_at=row.created_at,
    )


def _quota_exceeded(tenant: str, quota: int, used: int) -> HTTPException:
    return HTTPException(
        status.HTTP_413_CONTENT_TOO_LARGE,
        f"package: tenant {tenant}'s uploads take {used} of its {quota} bytes "
        "(ELASTRAIN_PACKAGE_QUOTA_BYTES); packages no unfinished job uses are deleted after "
        "ELASTRAIN_PACKAGE_KEEP_DAYS",
    )


def _record_upload(session: Session, who: Principal, manifest: Manifest, quota: int | None) -> bool:
    """Grant the uploader its package (True: new to it), within its quota."""
    new = package_access.record_upload(session, manifest.digest, who.tenant, manifest.size_bytes)
    if new and quota is not None:
        # Checked again with the row in: two uploads at once each saw the quota's room.
        used = package_access.uploaded_bytes(session, who.tenant)
        if used > quota:
            session.rollback()
            raise _quota_exceeded(who.tenant, quota, used - manifest.size_bytes)
    session.commit()
    return new


@router.post(
    "",
    response_model=PackageOut,
    status_code=status.HTTP_201_CREATED,
    summary="Upload a working directory as a zip (201 stored, 200 you had it already)",
    responses={
        200: {"description": "This tenant had uploaded the same content already"},
        413: {"description": "Larger than ELASTRAIN_MAX_PACKAGE_BYTES, or past the quota"},
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
async def upload_package(
    request: Request, who: CurrentPrincipal, session: SessionDep, settings: SettingsDep
) -> Response:
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type not in ZIP_TYPES:
        raise HTTPException(
            status.HTTP_415_UNSUPPORTED_MEDIA_TYPE,
            f"send the working directory as a zip with Content-Type: application/zip "
            f"(got {content_type[:60] or 'none'!r})",
        )
    quota = settings.package_quota_bytes
    quota_left = None
    if quota is not None:
        used = await run_in_threadpool(package_access.uploaded_bytes, session, who.tenant)
        if used >= quota:
            raise _quota_exceeded(who.tenant, quota, used)
        quota_left = quota - used
    storage = settings.storage_path
    archive = packages.incoming_path(storage, ".zip")
    try:
        # Spooled to disk under the storage root as it arrives (the request guard counts
        # the bytes and stops at the limit), then checked and unpacked off the event loop,
        # counting what it inflates to against the limits and the quota as it goes.
        with open(archive, "wb") as out:
            async for chunk in request.stream():
                out.write(chunk)
        manifest, _ = await run_in_threadpool(
            packages.store_archive,
            archive,
            storage,
            settings.package_limits,
            quota_left=quota_left,
        )
    except PackageQuotaExceeded as exc:
        raise HTTPException(status.HTTP_413_CONTENT_TOO_LARGE, f"package: {exc}") from exc
    except PackageRefused as exc:
        raise HTTPException(422, f"package: {exc}") from exc
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(archive)
    new = await run_in_threadpool(_record_upload, session, who, manifest, quota)
    if new:
        log.info(
            "package %s uploaded by tenant %s: %d files, %d bytes",
            manifest.digest,
            who.tenant,
            len(manifest.files),
            manifest.size_bytes,
        )
    return Response(
        _out(manifest).model_dump_json(),
        status_code=status.HTTP_201_CREATED if new else status.HTTP_200_OK,
        media_type="application/json",
        headers={"Location": f"/v1/packages/{manifest.digest}"},
    )


_NOT_FOUND: dict[int | str, dict[str, Any]] = {404: {"description": "No package has that digest"}}


def _visible_manifest(session: Session, digest: str, who: Principal, storage: Any) -> Manifest:
    """The package if `who` may see it; otherwise the same 404 as for no package at all."""
    manifest = packages.load_manifest(storage, digest)
    if manifest is None or not package_access.visible(session, digest, who):
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no package {digest}")
    return manifest


@router.get(
    "/{digest}",
    response_model=PackageOut,
    summary="A stored working directory you may use: its files and sizes",
    responses=_NOT_FOUND,
)
def get_package(
    digest: Digest, who: CurrentPrincipal, session: SessionDep, settings: SettingsDep
) -> PackageOut:
    manifest = _visible_manifest(session, digest, who, settings.storage_path)
    return _out(manifest, list(package_access.grants(session, digest)) if who.admin else None)


@router.post(
    "/{digest}/share",
    response_model=PackageOut,
    summary="Let a tenant (or '*': every tenant) use a package (admin)",
    responses=_NOT_FOUND,
)
def share_package(
    digest: Digest,
    body: PackageShare,
    who: AdminPrincipal,
    session: SessionDep,
    settings: SettingsDep,
) -> PackageOut:
    manifest = _visible_manifest(session, digest, who, settings.storage_path)
    package_access.share(session, digest, body.tenant, by=who.tenant)
    session.commit()
    log.info("package %s shared with %s by %s", digest, body.tenant, who.tenant)
    return _out(manifest, list(package_access.grants(session, digest)))


@router.delete(
    "/{digest}/share/{name}",
    status_code=status.HTTP_204_NO_CONTENT,
    summary="Withdraw a share (admin; the uploader's own access stays)",
    responses=_NOT_FOUND,
)
def unshare_package(
    digest: Digest,
    name: Annotated[
        str,
        Path(pattern=r"^(\*|[A-Za-z0-9][A-Za-z0-9_.\-]{0,62})$", description="The tenant, or '*'."),
    ],
    who: AdminPrincipal,
    session: SessionDep,
    settings: SettingsDep,
) -> Response:
    _visible_manifest(session, digest, who, settings.storage_path)
    if package_access.unshare(session, digest, name):
        log.info("package %s no longer shared with %s (by %s)", digest, name, who.tenant)
    session.commit()
    return Response(status_code=status.HTTP_204_NO_CONTENT)
