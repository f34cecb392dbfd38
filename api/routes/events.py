"""/v1/jobs/{id}/events: Server-Sent Events from the job_events table (trial finished, new best,
done). Reconnecting clients send Last-Event-ID and miss nothing."""

from __future__ import annotations

import asyncio
import json
from typing import Annotated

from fastapi import Header, Query, Request
from fastapi.responses import StreamingResponse
from sqlalchemy import select

from api.deps import ReadAuth, SessionDep, SettingsDep
from api.errors import ApiError
from api.routes import v1_router
from api.schemas import JobId
from tuner.db import FINAL_STATES, Job, JobEvent, session_scope

router = v1_router("/jobs", tags=["jobs"])  # errors: api/errors.py's `document_errors`

POLL_S = 0.5
KEEPALIVE_S = 15.0


def _frame(ev: JobEvent) -> str:
    data = json.dumps({"job_id": ev.job_id, "kind": ev.kind, **ev.payload}, default=str)
    return f"id: {ev.id}\nevent: {ev.kind}\ndata: {data}\n\n"


def _fetch(url: str, job_id: int, after: int) -> tuple[list[JobEvent], str | None]:
    with session_scope(url) as s:
        # State first: a final state read here guarantees its `done` event (same commit) is seen below.
        state = s.scalar(select(Job.state).where(Job.id == job_id))
        events = list(
            s.scalars(
                select(JobEvent)
                .where(JobEvent.job_id == job_id, JobEvent.id > after)
                .order_by(JobEvent.id)
                .limit(200)
            )
        )
    return events, state


@router.get(
    "/{job_id}/events",
    response_class=StreamingResponse,
    responses={200: {"content": {"text/event-stream": {}}, "description": "An SSE stream."}},
)
def read_events(
    job_id: JobId,
    request: Request,
    session: SessionDep,
    settings: SettingsDep,
    _: ReadAuth,
    # A string, not `str | None`: a header is absent or text, and a nullable schema has clients
    # send the text "null".
    last_event_id: Annotated[str, Header(pattern=r"^[0-9]{0,18}$")] = "",
    after: Annotated[
        int | None, Query(ge=0, le=2**62, description="Same as Last-Event-ID, for clients without headers.")
    ] = None,
):
    """Follow a job: `trial_started`, `trial_finished`, `new_best`, `state`, `done` events.
    The stream ends after `done`."""
    if session.get(Job, job_id) is None:
        raise ApiError(404, f"job {job_id} not found", [("id", "no such job")])
    start = int(last_event_id) if last_event_id else (after or 0)
    url = settings.database_url

    async def stream():
        last, idle = start, 0.0
        while not await request.is_disconnected():
            events, state = await asyncio.to_thread(_fetch, url, job_id, last)
            for ev in events:
                last = ev.id
                yield _frame(ev)
                if ev.kind == "done":
                    return
            if not events and state in FINAL_STATES:
                return  # finished before `done` events existed; nothing more will come
            if events:
                idle = 0.0
                continue
            await asyncio.sleep(POLL_S)
            idle += POLL_S
            if idle >= KEEPALIVE_S:
                idle = 0.0
                yield ": keep-alive\n\n"

    return StreamingResponse(
        stream(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
