"""Job files: numbers written as text for double fields (YAML reads ``1e300`` as a string) are
numbers, range-checked; a list or mapping beyond admission's entry limits is refused while the
file is read, before its entries are built (fedapp/cli/jobfile.py)."""

from __future__ import annotations

import time

import pytest

from fedapp.cli.jobfile import MAX_ENTRIES, JobFileError, parse_job_file


@pytest.mark.parametrize("written, want", [
    ("1e300", 1e300), ("'7.5'", 7.5), ("3600", 3600.0), ("1.5e3", 1500.0), ("-2", -2.0),
], ids=["exponent-no-dot", "quoted", "int", "float", "negative"])
def test_a_double_written_as_a_number_or_numeric_text_is_that_number(written, want):
    _, (request,) = parse_job_file(f"tenant: search\nduration: {written}\n")
    assert request.spec.estimated_duration_seconds == want


@pytest.mark.parametrize("written, message", [
    ("1e999", "out of range"), ("1" + "0" * 400, "out of range"), (".inf", "out of range"),
    ("nan", "want a number"), ("'12 h'", "want a number"), ("'0x10'", "want a number"), ("true", "want a number"),
], ids=["exponent-overflow", "huge-int", "yaml-inf", "nan-text", "words", "hex", "bool"])
def test_a_double_that_is_not_a_finite_number_names_the_field(written, message):
    with pytest.raises(JobFileError) as e:
        parse_job_file(f"tenant: search\nduration: {written}\n")
    assert str(e.value).startswith("job.duration:") and message in str(e.value)


def _many(field: str, n: int, mapping: bool) -> str:
    body = "\n".join(f"  k{i}: v{i}" if mapping else f"  - r{i}" for i in range(n))
    return f"tenant: search\n{field}:\n{body}\n"


@pytest.mark.parametrize("field, mapping", [("annotations", True), ("allowed_regions", False),
                                            ("card_model", False)], ids=["map", "list", "flag-alias"])
def test_one_entry_beyond_the_limit_is_refused_naming_the_field(field, mapping):
    limit = MAX_ENTRIES[{"card_model": "card_models"}.get(field, field)]
    parse_job_file(_many(field, limit, mapping))  # at the limit: read as usual
    with pytest.raises(JobFileError) as e:
        parse_job_file(_many(field, limit + 1, mapping))
    assert str(e.value) == f"job.{field}: at most {limit} entries (admission's limit); this file has more"


def test_limits_are_named_by_position_in_a_list_of_jobs_and_inside_the_workload():
    env = ", ".join(f"V{i}: x" for i in range(MAX_ENTRIES["env"] + 1))
    text = f"jobs:\n- tenant: a\n- tenant: b\n  workload: {{image: x, env: {{{env}}}}}\n"
    with pytest.raises(JobFileError, match=r"^jobs\[1\]\.workload\.env: at most 128 entries"):
        parse_job_file(text)


def test_200000_annotations_are_refused_before_the_file_is_built():
    """The tryout's 2.4 MB file took 21 s before admission refused it (limit 64)."""
    text = _many("annotations", 200_000, mapping=True)
    start = time.perf_counter()
    with pytest.raises(JobFileError, match="at most 64 entries"):
        parse_job_file(text)
    assert time.perf_counter() - start < 1.0  # measured: ~0.01 s (the full YAML parse alone: ~26 s)
