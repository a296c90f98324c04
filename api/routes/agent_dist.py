"""GET /install.sh and /agent.tar.gz: what a phone fetches before it has any token."""

from __future__ import annotations

import hashlib

from fastapi import APIRouter, Request, Response
from starlette.concurrency import run_in_threadpool

from agent import release
from api import agent_dist

router = APIRouter(tags=["agent"])


def _send(request: Request, body: bytes, media_type: str, filename: str,
          extra: dict[str, str] | None = None) -> Response:
    etag = '"' + hashlib.sha256(body).hexdigest()[:32] + '"'
    headers = {"ETag": etag, "Content-Disposition": f'attachment; filename="{filename}"',
               **(extra or {})}
    if request.headers.get("if-none-match") == etag:
        return Response(status_code=304, headers=headers)
    return Response(body, media_type=media_type, headers=headers)


@router.get("/install.sh", response_class=Response)
async def get_install_script(request: Request) -> Response:
    """The Termux installer (public: it holds no secret; the enrollment token is its argument)."""
    body = await run_in_threadpool(agent_dist.install_script)
    return _send(request, body, "text/x-shellscript", "install.sh")


@router.get("/agent.tar.gz", response_class=Response)
async def get_agent_archive(request: Request) -> Response:
    """The agent's sources matching this server, for `pip install SERVER/agent.tar.gz`, with
    this server's release key inside (`agent/release_key.json`) and the build's signature in
    the `X-Phalanx-Release-Signature` header (hex Ed25519 over agent.release.release_message:
    what an agent checks before it installs an upgrade)."""
    build = await run_in_threadpool(agent_dist.served, request.app.state.settings.data_dir)
    return _send(request, build.archive, "application/gzip", "agent.tar.gz",
                 {release.SIGNATURE_HEADER: build.signature,
                  release.KEY_HEADER: build.public_key})
