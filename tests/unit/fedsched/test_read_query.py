"""The check of ad-hoc SQL over ClickHouse's parse (``parseQueryToJSON`` shapes), without an engine."""

import pytest

from fedsched.errors import ValidationError
from fedsched.store import FunctionCatalog, check_read_query

CATALOG = FunctionCatalog.from_rows([
    ("file", "", "System", "Other"), ("FILEALIAS", "file", "System", ""), ("lower", "", "System", "String"),
    ("udf", "", "SQLUserDefined", ""), ("aiGenerate", "", "System", "AI"), ("demangle", "", "System", "Introspection"),
])


def _select(*items, tables=None) -> dict:
    query = {"type": "SelectQuery", "select": {"type": "ExpressionList", "children": list(items)}}
    if tables:
        query["tables"] = {"type": "TablesInSelectQuery", "children": [
            {"type": "TablesInSelectQueryElement", "table_expression": {"type": "TableExpression", "table_function": t}}
            for t in tables]}
    return {"type": "SelectWithUnionQuery", "list_of_selects": {"type": "ExpressionList", "children": [query]}}


def _fn(name, *args) -> dict:
    return {"type": "Function", "name": name, "arguments": {"type": "ExpressionList", "children": list(args)}}


LIT = {"type": "Literal", "value": {"field_type": "String", "value": "/etc/passwd"}}


@pytest.mark.parametrize("ast, says", [
    (_select(_fn("file", LIT)), "file() reads a file of the host"),
    (_select(_fn("FileAlias", LIT)), "FileAlias() reads a file of the host"),  # an alias, in another case
    (_select(_fn("lower", _fn("udf", LIT))), "udf() is user-defined"),
    (_select(_fn("aiGenerate", LIT)), "network AI provider"),
    (_select(_fn("demangle", LIT)), "binary"),
    (_select({"type": "Asterisk", "transformers": {"type": "ColumnsTransformerList", "children": [
        {"type": "ColumnsApplyTransformer", "func_name": "file"}]}}), "file() reads"),
    (_select({"type": "Asterisk"}, tables=[_fn("url", LIT)]), "table function url()"),
    (_select({"type": "Asterisk"}, tables=[_fn("numbers", LIT), _fn("s3", LIT)]), "table function s3()"),
    ({"type": "ExplainQuery", "query": _select(_fn("file", LIT))}, "file() reads"),
    ({"type": "ExplainQuery", "query": {"type": "InsertQuery"}}, "not Insert"),
    ({"type": "CreateQuery"}, "not Create"),
    (_select(LIT) | {"out_file": LIT}, "INTO OUTFILE"),
], ids=["file", "alias", "udf", "ai", "introspection", "apply", "url", "second-table-function", "explain",
        "explain-insert", "create", "outfile"])
def test_reaching_the_host_or_writing_is_refused(ast, says):
    with pytest.raises(ValidationError) as e:
        check_read_query(ast, CATALOG)
    assert e.value.field == "sql" and says in str(e.value)


@pytest.mark.parametrize("ast", [
    _select(_fn("lower", LIT)),
    _select({"type": "Asterisk"}, tables=[_fn("numbers", LIT), _fn("generateSeries", LIT)]),
    _select({"type": "Identifier", "name": "file"}),  # a column called file
    {"type": "ShowTablesQuery"},
    {"type": "ExplainQuery", "query": _select(_fn("lower", LIT))},
], ids=["function", "table-functions", "column-named-file", "show-tables", "explain"])
def test_plain_reads_pass(ast):
    check_read_query(ast, CATALOG)
