"""One bus, one audit store: a second system that would write the same events into another
store is refused (both would get half of the log)."""

import pytest

from fedsched.errors import ConflictError
from fedapp.runtime import System, SystemOptions
from fedsched.settings import Settings
from tests.builders import unique

pytestmark = pytest.mark.e2e


async def test_a_second_store_on_the_same_bus_is_refused(tmp_path, nats_server, chdb_path):
    prefix = unique("p")

    def settings(db: str, sub: str) -> Settings:
        return Settings(data_dir=tmp_path / sub, nats_url=nats_server.url, subject_prefix=prefix,
                        clickhouse_path=chdb_path, clickhouse_database=db, grpc_address="127.0.0.1:0")

    first = System(SystemOptions(settings=settings(unique("db"), "a"), services=("audit", "billing")))
    await first.start()
    try:
        second = System(SystemOptions(settings=settings(unique("db"), "b"), services=("audit",)))
        with pytest.raises(ConflictError, match="different store"):
            await second.start()
        await second.stop()
        same = System(SystemOptions(settings=settings(first.settings.clickhouse_database, "c"), services=("billing",)))
        await same.start()  # another writer of the same store (e.g. billing in its own process) is fine
        await same.stop()
    finally:
        await first.stop()
