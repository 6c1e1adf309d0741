"""The governance policy document (pure): validation with document paths, canonical versions,
diff, bootstrap carry-over, cross-region modes, widening checks, and role predicates."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fedsched.auth import Grant, Principal, bearer_token, hash_token, new_token
from fedsched.errors import AuthError, ValidationError
from fedsched.tenancy import (Governance, canonical, carry_bootstrap, diff, parse_policy, policy_version, to_yaml,
                                 with_principal)
from fedsched.tenancy import GrantDoc, PrincipalDoc
from fedsched.jobs import JobKind, JobSpec, Locality
from tests.builders import TENANTS, policy_text

ROOT = Path(__file__).resolve().parents[3]
H = "a" * 64

# (id, YAML, field the error names)
BAD_DOCS = [
    ("not a mapping", "- 1\n- 2", "policy"),
    ("not YAML", "tenants: [", "policy"),
    ("no tenants", "quotas: []", "tenants"),
    ("tenant name breaks the naming rule", "tenants: [{name: Search, home_region: cn-north-1, projects: [a]}]",
     "tenants[0].name"),
    ("bad home region", "tenants: [{name: s, home_region: North, projects: [a]}]", "tenants[0].home_region"),
    ("unknown mode", "tenants: [{name: s, home_region: cn-north-1, projects: [a], cross_region: maybe}]",
     "tenants[0].cross_region"),
    ("no projects", "tenants: [{name: s, home_region: cn-north-1, projects: []}]", "tenants[0].projects"),
    ("unknown field", "tenants: [{name: s, home_region: cn-north-1, projects: [a], colour: red}]",
     "tenants[0].colour"),
    ("tenant twice", "tenants: [{name: s, home_region: cn-north-1, projects: [a]}, "
                     "{name: s, home_region: cn-north-1, projects: [a]}]", "tenants"),
    ("job class without criteria", "tenants: [{name: s, home_region: cn-north-1, projects: [a], "
                                   "job_classes: [{name: x, cross_region: forbidden}]}]", "tenants[0].job_classes"),
    ("negative budget", "tenants: [{name: s, home_region: cn-north-1, projects: [a], budget: {monthly: -1}}]",
     "tenants[0].budget.monthly"),
    ("quota for an unknown tenant", TENANTS + "quotas: [{tenant: nobody, guaranteed_gpus: 1}]", "quotas[0].tenant"),
    ("quota on an unknown card", TENANTS + "quotas: [{tenant: search, card: Quantum-9, guaranteed_gpus: 1}]",
     "quotas[0].card"),
    ("quota below zero", TENANTS + "quotas: [{tenant: search, guaranteed_gpus: -1}]", "quotas[0].guaranteed_gpus"),
    ("quota in milli-fractions", TENANTS + "quotas: [{tenant: search, guaranteed_gpus: 0.0001}]",
     "quotas[0].guaranteed_gpus"),
    ("borrowing without a cohort", TENANTS + "quotas: [{tenant: search, guaranteed_gpus: 1, borrowing_limit_gpus: 1}]",
     "quotas[0].borrowing_limit_gpus"),
    ("quota twice", TENANTS + "quotas: [{tenant: search, guaranteed_gpus: 1}, {tenant: search, guaranteed_gpus: 2}]",
     "quotas[1]"),
    ("principal without token hash", TENANTS + "principals: [{name: p, roles: [{role: admin}]}]",
     "principals[0].token_sha256"),
    ("token in clear instead of a hash", TENANTS + "principals: [{name: p, token_sha256: secret, roles: [{role: admin}]}]",
     "principals[0].token_sha256"),
    ("unknown role", TENANTS + f"principals: [{{name: p, token_sha256: {H}, roles: [{{role: god}}]}}]",
     "principals[0].roles[0].role"),
    ("submitter of nobody", TENANTS + f"principals: [{{name: p, token_sha256: {H}, roles: [{{role: submitter}}]}}]",
     "principals[0].roles[0].tenants"),
    ("submitter of an unknown project", TENANTS + f"principals: [{{name: p, token_sha256: {H}, roles: "
                                                  "[{role: submitter, tenants: [search], projects: [nope]}]}]",
     "principals[0].roles[0].projects"),
    ("agent without cluster", TENANTS + f"principals: [{{name: p, token_sha256: {H}, roles: "
                                        "[{role: agent, region: cn-north-1}]}]", "principals[0].roles[0].cluster"),
    ("two principals one token", TENANTS + f"principals: [{{name: p, token_sha256: {H}, roles: [{{role: admin}}]}}, "
                                           f"{{name: q, token_sha256: {H}, roles: [{{role: admin}}]}}]",
     "principals[1].token_sha256"),
    ("unknown scorer", TENANTS + "scheduling: {weights: {luck: 1}}", "scheduling.weights"),
    ("limit out of range", TENANTS + "limits: {max_workers: 0}", "limits.max_workers"),
]


@pytest.mark.parametrize("name,text,field", BAD_DOCS, ids=[b[0] for b in BAD_DOCS])
def test_a_bad_policy_names_the_document_path(name, text, field):
    with pytest.raises(ValidationError) as e:
        parse_policy(text)
    assert e.value.field == field, e.value.message


def test_shipped_policies_validate():
    for path in (ROOT / "fedsched/catalog/policy.yaml", ROOT / "deploy/policy/example.yaml"):
        gov = Governance.parse(path.read_text())
        assert {"search", "ads", "nlp", "vision", "recsys"} <= set(gov.tenants)
        assert all(set(t.projects) == {"train", "serve", "batch"} for t in gov.tenants.values())


def test_the_version_is_a_content_hash_independent_of_order_and_format():
    a = parse_policy(policy_text())
    data = canonical(a)
    for section in ("tenants", "principals"):
        data[section] = list(reversed(data[section]))
    data["tenants"][0]["projects"] = list(reversed(data["tenants"][0]["projects"]))
    b = parse_policy(json.dumps(data, indent=3))  # JSON is YAML too
    assert policy_version(a) == policy_version(b) and len(policy_version(a)) == 12
    assert policy_version(parse_policy(to_yaml(a))) == policy_version(a)
    c = parse_policy(policy_text("approvals: {timeout_s: 60}\n"))
    assert policy_version(c) != policy_version(a)


def test_diff_lists_changes_and_never_shows_token_hashes():
    a = parse_policy(policy_text())
    b = parse_policy(policy_text("quotas: [{tenant: nlp, guaranteed_gpus: 8}]\n", tenants=TENANTS.replace(
        "{name: nlp, home_region: cn-east-1, projects: [train, serve, batch]}",
        "{name: nlp, home_region: cn-east-1, projects: [train, serve, batch], cross_region: approval}")))
    alice = next(p for p in b.principals if p.name == "alice")
    b = with_principal(b, alice.model_copy(update={"token_sha256": hash_token("rotated")}))
    changes = diff(a, b)
    assert "tenant nlp: cross_region allowed -> approval" in changes
    assert "quota nlp/*/*: added" in changes
    assert "principal alice: token rotated" in changes
    assert not any(hash_token("rotated") in c for c in changes)
    assert diff(a, a) == []


def test_apply_keeps_the_bootstrap_admin_unless_the_file_names_it():
    current = with_principal(parse_policy(TENANTS), PrincipalDoc(name="admin", token_sha256=H,
                                                                 roles=(GrantDoc(role="admin"),), bootstrap=True))
    new = parse_policy(policy_text())
    merged = carry_bootstrap(current, new)
    assert {p.name for p in merged.principals} == {p.name for p in new.principals} | {"admin"}
    renamed = with_principal(new, PrincipalDoc(name="admin", token_sha256="b" * 64, roles=(GrantDoc(role="admin"),)))
    assert next(p for p in carry_bootstrap(current, renamed).principals if p.name == "admin").token_sha256 == "b" * 64


def _spec(**kw) -> JobSpec:
    base = dict(tenant="ads", project="train", home_region="cn-north-1")
    base.update(kw)
    return JobSpec(**base)


def test_cross_region_mode_is_the_most_restrictive_of_tenant_and_classes():
    gov = Governance.parse(policy_text())
    assert gov.mode_for(_spec()) == ("approval", "tenant ads")
    assert gov.mode_for(_spec(residency_tags=("finance",))) == ("forbidden", "job class ads/finance")
    assert gov.mode_for(_spec(tenant="search"))[0] == "allowed"
    assert gov.mode_for(_spec(tenant="nobody"))[0] == "forbidden"


def test_a_job_may_narrow_its_tenants_policy_but_not_widen_it():
    gov = Governance.parse(policy_text())
    narrowed = gov.admit_spec(_spec(tenant="recsys", home_region="cn-east-1"), locality_given=False)
    assert narrowed.locality == Locality.MUST_LOCAL and narrowed.allowed_regions == ("cn-east-1",)
    ok = gov.admit_spec(_spec(tenant="recsys", home_region="cn-east-1", locality=Locality.MUST_LOCAL),
                        locality_given=True)
    assert ok.locality == Locality.MUST_LOCAL
    for kw, field in ((dict(locality=Locality.GLOBAL), "spec.locality"),
                      (dict(locality=Locality.MUST_LOCAL, allowed_regions=("cn-east-1", "cn-north-1")),
                       "spec.allowed_regions"),
                      (dict(home_region="cn-north-1"), "spec.home_region")):
        kw.setdefault("home_region", "cn-east-1")
        with pytest.raises(ValidationError) as e:
            gov.admit_spec(_spec(tenant="recsys", **kw), locality_given="locality" in kw)
        assert e.value.field == field
    assert gov.admit_spec(_spec(kind=JobKind.TRAINING), locality_given=False).locality == Locality.GLOBAL


def test_tokens_are_stored_as_sha256_and_authenticate_by_hash():
    token = new_token()
    assert token.startswith("fst_") and len(token) > 40
    doc = with_principal(parse_policy(TENANTS), PrincipalDoc(name="p", token_sha256=hash_token(token),
                                                             roles=(GrantDoc(role="admin"),)))
    assert token not in to_yaml(doc)
    gov = Governance.of(doc)
    assert gov.authenticate(token).name == "p" and gov.authenticate(token + "x") is None


@pytest.mark.parametrize("metadata,ok", [
    ((("authorization", "Bearer abc"),), True),
    ((("Authorization", "bearer abc"),), True),
    ((("authorization", "Basic abc"),), False),
    ((("authorization", "Bearer "),), False),
    ((("x-other", "Bearer abc"),), False),
    ((), False),
], ids=["bearer", "case-insensitive", "basic", "empty", "other-key", "none"])
def test_bearer_token_parsing(metadata, ok):
    if ok:
        assert bearer_token(metadata) == "abc"
    else:
        with pytest.raises(AuthError) as e:
            bearer_token(metadata)
        assert "abc" not in e.value.message


def test_role_predicates():
    sub = Principal("s", (Grant("submitter", frozenset({"search"}), frozenset({"train"})),))
    appr = Principal("a", (Grant("approver", frozenset({"*"})),))
    agent = Principal("g", (Grant("agent", region="cn-north-1", cluster="c1"),))
    admin = Principal("r", (Grant("admin"),))
    assert sub.can_submit("search", "train") and not sub.can_submit("search", "serve") and not sub.can_submit("ads", "train")
    assert sub.can_read("search", "train") and not sub.can_read("search", "serve") and not sub.can_read("ads")
    assert appr.can_approve("ads") and appr.can_read("ads", "serve") and not appr.can_submit("ads", "train")
    assert not appr.can_cancel("ads", "train") and appr.readable_tenants() is None
    assert agent.agent_of("c1") and not agent.agent_of("c2") and agent.readable_tenants() == frozenset()
    assert admin.can_submit("x", "y") and admin.can_approve("x") and admin.readable_tenants() is None


def test_yaml_aliases_and_oversize_documents_are_refused():
    """An alias "bomb" (a few lines that expand to billions of nodes) fails fast, naming the rule."""
    bomb = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{n}: &{n} [{', '.join([f'*{p}'] * 9)}]\n" for p, n in zip("abcdefgh", "bcdefghi"))
    with pytest.raises(ValidationError, match="aliases") as e:
        parse_policy(bomb)
    assert e.value.field == "policy"
    with pytest.raises(ValidationError, match="larger than"):
        parse_policy("# " + "x" * 1_000_001)


QUOTA_CASES = [
    # (id, quota YAML, effective borrowing limit in milli-GPU (None = no limit), ceiling)
    ("cohort, no borrowing limit: no limit (Kueue's borrowingLimit)",
     "{tenant: search, card: T4, guaranteed_gpus: 2, cohort: north}", None, None),
    ("cohort, borrowing limit 0: no borrowing", "{tenant: search, card: T4, guaranteed_gpus: 2, cohort: north, "
                                                "borrowing_limit_gpus: 0}", 0, 2000),
    ("cohort, borrowing limit 1.5", "{tenant: search, card: T4, guaranteed_gpus: 2, cohort: north, "
                                    "borrowing_limit_gpus: 1.5}", 1500, 3500),
    ("cohort, null borrowing limit: no limit", "{tenant: search, card: T4, guaranteed_gpus: 2, cohort: north, "
                                               "borrowing_limit_gpus: null}", None, None),
    ("no cohort: never borrows", "{tenant: search, card: T4, guaranteed_gpus: 2}", 0, 2000),
]


@pytest.mark.parametrize("name,quota,borrow,ceiling", QUOTA_CASES, ids=[c[0] for c in QUOTA_CASES])
def test_an_absent_borrowing_limit_means_no_limit(name, quota, borrow, ceiling):
    gov = Governance.of(parse_policy(TENANTS + f"quotas: [{quota}]\n"))
    rule, = gov.quota_rules
    assert rule.borrowing_limit_milli == borrow and rule.ceiling_milli == ceiling
    again = Governance.of(parse_policy(to_yaml(gov.doc)))  # the stored form means the same
    assert again.quota_rules == gov.quota_rules


def test_a_tenants_retry_budget_defaults_and_is_checked() -> None:
    gov = Governance.parse(policy_text(tenants=TENANTS.replace(
        "{name: nlp, home_region: cn-east-1, projects: [train, serve, batch]}",
        "{name: nlp, home_region: cn-east-1, projects: [train, serve, batch], "
        "retries: {max_infra_retries: 1, per_month: 20}}")))
    assert (gov.retry_budget("nlp").max_infra_retries, gov.retry_budget("nlp").per_month) == (1, 20)
    assert (gov.retry_budget("search").max_infra_retries, gov.retry_budget("search").per_month) == (3, None)
    assert gov.retry_budget("nobody").max_infra_retries == 3
    for bad in ("{max_infra_retries: -1}", "{per_month: -5}", "{per_hour: 3}"):
        with pytest.raises(ValidationError) as e:
            parse_policy(policy_text(tenants=TENANTS.replace(
                "{name: nlp, home_region: cn-east-1, projects: [train, serve, batch]}",
                "{name: nlp, home_region: cn-east-1, projects: [train, serve, batch], retries: " + bad + "}")))
        assert "retries" in e.value.field
