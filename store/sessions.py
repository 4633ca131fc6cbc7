"""Chat sessions: the turns of a tenant's conversation and the worker holding its prefix.

A session is the tenant's: every lookup and write names the tenant with the id, so
another tenant's use of the same id is another session (nothing to refuse or leak).
"""

from __future__ import annotations

from sqlalchemy import Connection, func, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from store.clock import utcnow
from store.database import Database
from store.models import ChatSession
from store.records import SessionRecord, session_record


class Sessions:
    def __init__(self, db: Database) -> None:
        self.db = db

    def touch_session(self, session_id: str, tenant_id: int, worker: str | None) -> int:
        """Count one more turn of the tenant's chat session (created on first use); returns
        the turn. worker, when given, becomes the session's last worker (for affinity)."""
        with self.db.write() as session:
            return count_turn(session, self.db.dialect, session_id, tenant_id, worker)

    def set_session_worker(self, session_id: str, tenant_id: int, worker: str) -> None:
        """The worker that now holds the tenant's session's prefix (session affinity)."""
        stmt = (update(ChatSession)
                .where(ChatSession.tenant_id == tenant_id, ChatSession.id == session_id)
                .values(last_worker=worker))
        with self.db.write() as session:
            session.execute(stmt)

    def get_session(self, session_id: str, tenant_id: int) -> SessionRecord | None:
        """The tenant's session of this id; None when the tenant has none (another tenant's
        session of the same id is not this one)."""
        with self.db.read() as session:
            chat = session.get(ChatSession, (tenant_id, session_id))
            return session_record(chat) if chat is not None else None


def count_turn(session: Session | Connection, dialect: str, session_id: str, tenant_id: int,
               worker: str | None) -> int:
    """Sessions.touch_session inside the caller's transaction (a job's insert counts its
    session's turn in its own: store/jobs.py)."""
    insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
    stmt = insert(ChatSession).values(
        id=session_id, tenant_id=tenant_id, turns=1, last_worker=worker, last_seen=utcnow()
    )
    stmt = stmt.on_conflict_do_update(
        index_elements=[ChatSession.tenant_id, ChatSession.id],
        set_={
            "turns": ChatSession.turns + 1,
            "last_worker": func.coalesce(stmt.excluded.last_worker, ChatSession.last_worker),
            "last_seen": stmt.excluded.last_seen,
        },
    )
    return int(session.scalar(stmt.returning(ChatSession.turns)) or 0)
