"""The lookup's ``Array(String)`` parameter (:func:`fedsched.store.string_array`): a literal made by
one ``join`` when nothing needs escaping, exactly what the client would write; the list (escaped
by the client) otherwise."""

from __future__ import annotations

import pytest
from clickhouse_connect.driver.binding import format_bind_value

from fedsched.store import string_array


def test_plain_ids_are_one_literal_the_client_would_have_written() -> None:
    ids = [f"{i:032x}" for i in range(50)] + ["agent/cn-east-1/c1", "t.status.r.c1", "a_b:c@d+e=f-g", ""]
    assert format_bind_value(string_array(ids)) == format_bind_value(ids)
    assert not isinstance(string_array(ids), list)


@pytest.mark.parametrize("odd", ["it's", "back\\slash", "中文", "a,b", "tab\there", "new\nline", "q\"uote", " "])
def test_a_value_that_needs_escaping_leaves_the_escaping_to_the_client(odd) -> None:
    values = ["0" * 32, odd]
    got = string_array(values)
    assert got == values and format_bind_value(got) == format_bind_value(values)


def test_a_non_string_is_not_made_a_literal() -> None:
    assert string_array(["a", 1]) == ["a", 1]  # type: ignore[list-item]
