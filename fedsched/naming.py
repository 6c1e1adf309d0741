"""One label taxonomy and one naming scheme, enforced at every entry point.

Names of regions, zones, clusters, pools, queues, tenants, projects, jobs, nodes, principals,
quota cohorts and card classes follow one rule each (see :data:`RULES`); anything else raises
:class:`~fedsched.errors.InvalidName` naming the kind and the rule. Names are never "fixed up"
silently -- a caller that sends ``CN_North_1`` is told the rule and the canonical form it
probably meant.

Card models are the exception: agents report whatever their driver or trace calls a card
(``NVIDIA-A100-SXM4-80GB``, ``A100 80G``, ``V100M16``), so :func:`canonical_card_model` maps
aliases onto one canonical name from the catalog (``fedsched/catalog/card_models.yaml``) by a
documented rule:

1. split the raw string on anything that is not a letter or digit, upper-case the tokens;
2. drop vendor and form-factor words (NVIDIA, TESLA, GEFORCE, AMD, INSTINCT, HUAWEI, SXM*,
   PCIE, PCI, E, HBM*, GPU; ``NVL`` marks the 94 GiB H100);
3. read the memory size from a token like ``80G``/``80GB``/``80GIB`` or from the openb form
   ``V100M16`` (family ``V100``, 16 GiB);
4. the remaining tokens, joined, are the family (``A100``, ``RTX4090``, ``G2``);
5. look up (family, memory); with no memory given, a family with one variant maps to it.

A card that is not in the catalog still gets a stable canonical name (``<family>[-<mem>gb]``
lower-cased, prefixed ``unlisted-``) so inventories from unseen clusters never crash an agent;
such names are flagged ``catalogued=False`` and are valid for jobs once an agent reports them.

Names become NATS subject tokens and ClickHouse values; the rules exclude dots, wildcards and
whitespace so a valid name can never change a subject's shape.
"""

from __future__ import annotations

import difflib
import re
import unicodedata
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from typing import Iterable

from fedsched.errors import InvalidName, ValidationError
from fedsched.yamltext import load_yaml

_LABEL = r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?"

#: kind -> (compiled pattern, rule in words). Patterns are anchored with fullmatch.
RULES: dict[str, tuple[re.Pattern[str], str]] = {
    kind: (re.compile(pattern), rule)
    for kind, pattern, rule in [
        ("region", r"[a-z]{2,10}(-[a-z0-9]{1,20}){1,3}",
         "lower-case words joined by '-', e.g. 'cn-north-1' (2-4 words, letters first)"),
        ("zone", r"[a-z]{2,10}(-[a-z0-9]{1,20}){1,4}",
         "the region name plus a zone suffix, e.g. 'cn-north-1a'"),
        ("cluster", _LABEL, "an RFC 1123 label starting with a letter, at most 63 characters, e.g. 'cn-north-1-c1'"),
        ("pool", _LABEL, "an RFC 1123 label starting with a letter, at most 63 characters"),
        ("queue", _LABEL, "an RFC 1123 label starting with a letter, at most 63 characters"),
        ("tenant", r"[a-z]([-a-z0-9]{0,30}[a-z0-9])?",
         "lower-case letters, digits and '-', starting with a letter, at most 32 characters"),
        ("project", r"[a-z]([-a-z0-9]{0,30}[a-z0-9])?",
         "lower-case letters, digits and '-', starting with a letter, at most 32 characters"),
        ("job", r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?",
         "an RFC 1123 label starting with a letter, at most 63 characters"),
        ("node", r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?",
         "an RFC 1123 subdomain: lower-case letters, digits, '-' and '.', at most 253 characters"),
        ("dataset", r"[a-z0-9]([-a-z0-9._/]{0,250}[a-z0-9])?",
         "lower-case letters, digits, '-', '.', '_' and '/', at most 252 characters"),
        ("residency_tag", r"[a-z]([-a-z0-9]{0,30}[a-z0-9])?",
         "lower-case letters, digits and '-', starting with a letter, at most 32 characters"),
        ("principal", _LABEL, "an RFC 1123 label starting with a letter, at most 63 characters, e.g. 'alice'"),
        ("cohort", _LABEL, "an RFC 1123 label starting with a letter, at most 63 characters"),
        ("card_class", _LABEL, "an RFC 1123 label starting with a letter, at most 63 characters"),
    ]
}

KINDS = tuple(RULES)


#: Characters a canonical form turns into ``-`` (separators people use in names).
_SEPARATORS = frozenset(" \t_.-/:")


def _canonical_guess(value: str) -> str:
    """``value`` lower-cased with separators (blank, ``_``, ``.``, ``/``, ``:``) as ``-`` and
    accented Latin letters without their accent (``é`` -> ``e``); "" when any other character
    would have to be dropped or replaced (``sеarch`` with a Cyrillic ``е``: guessing ``s-arch``
    would suggest a name nobody meant)."""
    out = []
    for c in value.strip():
        if c.isascii() and c.isalnum():
            out.append(c.lower())
        elif c in _SEPARATORS:
            out.append("-")
        else:
            base = unicodedata.normalize("NFKD", c)
            letters = [b for b in base if not unicodedata.combining(b)]
            if len(letters) != 1 or not (letters[0].isascii() and letters[0].isalnum()):
                return ""
            out.append(letters[0].lower())
    return re.sub(r"-{2,}", "-", "".join(out)).strip("-")


def _suggest(kind: str, value: str, known: Iterable[str] | None = None) -> str:
    """`` (did you mean 'x'?)`` or "" when no suggestion would help. With ``known`` (the names
    that exist), only the closest of them (difflib ratio >= 0.75, compared with ``value``
    lower-cased and folded as far as it folds); without, the canonical form of ``value``
    (:func:`_canonical_guess`) when it fits the kind's rule."""
    pattern, _ = RULES[kind]
    guess = _canonical_guess(value)
    if known is not None:
        names = sorted(set(known))
        close = difflib.get_close_matches(guess or value.strip().lower(), names, n=1, cutoff=0.75)
        guess = close[0] if close else ""
    elif guess and pattern.fullmatch(guess) is None:
        guess = ""
    return f" (did you mean {guess!r}?)" if guess and guess != value else ""


def check_name(kind: str, value: str, field: str | None = None, known: Iterable[str] | None = None) -> str:
    """Return ``value`` if it is a canonical name of ``kind``, else raise.

    Args:
        kind: one of :data:`KINDS`.
        value: the name to check.
        field: request field to name in the error (defaults to ``kind``).
        known: the names of this kind that exist (tenants of the policy, ...): the error
            suggests only one of them; None = suggest the canonical form of ``value``.

    Raises:
        InvalidName: the value breaks the kind's rule; the message gives the rule and a guess
            when one would help (never a name that does not exist when ``known`` is given).
        KeyError: ``kind`` is not a naming kind (a programming error).
    """
    pattern, rule = RULES[kind]
    if not isinstance(value, str) or not value:
        raise InvalidName(kind, str(value), "must not be empty; " + rule, field)
    if pattern.fullmatch(value) is None:
        raise InvalidName(kind, value, rule + _suggest(kind, value, known), field)
    return value


#: Names a "no such ..." message lists at most (then "and N more").
MAX_LISTED = 30


def check_known(kind: str, value: str, known: Iterable[str], field: str) -> str:
    """Return ``value`` if it is one of ``known`` (a well-formed filter that names nothing
    that exists would silently match nothing), else raise.

    Args:
        kind: what the name is (``region``, ``cluster``, ``tenant``), for the message.
        value: the name given.
        known: the names that exist now.
        field: request field to name in the error (``regions[0]``).

    Raises:
        ValidationError: ``field``: ``no such region 'x'; known regions: a, b`` (at most
            :data:`MAX_LISTED` names, sorted, then how many more).
    """
    names = sorted(set(known))
    if value in names:
        return value
    listed = ", ".join(names[:MAX_LISTED]) or "none"
    if len(names) > MAX_LISTED:
        listed += f" and {len(names) - MAX_LISTED} more"
    raise ValidationError(field, f"no such {kind} {value!r}; known {kind}s: {listed}")


def is_name(kind: str, value: str) -> bool:
    """True when ``value`` is a canonical name of ``kind`` (never raises for str input)."""
    pattern, _ = RULES[kind]
    return isinstance(value, str) and pattern.fullmatch(value) is not None


# --------------------------------------------------------------------------- card models


@dataclass(frozen=True, slots=True)
class CardModel:
    """One card model of the catalog.

    Attributes:
        name: canonical name, e.g. ``nvidia-a100-80gb``.
        vendor: ``nvidia``, ``amd``, ``huawei``, ``alibaba`` or ``unknown``.
        family: normalised family, e.g. ``A100``.
        memory_gib: on-card memory in GiB, None when not disclosed.
        interconnect: what the usual server form offers between cards (``nvlink`` or ``pcie``).
        kind: ``gpu`` or ``npu``.
        catalogued: False for names minted for cards the catalog does not list.
    """

    name: str
    vendor: str
    family: str
    memory_gib: int | None
    interconnect: str
    kind: str
    catalogued: bool = True


_NOISE = {
    "NVIDIA", "TESLA", "GEFORCE", "AMD", "INSTINCT", "HUAWEI", "SXM", "SXM2", "SXM3", "SXM4",
    "SXM5", "PCIE", "PCI", "E", "HBM", "HBM2", "HBM2E", "HBM3", "HBM3E", "GPU", "CARD", "ALIBABA",
    "UNLISTED",
}
_MEM_TOKEN = re.compile(r"(\d{1,4})(G|GB|GI|GIB)")
_OPENB_MEM = re.compile(r"([A-Z]+\d+[A-Z]?)M(\d{1,3})")


def _normalise(raw: str) -> tuple[str, int | None]:
    tokens = [t for t in re.split(r"[^A-Za-z0-9]+", raw.upper()) if t]
    memory: int | None = None
    family_tokens: list[str] = []
    for token in tokens:
        if token in _NOISE:
            continue
        mem = _MEM_TOKEN.fullmatch(token)
        if mem is not None:
            memory = int(mem.group(1))
            continue
        openb = _OPENB_MEM.fullmatch(token)
        if openb is not None:
            family_tokens.append(openb.group(1))
            memory = int(openb.group(2))
            continue
        family_tokens.append(token)
    if "NVL" in family_tokens:  # H100 NVL is the 94 GiB variant
        family_tokens.remove("NVL")
        if "".join(family_tokens) == "H100" and memory is None:
            memory = 94
    return "".join(family_tokens), memory


class CardCatalog:
    """Canonical card models with alias resolution (rule in the module docstring).

    Args:
        models: the catalogued models.
        aliases: raw name -> canonical name, for names the rule alone cannot map.
    """

    def __init__(self, models: Iterable[CardModel], aliases: dict[str, str] | None = None) -> None:
        self._aliases = {a.strip().upper(): n for a, n in (aliases or {}).items()}
        self._by_name: dict[str, CardModel] = {}
        self._by_key: dict[tuple[str, int | None], CardModel] = {}
        self._by_family: dict[str, list[CardModel]] = {}
        for model in models:
            self._by_name[model.name] = model
            self._by_key[(model.family, model.memory_gib)] = model
            self._by_family.setdefault(model.family, []).append(model)

    @classmethod
    def from_yaml(cls, text: str) -> "CardCatalog":
        """Build a catalog from the YAML format of ``card_models.yaml``."""
        data = load_yaml(text, "card_catalog") or {}
        models = []
        aliases: dict[str, str] = {}
        for entry in data.get("models", []):
            models.append(CardModel(
                name=entry["name"], vendor=entry["vendor"], family=str(entry["family"]).upper(),
                memory_gib=entry.get("memory_gib"), interconnect=entry.get("interconnect", "pcie"),
                kind=entry.get("kind", "gpu"),
            ))
            for alias in entry.get("aliases", []) or []:
                aliases[str(alias)] = entry["name"]
        return cls(models, aliases)

    @property
    def names(self) -> tuple[str, ...]:
        """All catalogued canonical names, sorted."""
        return tuple(sorted(self._by_name))

    def get(self, name: str) -> CardModel | None:
        """The model with canonical ``name``, or None (also resolves minted ``unlisted-`` names)."""
        model = self._by_name.get(name)
        if model is None and name.startswith("unlisted-"):
            family, memory = _normalise(name)
            return self._mint(family, memory)
        return model

    def resolve(self, raw: str, *, field: str = "card_model") -> tuple[CardModel, ...]:
        """Every catalogued model ``raw`` may mean; a bare family means all its variants.

        ``A100`` -> (nvidia-a100-40gb, nvidia-a100-80gb); ``A100 80G`` -> (nvidia-a100-80gb,).
        Used for a job's allowed card models, where naming a family means "any of them".

        Raises:
            InvalidName: ``raw`` is empty or maps to no catalogued model.
        """
        if not isinstance(raw, str) or not raw.strip() or len(raw) > 100:
            raise InvalidName("card_model", str(raw)[:100], "a card model name or alias of 1-100 characters", field)
        if raw in self._by_name:
            return (self._by_name[raw],)
        alias = self._aliases.get(raw.strip().upper())
        if alias is not None:
            return (self._by_name[alias],)
        family, memory = _normalise(raw)
        exact = self._by_key.get((family, memory))
        if exact is not None:
            return (exact,)
        if memory is None and family in self._by_family:
            return tuple(sorted(self._by_family[family], key=lambda m: m.name))
        known = ", ".join(self.names[:8])
        raise InvalidName("card_model", raw, f"not in the card catalog (e.g. {known}, ...)", field)

    def canonical(self, raw: str, *, memory_gib: int | None = None) -> CardModel:
        """The one model an inventory report means; unknown cards get a minted name.

        Args:
            raw: what the agent or trace calls the card.
            memory_gib: on-card memory if the reporter knows it (e.g. the
                ``nvidia.com/gpu.memory`` label, in GiB); disambiguates a bare family.

        Raises:
            InvalidName: ``raw`` is empty or has no letters/digits.
        """
        if not isinstance(raw, str) or not re.search(r"[A-Za-z0-9]", raw or ""):
            raise InvalidName("card_model", str(raw), "must name a card model")
        if raw in self._by_name:
            return self._by_name[raw]
        alias = self._aliases.get(raw.strip().upper())
        if alias is not None:
            return self._by_name[alias]
        family, memory = _normalise(raw)
        memory = memory if memory is not None else memory_gib
        exact = self._by_key.get((family, memory))
        if exact is not None:
            return exact
        variants = self._by_family.get(family, [])
        if memory is None and len(variants) == 1:
            return variants[0]
        if memory is None and variants:
            # A bare family with several variants and no memory hint: the smallest variant is the
            # conservative reading (a job needing more memory will not be sent there).
            return min(variants, key=lambda m: m.memory_gib or 0)
        return self._mint(family, memory)

    def _mint(self, family: str, memory: int | None) -> CardModel:
        slug = re.sub(r"[^a-z0-9]+", "-", family.lower()).strip("-") or "card"
        name = f"unlisted-{slug}" + (f"-{memory}gb" if memory is not None else "")
        return CardModel(name=name[:63].rstrip("-"), vendor="unknown", family=family, memory_gib=memory,
                         interconnect="pcie", kind="gpu", catalogued=False)


@lru_cache(maxsize=1)
def default_catalog() -> CardCatalog:
    """The catalog shipped in ``fedsched/catalog/card_models.yaml`` (cached)."""
    text = resources.files("fedsched.catalog").joinpath("card_models.yaml").read_text("utf-8")
    return CardCatalog.from_yaml(text)


def canonical_card_model(raw: str, memory_gib: int | None = None) -> str:
    """Canonical name of the card an inventory report calls ``raw`` (see :meth:`CardCatalog.canonical`)."""
    return default_catalog().canonical(raw, memory_gib=memory_gib).name
