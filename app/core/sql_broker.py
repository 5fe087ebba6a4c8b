"""The broker that needs no server: kombu's SQLAlchemy transport (``sqla+<database url>``), with two
fixes for how Tunedeck's workers share it.

- A queue that another process inserts at the same moment is taken, not an error. kombu guards the
  look-up-then-insert of a queue row with a lock of its own process only; two workers that start
  together (the hosts of a slice, declaring the same pool queue) both find the queue missing, and the
  second insert failed with the table's unique constraint, killing that worker's consumer.
- A channel closes its database session when it closes. kombu leaves the session open, holding a
  pooled connection until the garbage collector finds the channel; a worker's beat that measures
  queue depths every few seconds exhausted the pool, and its next measurement hung.

Registered under kombu's own names for the transport (``sqla``, ``sqlalchemy``) when the Celery app is
made, so a broker URL a user sets (``sqla+postgresql://...``) gets the same transport.
"""

from kombu import transport
from kombu.transport import sqlalchemy as kombu_sqla
from sqlalchemy.exc import IntegrityError


class Channel(kombu_sqla.Channel):
    def _get_or_create(self, queue):
        try:
            return super()._get_or_create(queue)
        except IntegrityError:
            # Another process inserted it between our look-up and our insert: it exists now (else the
            # constraint that failed was another, and so is the error).
            self.session.rollback()
            found = self.session.query(self.queue_cls).filter(self.queue_cls.name == queue).first()
            if found is None:
                raise
            return found

    def close(self):
        super().close()
        if self._session is not None:
            self._session.close()
            self._session = None


class Transport(kombu_sqla.Transport):
    Channel = Channel


def register() -> None:
    """Make ``sqla+...`` and ``sqlalchemy+...`` broker URLs use this transport (idempotent), also where
    kombu resolved one of them before."""
    for alias in ("sqla", "sqlalchemy"):
        transport.TRANSPORT_ALIASES[alias] = f"{__name__}:Transport"
        transport._transport_cache.pop(alias, None)
