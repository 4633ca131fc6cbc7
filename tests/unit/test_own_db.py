"""tests/helpers.py own_db: each test module's Redis database of the session's
redis-server is its own, whatever order the modules run in (issue 33: modules shared
hand-picked numbers: 8, 10, 14 and 15 were each two modules')."""

from __future__ import annotations

from tests.helpers import own_db, own_redis_url


def test_each_module_and_part_gets_a_database_of_its_own_and_keeps_it() -> None:
    first = own_db("tests.stack.test_a")
    assert own_db("tests.stack.test_a") == first  # the same on every call
    others = {own_db("tests.stack.test_b"), own_db("tests.stack.test_a", "second"),
              own_db("tests.stack.test_c", "sqlite"), own_db("tests.stack.test_c", "pg")}
    assert len(others) == 4 and first not in others
    assert 0 not in {first, *others}  # 0 is the session stack's


def test_the_url_names_the_database_on_the_same_server() -> None:
    url = own_redis_url("redis://127.0.0.1:6390/0", "tests.stack.test_d")
    assert url == f"redis://127.0.0.1:6390/{own_db('tests.stack.test_d')}"
