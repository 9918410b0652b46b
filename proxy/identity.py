"""Who is calling: the identity headers, validated at the door, and trusted tenants.

:func:`identify` is the one call the request path makes. It reads five headers (names under
``identity:`` in the config):

=====================  ===================  ==================================================
value                  header (default)     when absent or empty
=====================  ===================  ==================================================
tenant                 ``X-Tenant-ID``      ``identity.default_tenant``
run                    ``X-Run-ID``         ``None``
request id             ``X-Request-ID``     a fresh one (``Runtime.next_request_id``)
parent run             ``X-Parent-Run-ID``  ``None``
priority               ``X-Priority``       ``None`` (the queue's default priority)
=====================  ===================  ==================================================

Each value must be visible ASCII (``!`` to ``~``: letters, digits, punctuation; no spaces, no
control characters) and at most :data:`~policies.config.MAX_IDENTITY_LENGTH` characters, and
each header may be sent once. These values become event fields, metric labels, ledger keys and
text on the admin page, so anything else is refused with 400 ``bad_request`` naming the header
(never echoing the value). That also covers non-ASCII bytes: aiohttp decodes header bytes as
UTF-8 with ``surrogateescape``, so Latin-1 text (what Python's ``http.client`` sends for
``X-Tenant-ID: équipe``) would reach Python as a string that ``orjson`` and the metrics
exposition cannot encode.

**Trusted identity.** With ``identity.tenants`` (a table of SHA-256 hex digests of API keys ->
tenants; :func:`proxy.config.load_tenants`), the tenant comes from the caller's credential, not
from what it declares. The credentials read are ``Authorization: Bearer <key>``, every header
of :data:`policies.secrets.API_KEY_HEADERS` (``x-api-key``, ``api-key``, ``x-goog-api-key``,
``Ocp-Apim-Subscription-Key``, ``X-Auth-Token``) and every query field of
:data:`policies.secrets.API_KEY_QUERY_FIELDS` (``?key=``, ``?api_key=``...): upstreams take a
key in any of them (Gemini's OpenAI-compatible endpoint, Azure API Management), and one
that was not read was charged to ``unknown_key_tenant`` (a security trial). Each value sent
in any of them is hashed and looked up, one rule for every place:

* keys in the table give their tenant; keys in it of different tenants are refused with 403
  ``tenant_mismatch``;
* a value not in the table is ignored when a key in it was sent too: it is data (``?key=user123``
  on a key-value tool) or another service's credential (a weather API's ``?apikey=``, a tool
  server's own ``X-Auth-Token``), and the caller is charged to its known key's tenant, so
  no quota is escaped (a review: such requests, authenticated by a known key, were refused
  401 or 403);
* with no key in the table (only unknown values, or no credential at all) the request gets
  ``identity.unknown_key_tenant``, or is refused with 401 ``unknown_api_key`` when that is
  ``null``;
* a tenant header naming another tenant than the credential's is refused with 403
  ``tenant_mismatch`` (sending the same tenant, or none, is fine).

Keys are never stored, logged or echoed: only their digests are compared.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, NamedTuple

from aiohttp import hdrs
from multidict import CIMultiDictProxy, MultiMapping, istr

from policies.config import IDENTITY_VALUE, MAX_IDENTITY_LENGTH, IdentityConfig
from policies.reasons import Reason, Rejected
from policies.secrets import API_KEY_HEADERS, API_KEY_QUERY_FIELDS

if TYPE_CHECKING:
    from aiohttp import web

    from proxy.runtime import Runtime

#: The header a caller may name its request with (events, timeline).
REQUEST_ID_HEADER = istr("X-Request-ID")
#: Headers carrying an API key as their whole value (:data:`policies.secrets.API_KEY_HEADERS`),
#: as ``istr``: a ``str`` name is lower-cased on every look-up in a CIMultiDict.
KEY_HEADERS = tuple(istr(name) for name in API_KEY_HEADERS)
#: Where a request with no key is told to send one.
_KEY_PLACES = ", ".join(("Authorization: Bearer", *API_KEY_HEADERS,
                         *(f"?{name}=" for name in sorted(API_KEY_QUERY_FIELDS))))


class Identity(NamedTuple):
    """The caller of one request, as validated at the door.

    Attributes:
        tenant: whose quota the request spends (trusted when ``identity.tenants`` is set).
        run: the agent run, or ``None``.
        request_id: the caller's ``X-Request-ID`` or a fresh id.
        parent_run: the run that started ``run``, or ``None``.
        priority: the priority header as sent (not yet matched to a known priority), or
            ``None``.
    """

    tenant: str
    run: str | None
    request_id: str
    parent_run: str | None
    priority: str | None


_make_identity = tuple.__new__


class IdentityRejected(Rejected):
    """The request's identity headers or credential were refused.

    Attributes:
        tenant: a tenant safe to log the refusal under: the credential's, when one was
            recognised, else ``identity.default_tenant`` (never a value the caller sent
            unvalidated).
    """

    __slots__ = ("tenant",)

    def __init__(self, reason: Reason, detail: str, tenant: str) -> None:
        super().__init__(reason, None, detail)
        self.tenant = tenant


def identify(rt: Runtime, request: web.BaseRequest) -> Identity:
    """Validate the caller's identity headers (and credential, with trusted identity).

    Raises:
        IdentityRejected: 400 ``bad_request`` for a value that is not visible ASCII, is too
            long or is sent twice; 401 ``unknown_api_key`` or 403 ``tenant_mismatch`` with
            trusted identity (see the module docstring).
    """
    config = rt.config.identity
    headers = request.headers
    getall = headers.getall
    default = config.default_tenant
    # One look-up per header, and the checks only for the values sent: most requests send a
    # tenant at most.
    tenant = getall(config.tenant_header, None)
    if tenant is not None:
        tenant = checked(tenant, config.tenant_header, default)
    run = getall(config.run_header, None)
    if run is not None:
        run = checked(run, config.run_header, default)
    request_id = getall(REQUEST_ID_HEADER, None)
    if request_id is not None:
        request_id = checked(request_id, REQUEST_ID_HEADER, default)
    parent_run = getall(config.parent_run_header, None)
    if parent_run is not None:
        parent_run = checked(parent_run, config.parent_run_header, default)
    priority = getall(config.priority_header, None)
    if priority is not None:
        priority = checked(priority, config.priority_header, default)
    keys = config.keys
    if keys is not None:
        # request.query parses the query string into a new MultiDict: only when there is one.
        tenant = trusted_tenant(config, keys, headers, tenant,
                                request.query if request.query_string else None)
    # tuple.__new__ builds the same Identity in C; a NamedTuple's own __new__ is a Python
    # function (as its _make says).
    return _make_identity(Identity, (tenant or default, run,
                                     request_id or rt.next_request_id(), parent_run, priority))


def checked(values: list[str], name: str, log_as: str) -> str | None:
    """The one value of identity header ``name`` sent as ``values`` (every line of it),
    ``None`` when empty.

    Raises:
        IdentityRejected: 400 ``bad_request`` (logged under tenant ``log_as``) when the value
            is not visible ASCII, is longer than ``MAX_IDENTITY_LENGTH``, or the header is
            sent more than once.
    """
    if len(values) > 1:
        raise IdentityRejected(Reason.BAD_REQUEST, f"{name} is sent {len(values)} times; send "
                               "it once", log_as)
    value = values[0]
    if not value:
        return None
    if len(value) > MAX_IDENTITY_LENGTH or not IDENTITY_VALUE.fullmatch(value):
        raise IdentityRejected(
            Reason.BAD_REQUEST,
            f"{name} takes visible ASCII (letters, digits, punctuation; no spaces or control "
            f"characters), at most {MAX_IDENTITY_LENGTH} characters",
            log_as,
        )
    return value


def key_digest(key: str) -> str:
    """The SHA-256 hex digest ``identity.tenants`` stores for API key ``key``, computed on the
    key's bytes as the caller sent them."""
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()


def credentials(headers: CIMultiDictProxy[str], query: MultiMapping[str] | None = None
                ) -> Iterator[tuple[str, str]]:
    """Every API key the request carries, with where it came: bearer tokens
    (``Authorization``), the :data:`KEY_HEADERS` values and those of ``query``'s fields
    (percent-decoded) named in :data:`policies.secrets.API_KEY_QUERY_FIELDS` (any case), as
    ``?NAME``."""
    for value in headers.getall(hdrs.AUTHORIZATION, ()):
        scheme, _, token = value.partition(" ")
        token = token.strip()
        if scheme.lower() == "bearer" and token:
            yield "Authorization", token
    for name in KEY_HEADERS:
        for value in headers.getall(name, ()):
            if value.strip():
                yield name, value.strip()
    if query:
        for name, value in query.items():
            if name.lower() in API_KEY_QUERY_FIELDS and value.strip():
                yield f"?{name}", value.strip()


def trusted_tenant(config: IdentityConfig, keys: dict[str, str],
                   headers: CIMultiDictProxy[str], claimed: str | None,
                   query: MultiMapping[str] | None = None) -> str:
    """The tenant the request's credentials give, in its ``headers`` and ``query`` (see the
    module docstring): the tenant of the keys in ``keys``, values not in it ignored when one
    is; ``unknown_key_tenant`` when none is.

    Raises:
        IdentityRejected: 401 ``unknown_api_key`` or 403 ``tenant_mismatch``.
    """
    found: str | None = None
    found_in = ""  # where the key that gave ``found`` was
    unknown_in = ""  # where the first value not in the table was
    for place, key in credentials(headers, query):
        tenant = keys.get(key_digest(key))
        if tenant is None:
            unknown_in = unknown_in or place
        elif found is None or tenant == found:
            found, found_in = tenant, place
        else:
            where = (f"two API keys in {place}" if place == found_in
                     else f"the API keys in {found_in} and {place}")
            raise IdentityRejected(Reason.TENANT_MISMATCH,
                                   f"{where} give different tenants: send one key", found)
    known = found is not None  # else found is unknown_key_tenant
    if found is None:
        if config.unknown_key_tenant is None:
            raise IdentityRejected(
                Reason.UNKNOWN_API_KEY,
                f"the API key in {unknown_in} is not in identity.tenants" if unknown_in else
                f"none was sent, and identity.tenants is set: send one as {_KEY_PLACES}",
                config.default_tenant)
        found = config.unknown_key_tenant
    if claimed is not None and claimed != found:
        raise IdentityRejected(
            Reason.TENANT_MISMATCH,
            f"{config.tenant_header} names another tenant than the API key's: send the key's "
            "tenant, or leave the header out" if known else
            f"{config.tenant_header} names another tenant than identity.unknown_key_tenant, "
            "which a request without a known API key gets: send a known key, or leave the "
            "header out",
            found,
        )
    return found
